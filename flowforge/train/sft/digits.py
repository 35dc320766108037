"""Flow-matching supervised fine-tuning (rectified flow) — how the embedded default's base policy is made.

Re-exported by :mod:`flowforge.train.sft`; the world model's SFT is :mod:`flowforge.train.sft.world`.

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

Determinism: the model init, the data order, prompt choice, ``sigma``, noise and condition dropout all come from
generators seeded by ``run.seed``; evaluation uses its own generator (``sft.eval_seed``) and never touches the
training stream. The LR is linear warmup then ``sft.lr_schedule`` (:func:`flowforge.policy.lr_lambda`, the RL
trainer's); with the default ``constant`` a run of ``N`` steps is exactly the first ``N`` steps of a longer run, so
the shipped base is identified by ``(seed, steps)`` alone (``linear`` / ``cosine`` decay to 0 at ``sft.steps``).

DigitEval during SFT: the eval prompts are generated with the deterministic ODE sampler
(:func:`flowforge.rollout.generate`, ``sampler.num_steps`` Euler steps on the shift-``sampler.shift`` schedule) from
fixed noise, and scored by :func:`flowforge.demo.classifiers.digit_eval_accuracy` (fraction whose EvalNet argmax is the
requested digit).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flowforge.algorithms.schedules import sample_sigmas
from flowforge.policy import lr_lambda
from flowforge.settings.sections import SIGMA_SAMPLINGS, DataConfig, RunConfig, SamplerConfig, SFTConfig
from flowforge.train.perf import set_cpu_threads

logger = logging.getLogger("flowforge.train.sft")  # the name it had as the package module


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


@dataclass
class _Setup:
    """The model and the data of an SFT run, built once before the first step."""

    adapter: Any  # SD3Adapter around the trained transformer
    x0_all: torch.Tensor  # [N, C, H, W] the sft split in [-1, 1]
    labels: torch.Tensor  # [N] int64 digit of each image
    table: torch.Tensor  # [10, P] int64 prompt rows of each digit's phrasings
    cond_embeds: torch.Tensor  # [R, S, D] encodings of the training prompts
    cond_pooled: torch.Tensor  # [R, D]
    neg_embeds: torch.Tensor  # [1, S, D] the empty prompt (condition dropout)
    neg_pooled: torch.Tensor  # [1, D]
    eval_cond: Any  # Conditioning of the eval prompts, each repeated eval_samples_per_prompt times
    eval_digits: torch.Tensor  # [E] int64 requested digit of each eval row


def _setup(sft: SFTConfig, seed: int, data: DataConfig, model_config: dict[str, Any] | None,
           text_max_length: int) -> _Setup:
    from flowforge.data.preprocess import encode_cached
    from flowforge.data.prompts import load_prompts
    from flowforge.demo.data import load_split
    from flowforge.demo.model import build_tiny_sd3, tiny_sd3_config
    from flowforge.models.sd3.adapter import SD3Adapter
    from flowforge.models.text import MiniLMEncoder

    config = tiny_sd3_config() if model_config is None else dict(model_config)
    transformer = build_tiny_sd3(config, seed=seed).train()
    adapter = SD3Adapter(transformer, MiniLMEncoder(max_length=text_max_length))
    train_records = load_prompts(data.prompts)
    eval_records = load_prompts(data.eval_prompts)
    table = _digit_table(train_records)
    train_cond = encode_cached(adapter.encode, adapter.encoder_id, [r.prompt for r in train_records], data.cache_dir)
    eval_cond = encode_cached(adapter.encode, adapter.encoder_id, [r.prompt for r in eval_records], data.cache_dir)
    adapter.release_text_encoder()
    k = sft.eval_samples_per_prompt
    eval_digits = torch.tensor([int(r.metadata["digit"]) for r in eval_records]).repeat_interleave(k)
    images, labels = load_split("sft")
    return _Setup(adapter=adapter, x0_all=adapter.encode_images(images), labels=labels, table=table,
                  cond_embeds=train_cond.prompt_embeds, cond_pooled=train_cond.pooled,
                  neg_embeds=train_cond.negative.prompt_embeds[:1], neg_pooled=train_cond.negative.pooled[:1],
                  eval_cond=eval_cond.repeat_interleave(k), eval_digits=eval_digits)


def _train_batch(setup: _Setup, idx: torch.Tensor, gen: torch.Generator, sft: SFTConfig):
    """``(x0, noise, sigma, cond)`` of the images ``idx``; draws prompt choice, condition dropout, sigma and noise
    from ``gen`` in that order."""
    from flowforge.models.base import Conditioning

    n = idx.numel()
    x0 = setup.x0_all[idx]
    choice = torch.randint(0, setup.table.shape[1], (n,), generator=gen)
    rows = setup.table[setup.labels[idx], choice]
    drop = torch.rand(n, generator=gen) < sft.cond_dropout
    sigma = sample_sigmas(n, gen, kind=sft.sigma_sampling)
    noise = torch.randn(x0.shape, generator=gen)
    cond = Conditioning(
        prompt_embeds=torch.where(drop[:, None, None], setup.neg_embeds, setup.cond_embeds[rows]),
        pooled=torch.where(drop[:, None], setup.neg_pooled, setup.cond_pooled[rows]),
    )
    return x0, noise, sigma, cond


class _Evaluations:
    """DigitEval at step 0, every ``sft.eval_every`` steps and at the end: the history, sample grids, checkpoints."""

    def __init__(self, setup: _Setup, sft: SFTConfig, sampler: SamplerConfig, text_max_length: int,
                 on_eval: Callable[[dict[str, Any]], None] | None):
        self.setup = setup
        self.sft = sft
        self.sampler = sampler
        self.text_max_length = text_max_length
        self.on_eval = on_eval
        self.out = Path(sft.output)
        self.history: list[dict[str, Any]] = []
        self.losses: list[float] = []
        self.start_time = time.perf_counter()
        self.train_time = 0.0

    def __call__(self, step: int) -> None:
        from flowforge.models.common import FLOWFORGE_META
        from flowforge.report.grids import save_grid

        s = self.setup
        acc, samples = evaluate_digit_eval(s.adapter, s.eval_cond, s.eval_digits, seed=self.sft.eval_seed,
                                           num_steps=self.sampler.num_steps, shift=self.sampler.shift)
        entry = {
            "step": step,
            "digit_eval": acc,
            "loss": float(sum(self.losses) / len(self.losses)) if self.losses else math.nan,
            "elapsed_s": time.perf_counter() - self.start_time,
            "steps_per_s": step / self.train_time if self.train_time > 0 else math.nan,
        }
        self.losses.clear()
        self.history.append(entry)
        logger.info("sft step %d: DigitEval %.3f, loss %.4f, %.2f steps/s", step, acc, entry["loss"],
                    entry["steps_per_s"])
        order = torch.argsort(s.eval_digits, stable=True)
        save_grid(samples[order], self.out / "samples" / f"step_{step:06d}.png", nrow=max(1, len(order) // 10),
                  scale=2)
        if self.sft.save_checkpoints:
            _save(s.adapter.transformer, self.out / "checkpoints" / f"step_{step:06d}", self.text_max_length,
                  FLOWFORGE_META)
        (self.out / "sft_history.json").write_text(json.dumps(self.history, indent=1) + "\n")
        if self.on_eval is not None:
            self.on_eval(entry)


def run_sft(sft: SFTConfig, *, run: RunConfig = RunConfig(), data: DataConfig = DataConfig(),
            sampler: SamplerConfig = SamplerConfig(), model_config: dict[str, Any] | None = None,
            text_max_length: int = 16, progress: bool = False,
            on_eval: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Train the demo policy (tiny pixel-space SD3 + MiniLM) from scratch on the ``sft`` digit split.

    Args:
        sft: steps, batch size, AdamW (lr, weight decay; linear warmup over ``warmup_steps`` then
            ``lr_schedule``), max grad norm, sigma sampling, condition dropout, eval cadence / seed / samples per
            prompt, and ``output``: the directory receiving the final transformer (``config.json``,
            ``diffusion_pytorch_model.safetensors``, ``flowforge.json``), ``sft_history.json``,
            ``samples/step_XXXXXX.png`` grids and, with ``save_checkpoints``, ``checkpoints/step_XXXXXX/`` at
            every evaluation (each loadable by ``load_sd3``).
        run: ``seed`` (model init and the whole training stream) and ``num_threads`` (``torch.set_num_threads``
            when > 0).
        data: ``prompts`` / ``eval_prompts`` (rows need ``metadata.digit``) and ``cache_dir`` (prompt encodings).
        sampler: ``num_steps`` / ``shift`` of the deterministic ODE sampler used for evaluation.
        model_config: ``SD3Transformer2DModel`` kwargs; default ``flowforge.demo.model.tiny_sd3_config()``.
        text_max_length: MiniLM context tokens.
        progress: show a tqdm bar. on_eval: called with each history entry.

    Returns:
        The DigitEval history: one dict per evaluation with ``step``, ``digit_eval``, ``loss`` (mean training loss
        since the previous evaluation; NaN at step 0), ``elapsed_s`` and ``steps_per_s``.

    Raises:
        ValueError: prompts that do not cover every digit equally often (bad section values were refused when the
            sections were built).
    """
    set_cpu_threads(run.num_threads)  # "auto" or a busy machine: measured against one thread
    Path(sft.output).mkdir(parents=True, exist_ok=True)
    setup = _setup(sft, run.seed, data, model_config, text_max_length)
    n = setup.x0_all.shape[0]
    gen = torch.Generator().manual_seed(run.seed)
    params = [p for p in setup.adapter.transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=sft.lr, betas=(0.9, 0.999), weight_decay=sft.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(sft.lr_schedule, sft.warmup_steps, sft.steps))
    evaluate = _Evaluations(setup, sft, sampler, text_max_length, on_eval)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sft.steps, desc="sft")
    evaluate(0)
    perm, cursor = torch.randperm(n, generator=gen), 0
    for step in range(1, sft.steps + 1):
        t0 = time.perf_counter()
        if cursor + sft.batch_size > n:
            perm, cursor = torch.randperm(n, generator=gen), 0
        idx = perm[cursor : cursor + sft.batch_size]
        cursor += sft.batch_size
        loss = flow_matching_loss(setup.adapter, *_train_batch(setup, idx, gen, sft))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if sft.grad_clip and sft.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, sft.grad_clip)
        optimizer.step()
        scheduler.step()
        evaluate.losses.append(float(loss.detach()))
        evaluate.train_time += time.perf_counter() - t0
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{evaluate.losses[-1]:.4f}")
        if step == sft.steps or (sft.eval_every and step % sft.eval_every == 0):
            evaluate(step)
    if bar is not None:
        bar.close()
    from flowforge.models.common import FLOWFORGE_META

    _save(setup.adapter.transformer, Path(sft.output), text_max_length, FLOWFORGE_META)
    return evaluate.history


