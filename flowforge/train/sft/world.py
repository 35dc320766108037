"""Supervised training of the world model on real Breakout clips -- how ``demo:world`` is made.

``flowforge sft CONFIG`` with ``model.adapter: world_model`` runs :func:`run_world_sft`. Each step takes
``sft.batch_size`` real training clips (:mod:`flowforge.data.atari`, the train split by episode) and minimises

    L = L_FM + L_tok + L_pred

==========  ==========================================================================================================
term        definition
==========  ==========================================================================================================
``L_FM``    flow-matching MSE ``mean_el(w (v(x_sigma, sigma, a) - (noise - x0))^2)`` over latent frames ``1..f-1``
            (``w``: per-row weights, ``sft.paddle_rows`` / ``paddle_weight``, default 1 everywhere;
            :func:`flowforge.algorithms.losses.anchor_fm_loss`); slot 0 of ``x_sigma`` is the clean first frame
            and never enters the loss. ``sigma`` is logit-normal (``sft.sigma_sampling``); with probability
            ``sft.cond_dropout`` a clip's actions are replaced by the null (all-zero) actions, the unconditional
            branch of guidance; with probability ``sft.direct_action_dropout`` (default 0) a clip's direct action path
            (modulation, context) gets the null actions while the latent state rolls the real ones, so its actions
            reach the video only through B -> coupling and the coupling gates must open
``L_tok``   the transition tokenizer's reconstruction MSE (its codes must carry what changed between frames)
``L_pred``  cross-entropy of the transition predictor against the tokenizer's current codes (no gradient into the
            tokenizer through the labels) -- :func:`flowforge.algorithms.losses.transition_ce_loss`
==========  ==========================================================================================================

The coupling gates start at ``sft.coupling_gate_init`` (default 0, the network's init), so by default the video path
starts as a plain action-conditioned DiT and learns how much to read the latent state. AdamW, linear warmup then
``sft.lr_schedule`` (constant, or linear / cosine decay to 0 at ``sft.steps``), gradient clipping, all from the
``sft`` section; model init, clip order, sigma, noise and dropout come from generators seeded by ``run.seed``.

Evaluation (step 0, every ``sft.eval_every`` steps, the end; its own generator): the held-out clips' first frames
and actions, fixed noise (``sft.eval_seed``), the deterministic ODE sampler (``sampler.num_steps`` Euler steps,
static shift ``sampler.shift``), scored by the game rule ``action_following`` and PSNR against the real future
(:func:`flowforge.algorithms.video_metrics.psnr`). Output: ``sft.output`` holds the model
(:meth:`~flowforge.models.world_model.adapter.WorldModelAdapter.save_pretrained`) and ``sft_history.json``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from flowforge.algorithms.losses import anchor_fm_loss, anchors as anchor_math, transition_ce_loss
from flowforge.policy import lr_lambda
from flowforge.settings.sections import DataConfig, RunConfig, SamplerConfig, SFTConfig
from flowforge.train.perf import set_cpu_threads

logger = logging.getLogger(__name__)


def world_sft_loss(adapter, x0: torch.Tensor, actions: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor,
                   row_weight: torch.Tensor | None = None,
                   direct_keep: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """``L_FM + L_tok + L_pred`` (module table) of clean clips ``x0 [B, C, F, H, W]`` in [-1, 1] with per-frame
    actions ``[B, F, A]`` (one-hot, or zeros for dropped conditions), ``noise`` like ``x0`` and ``sigma [B]``;
    ``row_weight [H]`` (:func:`~flowforge.algorithms.losses.anchors.row_weights`) weighs ``L_FM`` per pixel row;
    ``direct_keep [B]`` (0 / 1, None = all 1; ``sft.direct_action_dropout``): rows with 0 feed the direct action
    path the null actions (:meth:`~flowforge.models.world_model.network.WorldModel.forward`)."""
    from flowforge.models.base import Conditioning
    from flowforge.rollout import generated_index, with_condition

    model = adapter.transformer
    first = x0[:, :, :1]
    cond = Conditioning(prompt_embeds=actions, mask=torch.ones(actions.shape[:2], dtype=torch.long), image=first)
    x_sigma = with_condition(adapter, anchor_math.noised(x0, noise, sigma), cond)
    gen = generated_index(adapter)
    weight = None if row_weight is None else row_weight.view(1, 1, 1, -1, 1)
    if direct_keep is None:
        v = adapter.velocity(x_sigma, sigma, cond, 1.0)
    else:  # the FlowModel contract has no per-row path switch: the network's forward (guidance 1 is one forward)
        v = model(x_sigma, sigma, actions, first, direct_keep=direct_keep)
    fm, _ = anchor_fm_loss(v[gen], x0[gen], noise[gen], weight)
    tok = model.transition_tokenizer.reconstruction_loss(x0)
    pred, m = transition_ce_loss(model.transition_logits(first, actions, x0.shape[2]), model.transition_labels(x0))
    loss = fm + tok + pred
    return loss, {"fm": float(fm.detach()), "tok": float(tok.detach()), "pred": float(pred.detach()),
                  "pred_accuracy": float(m["trans_accuracy"])}


@torch.no_grad()
def evaluate_world(adapter, video: torch.Tensor, actions: torch.Tensor, *, seed: int, num_steps: int, shift: float,
                   batch_size: int = 32) -> dict[str, float]:
    """Generate every clip of ``video [N, 1, F, H, W]`` (in [0, 1]) from its first frame and ``actions [N, F]`` with
    fixed noise (``seed``) and the ODE sampler; returns the mean ``action_following`` (the game rule) and ``psnr``
    (dB, generated frames 1..F-1 against the real ones); a model with the direct action path also gets
    ``action_following_state_only``: the same noise with that path fed the null actions
    (:func:`~flowforge.models.world_model.network.without_direct_actions`), what the latent state alone carries."""
    from flowforge.algorithms.video_metrics import psnr
    from flowforge.demo.world_reward import generate_clips
    from flowforge.models.world_model.adapter import WorldModelAdapter
    from flowforge.models.world_model.network import without_direct_actions
    from flowforge.rewards.scorers.action_following import ActionFollowingScorer

    def rule(clips: torch.Tensor, prompts: list[str]) -> float:
        return float(ActionFollowingScorer()(clips, prompts, [{} for _ in prompts]).mean())

    fake, names = generate_clips(adapter, video, actions, seed=seed, num_steps=num_steps, shift=shift,
                                 batch_size=batch_size)
    other = names[1:] + names[:1]  # the same generations against another clip's actions: the rule's null
    frames_db = psnr(fake.mean(1), video[:, 0])[:, 1:]
    gates = [float(b.coupling.gate.detach().abs().max()) for b in adapter.transformer.blocks]
    out = {"action_following": rule(fake, names), "action_following_other": rule(fake, other),
           "psnr": float(frames_db.mean()), "coupling_gate_max": max(gates), "coupling_gates": gates}
    if adapter.transformer.action_embed is not None:
        blind = WorldModelAdapter(without_direct_actions(adapter.transformer), action_names=adapter.action_names)
        state_only, _ = generate_clips(blind, video, actions, seed=seed, num_steps=num_steps, shift=shift,
                                       batch_size=batch_size)
        out["action_following_state_only"] = rule(state_only, names)
    return out


def run_world_sft(sft: SFTConfig, *, run: RunConfig = RunConfig(), data: DataConfig = DataConfig(),
                  sampler: SamplerConfig = SamplerConfig(), eval_clips: int = 64,
                  clips_config: Any = None, world_config: Any = None) -> list[dict[str, Any]]:
    """Train the demo world model (:func:`flowforge.models.world_model.tiny.tiny_config`) from scratch on the real
    Breakout clips (module docstring); saves it to ``sft.output`` and returns the evaluation history (one dict per
    evaluation: ``step``, ``action_following``, ``psnr``, the mean training losses since the previous one,
    ``elapsed_s``). ``eval_clips`` held-out clips (evenly spaced over the held-out split) are evaluated;
    ``clips_config`` (an :class:`~flowforge.data.atari.AtariDataConfig`, default the demo's) picks the recording,
    ``world_config`` (a :class:`~flowforge.models.world_model.config.WorldModelConfig`, default
    :func:`~flowforge.models.world_model.tiny.tiny_config`) the architecture. Each evaluation also logs
    ``action_following_other`` (the same generations against another clip's actions), ``coupling_gates`` (each
    block's ``|gate|`` of the coupling attention, in block order: whether the latent-state path is open) and
    ``coupling_gate_max`` (the largest of them)."""
    from flowforge.data.atari import ACTIONS, AtariDataConfig, load_atari_clips
    from flowforge.models.world_model.adapter import WorldModelAdapter
    from flowforge.models.world_model.tiny import build_world_model

    set_cpu_threads(run.num_threads)  # "auto" or a busy machine: measured against one thread
    out = Path(sft.output)
    out.mkdir(parents=True, exist_ok=True)
    clips = load_atari_clips(clips_config or AtariDataConfig(), data.cache_dir)
    video, acts = clips.clips(clips.split("train"))
    held = clips.split("heldout")
    held = held[torch.linspace(0, len(held) - 1, min(eval_clips, len(held))).long()]
    eval_video, eval_acts = clips.clips(held)
    adapter = WorldModelAdapter(build_world_model(world_config, seed=run.seed).train(), action_names=ACTIONS)
    with torch.no_grad():
        for block in adapter.transformer.blocks:
            block.coupling.gate.fill_(sft.coupling_gate_init)
    row_weight = anchor_math.row_weights(video.shape[-1], sft.paddle_rows, sft.paddle_weight)
    params = list(adapter.transformer.parameters())
    optimizer = torch.optim.AdamW(params, lr=sft.lr, weight_decay=sft.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(sft.lr_schedule, sft.warmup_steps, sft.steps))
    gen = torch.Generator().manual_seed(run.seed)
    history: list[dict[str, Any]] = []
    losses: list[dict[str, float]] = []
    start = time.perf_counter()

    def evaluate(step: int) -> None:
        adapter.transformer.eval()
        entry = {"step": step, **evaluate_world(adapter, eval_video, eval_acts, seed=sft.eval_seed,
                                                num_steps=sampler.num_steps, shift=sampler.shift)}
        entry.update({k: sum(m[k] for m in losses) / len(losses) for k in (losses[0] if losses else {})})
        entry["elapsed_s"] = time.perf_counter() - start
        losses.clear()
        history.append(entry)
        if sft.save_checkpoints and step:
            adapter.save_pretrained(out / "checkpoints" / f"step_{step:06d}")
        adapter.transformer.train()
        logger.info("world sft step %d: %s", step, {k: [round(g, 4) for g in v] if isinstance(v, list) else round(v, 4)
                                                    for k, v in entry.items()})
        (out / "sft_history.json").write_text(json.dumps(history, indent=1) + "\n")

    evaluate(0)
    for step in range(1, sft.steps + 1):
        rows = torch.randint(0, video.shape[0], (sft.batch_size,), generator=gen)
        x0 = adapter.encode_video(video[rows])
        onehot = torch.nn.functional.one_hot(acts[rows], len(ACTIONS)).float()
        keep = (torch.rand(rows.numel(), generator=gen) >= sft.cond_dropout).float()
        from flowforge.algorithms.schedules import sample_sigmas

        sigma = sample_sigmas(rows.numel(), gen, kind=sft.sigma_sampling)
        noise = torch.randn(x0.shape, generator=gen)
        # drawn last and only when on, so 0 leaves every other draw (and the run) exactly as before
        direct = ((torch.rand(rows.numel(), generator=gen) >= sft.direct_action_dropout).float()
                  if sft.direct_action_dropout else None)
        loss, metrics = world_sft_loss(adapter, x0, onehot * keep[:, None, None], noise, sigma, row_weight, direct)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if sft.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, sft.grad_clip)
        optimizer.step()
        scheduler.step()
        losses.append(metrics)
        if step == sft.steps or (sft.eval_every and step % sft.eval_every == 0):
            evaluate(step)
    adapter.transformer.eval()
    adapter.save_pretrained(out)
    return history


def run_world_sft_from_config(cfg) -> list[dict[str, Any]]:
    """``flowforge sft CONFIG`` for ``model.adapter: world_model``: :func:`run_world_sft` with the ``sft``, ``run``,
    ``data`` and ``sampler`` sections; prints the history."""
    history = run_world_sft(cfg.sft, run=cfg.run, data=cfg.data, sampler=cfg.sampler)
    for e in history:
        state_only = (f"  state only {e['action_following_state_only']:.3f}"
                      if "action_following_state_only" in e else "")
        each = ", ".join(f"{g:.2e}" for g in e.get("coupling_gates", ()))  # absent from histories of older runs
        print(f"step {e['step']:>6d}  action_following {e['action_following']:.3f} (another clip's actions "
              f"{e['action_following_other']:.3f}){state_only}  psnr {e['psnr']:.2f} dB  max |coupling gate| "
              f"{e['coupling_gate_max']:.2e}" + (f" (each block: {each})" if each else ""))
    print(f"saved to {cfg.sft.output}")
    return history
