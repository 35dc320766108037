"""The training loop: six named stages per step, nothing else.

::

    for step in range(state.step, train.steps):
        batch   = next_prompts()            # 1 prompts    M prompts x K candidates, this rank's share, training order
        traj    = sample(batch)             # 2 sample     trajectories (+ per-step log-probs when the objective needs)
        rewards = score(traj, batch)        # 3 reward     [B] per component
        adv     = advantages(rewards)       # 4 advantage  group-relative
        metrics = optimize(traj, adv)       # 5 optimize   the objective's updates
        finish_step(step, metrics)          # 6 log / eval / report

Rows are put in a seeded training order *before* the rollout, and the rollout is chunked exactly like the training
micro-batches, so replaying the first update runs the same computations as the rollout (ratio exactly 1).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from flowforge import checkpoint as ckpt
from flowforge import config as config_lib
from flowforge.algorithms.advantages import clip_advantages, combine_components, group_stats
from flowforge.config import Config
from flowforge.data.preprocess import encode_cached
from flowforge.data.prompts import KRepeatSampler, PromptRecord, load_prompts
from flowforge.metrics import (MetricsLogger, StageTimer, write_provenance, sample_grid_path, save_grid, to_scalars,
                              within_group_diversity)
from flowforge.models import build_adapter
from flowforge.objectives import OBJECTIVES, TrainBatch
from flowforge.policy import Policy
from flowforge.preflight import preflight
from flowforge.rewards.processor import RewardProcessor
from flowforge.rewards.registry import build_scorer
from flowforge.rollout import candidate_noise, generate, rollout_chunked, sigmas_for

log = logging.getLogger("flowforge")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class StepBatch:
    """Stage 1's output: this rank's candidates of one step, in training order."""

    prompt_indices: torch.Tensor  # [B] int64 index into the prompt list
    group_ids: torch.Tensor  # [B] int64
    candidate_ids: torch.Tensor  # [B] int64 stable per-candidate sample ids (noise seeds)


def _encode(adapter, records: list[PromptRecord], cache_dir: str):
    prompts = [r.prompt for r in records]
    encoder_id = getattr(adapter, "encoder_id", type(adapter).__name__)
    return encode_cached(adapter.encode, encoder_id, prompts, Path(cache_dir), batch_size=64)


class Trainer:
    """Builds everything a run needs from a validated config, then runs :meth:`train`.

    Raises:
        PreflightError: the config is invalid (every violation listed), before any model loads.
    """

    def __init__(self, cfg: Config, *, progress: bool = True):
        report = preflight(cfg)
        for warning in report.warnings:
            log.warning(warning)
        self.cfg = cfg
        self.progress = progress
        if cfg.run.num_threads > 0:
            torch.set_num_threads(cfg.run.num_threads)
        torch.manual_seed(cfg.run.seed)
        self.device = torch.device(cfg.run.device)
        self.run_dir = Path(cfg.run.output_dir) / cfg.run.name
        self.model_source = _model_source(cfg.model.path)
        if self.model_source is not None:
            ckpt.check_run_dir_outside_source(self.run_dir, self.model_source)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(config_lib.dump_config(cfg))
        write_provenance(self.run_dir)

        m = cfg.model
        self.adapter = build_adapter(m.adapter, m.path, dtype=DTYPES[m.dtype], device=self.device)
        self.latent_shape = tuple(self.adapter.latent_shape(m.height, m.width, m.frames))
        self.train_prompts = load_prompts(cfg.data.prompts)
        self.eval_prompts = load_prompts(cfg.data.eval_prompts)[: cfg.eval.max_prompts]
        self.train_cond = _encode(self.adapter, self.train_prompts, cfg.data.cache_dir).to(self.device)
        self.eval_cond = _encode(self.adapter, self.eval_prompts, cfg.data.cache_dir).to(self.device)
        release = getattr(self.adapter, "release_text_encoder", None)
        if release is not None:
            release()
        self.sigmas = sigmas_for(cfg.sampler, self.latent_shape)

        objective_cls = OBJECTIVES[cfg.train.algorithm]
        total = cfg.train.steps * objective_cls.optimizer_steps_per_batch(cfg)
        self.policy = Policy(self.adapter, cfg.lora, cfg.train, total_optimizer_steps=total,
                             **objective_cls.policy_bank(cfg))
        self.objective = objective_cls(cfg, self.adapter, self.policy)
        if cfg.grpo.kl_weight > 0 or cfg.nft.ref_weight > 0:
            self.policy.keep_reference()

        self.sampler = KRepeatSampler(len(self.train_prompts), cfg.data.prompts_per_step, cfg.data.group_size,
                                      cfg.run.seed)
        r = cfg.reward
        names = list(dict.fromkeys([*r.weights, *cfg.eval.scorers]))
        self.rewards = RewardProcessor({n: build_scorer(n, **r.options.get(n, {})) for n in names}, r.weights,
                                       r.required, batch_size=r.batch_size)
        self.logger = MetricsLogger(self.run_dir)
        self.step = 0
        self.base_sha256 = ckpt.sha256_of_path(self.model_source) if self.model_source is not None else None
        self.resumed_from: Path | None = None
        if cfg.train.resume:
            self.resume(cfg.train.resume)

    # ------------------------------------------------------------------------------------------------ state
    def contract(self) -> dict:
        """What a checkpoint must agree with to be resumed: the trainable-weights contract and the base model."""
        lo = self.cfg.lora
        lora = {"trainable": lo.trainable, "dropout": lo.dropout}
        if lo.trainable == "lora":
            lora.update(rank=self.policy.rank, alpha=self.policy.alpha, targets=sorted(self.policy.targets))
        return {"lora": lora, "base_model_sha256": self.base_sha256}

    def state_dict(self) -> dict:
        """JSON-able trainer state written into every checkpoint's ``trainer_state.json``."""
        return {"step": self.step, "optimizer_steps": self.policy.optimizer_steps,
                "policy_version": self.policy.optimizer_steps, "lr_schedule_step": self.policy.scheduler.last_epoch,
                "sampler": self.sampler.state_dict(), "config_fingerprint": config_lib.fingerprint(self.cfg),
                **self.contract()}

    def save(self) -> Path:
        """Commit a checkpoint of the current step (weights of every bank policy, optimizer, state, RNG)."""
        tensors = {name: self.policy.named_weights(name) for name in ("live", "old", "ema") if self.policy.has(name)}
        optim = {"optimizer": self.policy.optimizer.state_dict(), "scheduler": self.policy.scheduler.state_dict()}
        return ckpt.save_checkpoint(self.run_dir, self.step, tensors=tensors, optimizer_state=optim,
                                    trainer_state=self.state_dict(), keep=self.cfg.checkpoint.keep,
                                    protect=self.resumed_from)

    def resume(self, resume: str) -> None:
        """Restore everything :meth:`save` wrote; training continues at the next step.

        Raises:
            ValueError: an explicit checkpoint without ``COMMITTED``; a LoRA-contract or base-model mismatch.
        """
        path, notes = ckpt.resolve_resume(self.run_dir, resume)
        for note in notes:
            log.warning(note)
        if path is None:
            log.info("train.resume=%s: no committed checkpoint in %s, starting from scratch", resume, self.run_dir)
            return
        state = ckpt.load_checkpoint(path)
        ckpt.check_contract(state.trainer_state, self.contract())
        for name, tensors in state.tensors.items():
            self.policy.load_named_weights(name, tensors)
        self.policy.optimizer.load_state_dict(state.optimizer_state["optimizer"])
        self.policy.scheduler.load_state_dict(state.optimizer_state["scheduler"])
        ts = state.trainer_state
        if ts.get("config_fingerprint") != config_lib.fingerprint(self.cfg):
            log.warning("resuming %s with a config that differs from the checkpoint's (fingerprint %s vs %s)",
                        path, ts.get("config_fingerprint"), config_lib.fingerprint(self.cfg))
        self.policy.optimizer_steps = ts["optimizer_steps"]
        self.sampler.load_state_dict(ts["sampler"])
        self.step = ts["step"]
        if state.rng is not None:
            ckpt.restore_rng(state.rng)
        self.resumed_from = path
        log.info("resumed from %s at step %d", path, self.step)

    # ------------------------------------------------------------------------------------------------ stages
    def next_prompts(self) -> StepBatch:
        """Stage 1: this rank's M x K candidates, put in a seeded training order."""
        kb = self.sampler.next_batch()
        order = torch.randperm(kb.local_group_ids.numel(),
                               generator=torch.Generator().manual_seed(self.cfg.run.seed * 7919 + kb.step))
        return StepBatch(prompt_indices=kb.local_prompt_indices[order], group_ids=kb.local_group_ids[order],
                         candidate_ids=kb.local_candidate_ids[order])

    def sample(self, batch: StepBatch, step: int):
        """Stage 2: roll out the objective's declared trajectories, chunked like the training micro-batches."""
        spec = self.objective.rollout_spec(step)
        cond = self.train_cond.index(batch.prompt_indices)
        chunk = self.cfg.sampler.batch_size or self.cfg.train.micro_batch_size
        with self.policy.using(self.objective.sampling_policy):
            traj = rollout_chunked(self.adapter, cond, batch.candidate_ids.tolist(), self.sigmas, spec,
                                   latent_shape=self.latent_shape, seed=self.cfg.run.seed, batch_size=chunk,
                                   device=self.device)
        return traj, cond

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        bs = self.cfg.reward.batch_size
        with torch.no_grad():
            return torch.cat([self.adapter.decode(latents[i:i + bs]) for i in range(0, latents.shape[0], bs)])

    def score(self, images: torch.Tensor, records: list[PromptRecord], group_ids: torch.Tensor):
        """Stage 3: every reward component ``[B]`` and the reward metrics."""
        return self.rewards(images, [r.prompt for r in records], [r.metadata for r in records], group_ids)

    def advantages(self, components: dict[str, torch.Tensor], group_ids: torch.Tensor):
        """Stage 4: group-relative advantages ``[B]`` (combined over components, clipped), the weighted total
        reward ``[B]`` and group statistics."""
        a = self.cfg.advantage
        weights = self.cfg.reward.weights
        adv = combine_components({k: components[k] for k in weights}, weights, group_ids, mode=a.combine,
                                 std_mode=a.std_mode, eps=a.eps, std_floor=a.std_floor)
        adv = clip_advantages(adv, a.clip)
        total = sum(w * components[k] for k, w in weights.items())
        stats = group_stats(total, group_ids)
        metrics = {"reward/total_mean": total.mean(), "reward/group_std_mean": stats.std.mean(),
                   "reward/degenerate": stats.degenerate_fraction, "train/adv_abs_mean": adv.abs().mean()}
        return adv, total, metrics

    def optimize(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        """Stage 5: the objective's updates; skipped (and said so) when no group has reward variance."""
        if not bool((batch.advantages != 0).any()):
            return {"train/skipped": torch.ones(())}
        metrics = self.objective.optimize(batch)
        out = {f"train/{k}": v for k, v in metrics.items()}
        out["train/skipped"] = torch.zeros(())
        out["train/lr"] = torch.tensor(self.policy.lr)
        return out

    # ------------------------------------------------------------------------------------------------ loop
    def train(self, stop_at: int | None = None) -> Path:
        """Run to ``train.steps`` steps (evaluating before the first, every ``eval.every`` and after the last);
        writes ``metrics.jsonl``, ``eval.jsonl``, ``samples/``, ``report.html``. Returns the run directory.

        ``stop_at`` ends the run early after that many steps, as an interruption would (no final eval / report;
        the LR schedule still spans ``train.steps``); a later ``train.resume`` continues it exactly."""
        cfg = self.cfg
        if self.step == 0:
            self.evaluate(0)
        end = cfg.train.steps if stop_at is None else min(stop_at, cfg.train.steps)
        bar = tqdm(range(self.step, end), desc=cfg.run.name, disable=not self.progress,
                   initial=self.step, total=cfg.train.steps)
        for step in bar:
            timer = StageTimer()
            with timer("prompts"):
                sb = self.next_prompts()
                records = [self.train_prompts[i] for i in sb.prompt_indices.tolist()]
            with timer("sample"):
                traj, cond = self.sample(sb, step)
            with timer("reward"):
                images = self._decode(traj.final)
                components, reward_metrics = self.score(images, records, sb.group_ids)
            with timer("advantage"):
                adv, total, adv_metrics = self.advantages(components, sb.group_ids)
            with timer("optimize"):
                train_metrics = self.optimize(TrainBatch(traj=traj, cond=cond, advantages=adv, group_ids=sb.group_ids,
                                                         rewards=total, candidate_ids=sb.candidate_ids))
            self.step = step + 1
            scalars = {**reward_metrics, **to_scalars({**adv_metrics, **train_metrics})}
            scalars["train/diversity"] = float(within_group_diversity(images, sb.group_ids))
            times = timer.scalars()
            scalars.update(times)
            scalars["perf/samples_per_s"] = len(records) / max(sum(times.values()), 1e-9)
            self.finish_step(scalars)
            bar.set_postfix(reward=f"{scalars['reward/total_mean']:.3f}")
        self.logger.close()
        if self.step < cfg.train.steps:
            return self.run_dir
        from flowforge.report import write_report

        write_report(self.run_dir)
        return self.run_dir

    def finish_step(self, scalars: dict[str, float]) -> None:
        """Stage 6: log the step; evaluate every ``eval.every`` steps and after the last; checkpoint every
        ``checkpoint.every`` steps and after the last."""
        self.logger.log(self.step, scalars)
        every = self.cfg.eval.every
        if (every and self.step % every == 0) or self.step == self.cfg.train.steps:
            self.evaluate(self.step)
        c = self.cfg.checkpoint
        if c.every and (self.step % c.every == 0 or self.step == self.cfg.train.steps):
            self.save()

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out eval with fixed noise (eval seed, prompt index, sample index) and the ODE sampler: the mean of
        every reward component and eval scorer, within-prompt diversity, and a sample grid ``samples/step_N.png``."""
        e = self.cfg.eval
        k = e.samples_per_prompt
        n_prompts = len(self.eval_prompts)
        prompt_idx = torch.arange(n_prompts).repeat_interleave(k)
        ids = (prompt_idx * k + torch.arange(k).repeat(n_prompts)).tolist()
        x_T = candidate_noise(ids, self.latent_shape, e.seed, -1).to(self.device)
        finals = []
        with self.policy.using(self.objective.eval_policy):
            for start in range(0, len(ids), e.batch_size):
                rows = prompt_idx[start:start + e.batch_size]
                finals.append(generate(self.adapter, self.eval_cond.index(rows), x_T[start:start + e.batch_size],
                                       self.sigmas, self.cfg.sampler.guidance_scale))
        images = self._decode(torch.cat(finals))
        records = [self.eval_prompts[i] for i in prompt_idx.tolist()]
        components, _ = self.score(images, records, prompt_idx)
        scalars = {f"eval/{name}": float(torch.nanmean(v)) for name, v in components.items()}
        scalars["eval/diversity"] = float(within_group_diversity(images, prompt_idx))
        self.logger.log_eval(step, scalars)
        save_grid(images[::k], sample_grid_path(self.run_dir, step), nrow=10, scale=2)
        log.info("eval step %d: %s", step, ", ".join(f"{k_}={v:.4f}" for k_, v in scalars.items()))
        return scalars



def _model_source(path: str) -> Path | None:
    """The local directory (or file) holding the base weights, or None for a hub id."""
    from flowforge.models.sd3 import DEMO_BASE, demo_base_dir

    if path == DEMO_BASE:
        return demo_base_dir()
    return Path(path) if Path(path).exists() else None