def _save(transformer, directory: Path, text_max_length: int, meta_name: str) -> None:
    transformer.save_pretrained(str(directory), safe_serialization=True)
    (directory / meta_name).write_text(json.dumps({"text_encoder": "minilm", "max_length": text_max_length}) + "\n")


def run_sft_from_config(cfg, progress: bool = True) -> list[dict[str, Any]]:
    """``flowforge sft CONFIG``: :func:`run_sft` with the ``sft``, ``run``, ``data`` and ``sampler`` sections;
    prints the history. ``model.adapter: world_model`` trains the world model instead
    (:func:`flowforge.train.sft.world.run_world_sft_from_config`)."""
    if cfg.model.adapter == "world_model":
        from flowforge.train.sft.world import run_world_sft_from_config

        return run_world_sft_from_config(cfg)
    history = run_sft(cfg.sft, run=cfg.run, data=cfg.data, sampler=cfg.sampler, progress=progress)
    for entry in history:
        print(f"step {entry['step']:>6d}  DigitEval {entry['digit_eval']:.3f}  loss {entry['loss']:.4f}")
    print(f"saved to {cfg.sft.output}")
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
    p.add_argument("--num-threads", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    sft = SFTConfig(output=args.output_dir, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                    warmup_steps=args.warmup_steps, eval_every=args.eval_every,
                    eval_samples_per_prompt=args.eval_samples_per_prompt, cond_dropout=args.cond_dropout,
                    sigma_sampling=args.sigma_sampling)
    run_sft(sft, run=RunConfig(seed=args.seed, num_threads=args.num_threads), progress=False)


if __name__ == "__main__":
    _cli()
