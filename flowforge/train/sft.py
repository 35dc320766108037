"""Flow-matching supervised fine-tuning (rectified flow) — how the embedded default's base policy is made.

For a clean sample ``x0`` (a digit image mapped to [-1, 1]), Gaussian ``noise`` and a noise level ``sigma``::

    x_sigma = (1 - sigma) * x0 + sigma * noise
    loss    = mean over elements of (v_theta(x_sigma, sigma, c) - (noise - x0))^2

(Lipman et al. 2023, "Flow Matching for Generative Modeling"; Liu et al. 2023, "Flow Straight and Fast"; the SD3
recipe of Esser et al. 2024). ``sigma`` is drawn **logit-normal** by default, ``sigma = sigmoid(m + s * n)``,
``n ~ N(0, 1)`` with ``m = 0, s = 1`` — SD3's choice, which puts more training on intermediate noise levels than
``uniform``; ``sigma_sampling="uniform"`` draws ``sigma ~ U(0, 1)``.

The condition ``c`` of a training image of digit ``d`` is a prompt drawn uniformly, every time, from the training
phrasings of ``d`` (``demo:train``), encoded once by the frozen MiniLM (cached on disk). With probability
``cond_dropout`` the condition is replaced by the empty-prompt encoding (``Conditioning.negative``), so the model
also learns the unconditional velocity that classifier-free guidance needs.

Determinism: the model init (``seed``), the data order, prompt choice, ``sigma``, noise and condition dropout all
come from generators seeded by ``seed``; evaluation uses its own generator (``eval_seed``) and never touches the
training stream. The LR is linear warmup then constant, so a run of ``N`` steps is exactly the first ``N`` steps of
a longer run: the shipped base is identified by ``(seed, steps)`` alone.

DigitEval during SFT: the eval prompts are generated with the deterministic ODE sampler
(:func:`flowforge.rollout.generate`, ``eval_num_steps`` Euler steps on the shift-``eval_shift`` schedule) from fixed
noise, and scored by :func:`flowforge.demo.classifiers.digit_eval_accuracy` (fraction whose EvalNet argmax is the
requested digit).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SIGMA_SAMPLINGS = ("logit_normal", "uniform")


def sample_sigmas(batch: int, generator: torch.Generator, *, kind: str = "logit_normal", logit_mean: float = 0.0,
                  logit_std: float = 1.0) -> torch.Tensor:
    """Training noise levels ``[batch]`` float32 in (0, 1) (see the module docstring).

    Raises:
        ValueError: unknown ``kind`` (allowed: ``SIGMA_SAMPLINGS``).
    """
    if kind == "logit_normal":
        return torch.sigmoid(logit_mean + logit_std * torch.randn(batch, generator=generator))
    if kind == "uniform":
        return torch.rand(batch, generator=generator)
    raise ValueError(f"sigma_sampling={kind!r} is not one of {list(SIGMA_SAMPLINGS)}")


def flow_matching_loss(adapter, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
    """MSE between the predicted velocity at ``x_sigma`` and the target ``noise - x0`` (mean over all elements)."""
    s = sigma.view(-1, *([1] * (x0.dim() - 1)))
    x_sigma = (1.0 - s) * x0 + s * noise
    v = adapter.velocity(x_sigma, sigma, cond, 1.0)
    return torch.nn.functional.mse_loss(v, noise - x0)


def _digit_table(records) -> torch.Tensor:
    """``[10, P]`` row indices into ``records`` of every phrasing of each digit (equal count per digit)."""
    by_digit: dict[int, list[int]] = {d: [] for d in range(10)}
    for i, rec in enumerate(records):
        by_digit[int(rec.metadata["digit"])].append(i)
    counts = {len(v) for v in by_digit.values()}
    if len(counts) != 1 or 0 in counts:
        raise ValueError(f"training prompts must cover every digit equally often, got counts "
                         f"{ {d: len(v) for d, v in by_digit.items()} }")
    return torch.tensor([by_digit[d] for d in range(10)], dtype=torch.long)


@torch.no_grad()
def evaluate_digit_eval(adapter, cond, digits: torch.Tensor, *, seed: int, num_steps: int = 10, shift: float = 3.0,
                        guidance_scale: float = 1.0, batch_size: int = 64) -> tuple[float, torch.Tensor]:
    """Generate one image per row of ``cond`` from fixed noise and score DigitEval.

    Returns:
        ``(accuracy, images [N, 3, H, W] in [0, 1])``.
    """
    from flowforge.algorithms.schedules import flow_match_sigmas
    from flowforge.demo.classifiers import digit_eval_accuracy
    from flowforge.rollout import generate

    was_training = adapter.transformer.training
    adapter.transformer.eval()
    sigmas = flow_match_sigmas(num_steps, shift)
    shape = adapter.latent_shape(adapter.default_resolution, adapter.default_resolution)
    gen = torch.Generator().manual_seed(seed)
    x_T = torch.randn(cond.batch_size, *shape, generator=gen)
    images = []
    for start in range(0, cond.batch_size, batch_size):
        rows = torch.arange(start, min(start + batch_size, cond.batch_size))
        final = generate(adapter, cond.index(rows), x_T[rows].to(adapter.device), sigmas, guidance_scale)
        images.append(adapter.decode(final).cpu())
    adapter.transformer.train(was_training)
    images = torch.cat(images)
    return digit_eval_accuracy(images, digits), images


def run_sft(
    *,
    output_dir: str | Path,
    steps: int = 1500,
    batch_size: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
    warmup_steps: int = 100,
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,
    sigma_sampling: str = "logit_normal",
    cond_dropout: float = 0.1,
    train_prompts: str = "demo:train",
    eval_prompts: str = "demo:eval",
    eval_every: int = 250,
    eval_samples_per_prompt: int = 1,
    eval_seed: int = 1234,
    eval_num_steps: int = 10,
    eval_shift: float = 3.0,
    save_checkpoints: bool = True,
    model_config: dict[str, Any] | None = None,
    text_max_length: int = 16,
    cache_dir: str | Path = ".cache/flowforge",
    num_threads: int | None = None,
    progress: bool = False,
    on_eval: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Train the demo policy (tiny pixel-space SD3 + MiniLM) from scratch on the ``sft`` digit split.

    Args:
        output_dir: receives the final transformer (``config.json``, ``diffusion_pytorch_model.safetensors``,
            ``flowforge.json``), ``sft_history.json``, ``samples/step_XXXXXX.png`` grids and, when
            ``save_checkpoints``, ``checkpoints/step_XXXXXX/`` at every evaluation (each loadable by ``load_sd3``).
        steps: optimizer steps. batch_size: images per step. lr: AdamW learning rate (linear warmup over
            ``warmup_steps``, then constant). weight_decay, grad_clip: AdamW decay and max grad norm.
        seed: model init and the whole training stream.
        sigma_sampling: ``"logit_normal"`` (SD3) or ``"uniform"``. cond_dropout: probability of the empty prompt.
        train_prompts / eval_prompts: prompt sources (``flowforge.data.prompts.load_prompts``); rows need
            ``metadata.digit``.
        eval_every: evaluate DigitEval at step 0, every ``eval_every`` steps and at the end (0: start and end only).
        eval_samples_per_prompt: images per eval prompt. eval_seed: fixed eval noise.
        eval_num_steps, eval_shift: the ODE sampler used for evaluation.
        model_config: ``SD3Transformer2DModel`` kwargs; default ``flowforge.demo.model.tiny_sd3_config()``.
        text_max_length: MiniLM context tokens.
        cache_dir: prompt-encoding cache. num_threads: ``torch.set_num_threads`` when given.
        progress: show a tqdm bar. on_eval: called with each history entry.

    Returns:
        The DigitEval history: one dict per evaluation with ``step``, ``digit_eval``, ``loss`` (mean training loss
        since the previous evaluation; NaN at step 0), ``elapsed_s`` and ``steps_per_s``.

    Raises:
        ValueError: bad arguments (the allowed values are listed).
    """
    from flowforge.data.preprocess import encode_cached
    from flowforge.data.prompts import load_prompts
    from flowforge.demo.data import load_split
    from flowforge.demo.model import build_tiny_sd3, tiny_sd3_config
    from flowforge.train.metrics import save_grid
    from flowforge.models.base import Conditioning
    from flowforge.models.sd3 import FLOWFORGE_META, SD3Adapter
    from flowforge.models.text import MiniLMEncoder

    if steps < 0 or batch_size < 1 or lr <= 0 or warmup_steps < 0 or eval_every < 0:
        raise ValueError(f"need steps >= 0, batch_size >= 1, lr > 0, warmup_steps >= 0, eval_every >= 0; got "
                         f"{steps=}, {batch_size=}, {lr=}, {warmup_steps=}, {eval_every=}")
    if not 0.0 <= cond_dropout < 1.0:
        raise ValueError(f"cond_dropout must be in [0, 1), got {cond_dropout}")
    if sigma_sampling not in SIGMA_SAMPLINGS:
        raise ValueError(f"sigma_sampling={sigma_sampling!r} is not one of {list(SIGMA_SAMPLINGS)}")
    if num_threads:
        torch.set_num_threads(num_threads)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)

    # --- model + conditioning
    config = tiny_sd3_config() if model_config is None else dict(model_config)
    transformer = build_tiny_sd3(config, seed=seed).train()
    adapter = SD3Adapter(transformer, MiniLMEncoder(max_length=text_max_length))
    train_records = load_prompts(train_prompts)
    eval_records = load_prompts(eval_prompts)
    table = _digit_table(train_records)
    train_cond = encode_cached(adapter.encode, adapter.encoder_id, [r.prompt for r in train_records], cache_dir)
    eval_cond = encode_cached(adapter.encode, adapter.encoder_id, [r.prompt for r in eval_records], cache_dir)
    adapter.release_text_encoder()
    eval_cond = eval_cond.repeat_interleave(eval_samples_per_prompt)
    eval_digits = torch.tensor([int(r.metadata["digit"]) for r in eval_records]).repeat_interleave(
        eval_samples_per_prompt)
    cond_embeds, cond_pooled = train_cond.prompt_embeds, train_cond.pooled
    neg_embeds, neg_pooled = train_cond.negative.prompt_embeds[:1], train_cond.negative.pooled[:1]

    # --- data
    images, labels = load_split("sft")
    x0_all = adapter.encode_images(images)  # [N, 1, 32, 32] in [-1, 1]
    n = x0_all.shape[0]

    gen = torch.Generator().manual_seed(seed)
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: min(1.0, (k + 1) / warmup_steps) if warmup_steps > 0 else 1.0)

    history: list[dict[str, Any]] = []
    losses: list[float] = []
    start_time = time.perf_counter()
    train_time = 0.0

    def do_eval(step: int) -> None:
        acc, samples = evaluate_digit_eval(adapter, eval_cond, eval_digits, seed=eval_seed,
                                           num_steps=eval_num_steps, shift=eval_shift)
        entry = {
            "step": step,
            "digit_eval": acc,
            "loss": float(sum(losses) / len(losses)) if losses else math.nan,
            "elapsed_s": time.perf_counter() - start_time,
            "steps_per_s": step / train_time if train_time > 0 else math.nan,
        }
        losses.clear()
        history.append(entry)
        logger.info("sft step %d: DigitEval %.3f, loss %.4f, %.2f steps/s", step, acc, entry["loss"],
                    entry["steps_per_s"])
        order = torch.argsort(eval_digits, stable=True)
        save_grid(samples[order], out / "samples" / f"step_{step:06d}.png", nrow=max(1, len(order) // 10), scale=2)
        if save_checkpoints:
            _save(transformer, out / "checkpoints" / f"step_{step:06d}", text_max_length, FLOWFORGE_META)
        (out / "sft_history.json").write_text(json.dumps(history, indent=1) + "\n")
        if on_eval is not None:
            on_eval(entry)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=steps, desc="sft")
    do_eval(0)
    perm, cursor = torch.randperm(n, generator=gen), 0
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        if cursor + batch_size > n:
            perm, cursor = torch.randperm(n, generator=gen), 0
        idx = perm[cursor : cursor + batch_size]
        cursor += batch_size
        x0 = x0_all[idx]
        choice = torch.randint(0, table.shape[1], (batch_size,), generator=gen)
        rows = table[labels[idx], choice]
        drop = torch.rand(batch_size, generator=gen) < cond_dropout
        sigma = sample_sigmas(batch_size, gen, kind=sigma_sampling)
        noise = torch.randn(x0.shape, generator=gen)
        cond = Conditioning(
            prompt_embeds=torch.where(drop[:, None, None], neg_embeds, cond_embeds[rows]),
            pooled=torch.where(drop[:, None], neg_pooled, cond_pooled[rows]),
        )
        loss = flow_matching_loss(adapter, x0, noise, sigma, cond)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip and grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
        train_time += time.perf_counter() - t0
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if step == steps or (eval_every and step % eval_every == 0):
            do_eval(step)
    if bar is not None:
        bar.close()
    _save(transformer, out, text_max_length, FLOWFORGE_META)
    return history


def _save(transformer, directory: Path, text_max_length: int, meta_name: str) -> None:
    transformer.save_pretrained(str(directory), safe_serialization=True)
    (directory / meta_name).write_text(json.dumps({"text_encoder": "minilm", "max_length": text_max_length}) + "\n")


def run_sft_from_config(cfg, progress: bool = True) -> list[dict[str, Any]]:
    """``flowforge sft CONFIG``: :func:`run_sft` with the ``sft`` section plus ``run.seed`` / ``run.num_threads``,
    ``data.prompts`` / ``data.eval_prompts`` / ``data.cache_dir`` and the sampler's ``num_steps`` / ``shift`` for
    evaluation. Optional ``sft`` fields (``sigma_sampling``, ``cond_dropout``, ``weight_decay``, ``grad_clip``,
    ``eval_samples_per_prompt``, ``eval_seed``) are used when the config defines them."""
    sft = cfg.sft
    optional = {k: getattr(sft, k) for k in ("sigma_sampling", "cond_dropout", "weight_decay", "grad_clip",
                                               "eval_samples_per_prompt", "eval_seed") if hasattr(sft, k)}
    history = run_sft(
        output_dir=sft.output, steps=sft.steps, batch_size=sft.batch_size, lr=sft.lr, seed=cfg.run.seed,
        warmup_steps=sft.warmup_steps, eval_every=sft.eval_every, train_prompts=cfg.data.prompts,
        eval_prompts=cfg.data.eval_prompts, eval_num_steps=cfg.sampler.num_steps, eval_shift=cfg.sampler.shift,
        cache_dir=cfg.data.cache_dir, num_threads=cfg.run.num_threads or None, progress=progress, **optional,
    )
    for entry in history:
        print(f"step {entry['step']:>6d}  DigitEval {entry['digit_eval']:.3f}  loss {entry['loss']:.4f}")
    print(f"saved to {sft.output}")
    return history


def _cli(argv: Sequence[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="flow-matching SFT of the demo policy (see flowforge.train.sft)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-samples-per-prompt", type=int, default=1)
    p.add_argument("--cond-dropout", type=float, default=0.1)
    p.add_argument("--sigma-sampling", default="logit_normal", choices=SIGMA_SAMPLINGS)
    p.add_argument("--num-threads", type=int, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    run_sft(output_dir=args.output_dir, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
            warmup_steps=args.warmup_steps, eval_every=args.eval_every,
            eval_samples_per_prompt=args.eval_samples_per_prompt, cond_dropout=args.cond_dropout,
            sigma_sampling=args.sigma_sampling, num_threads=args.num_threads, progress=False)


if __name__ == "__main__":
    _cli()
