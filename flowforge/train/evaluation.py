"""The trainer's held-out evaluation (:meth:`Trainer.evaluate <flowforge.train.trainer.Trainer.evaluate>`): fixed
noise, the ODE sampler, every reward component and eval scorer (paid ones on the first ``eval.teacher_groups`` groups
only), within-prompt diversity, the change since the step-0 eval, and a sample grid."""

from __future__ import annotations

import logging
from typing import Any

import torch

from flowforge.report.grids import save_eval_grid
from flowforge.report.world_strips import real_clips, write_real_strips
from flowforge.rollout import candidate_noise, decode_needed, generate
from flowforge.runtime.run_dir import SAMPLES_DIR, START_SAMPLES_FILE, sample_grid_path
from flowforge.train.metrics import group_diversities, within_group_diversity
from flowforge.train.sample_change import StartSamples, eval_fingerprint

RunningTrainer = Any  # the running flowforge.train.trainer.Trainer, named only (it imports this module)

log = logging.getLogger("flowforge")


def start_samples(trainer: RunningTrainer) -> StartSamples:
    """The step-0 eval's samples of this run (:mod:`flowforge.train.sample_change`), for ``eval/sample_change``."""
    e = trainer.cfg.eval
    return StartSamples(trainer.run_dir / SAMPLES_DIR / START_SAMPLES_FILE,
                        eval_fingerprint(trainer.eval_prompts, e.seed, e.samples_per_prompt, trainer.sigmas.tolist(),
                                         trainer.cfg.sampler.guidance_scale))


@torch.no_grad()
def evaluate(trainer: RunningTrainer, step: int) -> dict[str, float]:
    """Held-out eval with fixed noise (eval seed, prompt index, sample index) and the ODE sampler: the mean of
    every reward component and eval scorer (paid ones on the first ``eval.teacher_groups`` prompts only, their
    billed requests as ``eval/billed/<name>``), within-prompt diversity, the change since the step-0 eval
    (``eval/sample_change``), and a sample grid ``samples/step_N.png``.
    Every rank generates (sharded forwards run in lockstep); rank 0 scores, logs and returns the scalars (``{}``
    elsewhere)."""
    e = trainer.cfg.eval
    k = e.samples_per_prompt
    n_prompts = len(trainer.eval_prompts)
    prompt_idx = torch.arange(n_prompts).repeat_interleave(k)
    ids = (prompt_idx * k + torch.arange(k).repeat(n_prompts)).tolist()
    x_T = candidate_noise(ids, trainer.latent_shape, e.seed, -1).to(trainer.device)
    finals = []
    with trainer.policy.using(trainer.objective.eval_policy):
        for start in range(0, len(ids), e.batch_size):
            rows = prompt_idx[start:start + e.batch_size]
            cond = trainer._conditioning(trainer.eval_cond, trainer.eval_prompts, rows)
            finals.append(generate(trainer.adapter, cond, x_T[start:start + e.batch_size], trainer.sigmas,
                                   trainer.cfg.sampler.guidance_scale))
    latents = torch.cat(finals)  # always decoded: the grid, eval/diversity and sample_change are of pixels
    images, audio = decode_needed(trainer.adapter, latents, trainer.cfg.reward.batch_size, ("pixels", "audio"))
    if not trainer.dist.is_main:
        return {}
    records = [trainer.eval_prompts[i] for i in prompt_idx.tolist()]
    components, metrics = trainer.score_media(images, records, prompt_idx, audio=audio, paid_groups=e.teacher_groups,
                                              latents=latents)
    scalars = {f"eval/{name}": float(torch.nanmean(v)) for name, v in components.items()}
    scalars.update({f"eval/billed/{n}": metrics[f"reward/{n}_billed"] for n in components
                    if f"reward/{n}_billed" in metrics})
    scalars["eval/diversity"] = float(within_group_diversity(images, prompt_idx))
    change = trainer.start_samples.measure(step, images)
    if change is not None:
        scalars["eval/sample_change"] = change
    scalars.update(trainer.guard.observe_eval(step, scalars))  # eval/guard_* when the guard stops the run
    trainer.logger.log_eval(step, scalars)
    # the first sample of each prompt; its prompt and scores go to a sidecar that captions the report's cells
    shown = [r.prompt for r in records[::k]]
    labeller = getattr(trainer.adapter, "frame_labels", None)  # e.g. a world model: each frame's action
    grid = sample_grid_path(trainer.run_dir, step)
    # a world model's eval rows name their real clip: the report shows it frame by frame beside the generated one
    real = (real_clips([r.metadata for r in records[::k]], images.shape[2])
            if labeller is not None and images.ndim == 5 else None)
    save_eval_grid(images[::k], grid, shown,
                   {name: v[::k] for name, v in components.items()}, step,
                   [labeller(p) for p in shown] if labeller is not None else None,
                   all_scores=components, samples_per_prompt=k,  # every sample: the report's standard error
                   audio=None if audio is None else audio.index(list(range(0, len(audio), k))),
                   cell_extras=write_real_strips(grid, real) if real is not None else None,
                   diversity=group_diversities(images, prompt_idx))  # per prompt: the curve's SE
    trainer.logger.log_grid(step, grid)  # to TensorBoard / W&B, captioned
    log.info("eval step %d: %s", step, ", ".join(f"{k_}={v:.4f}" for k_, v in scalars.items()))
    return scalars

