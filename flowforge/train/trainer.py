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

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from flowforge.train import checkpoint as ckpt
from flowforge import config as config_lib
from flowforge.runtime import distributed as dist_lib
from flowforge.algorithms.advantages import clip_advantages, combine_components, group_stats
from flowforge.config import Config
from flowforge.data.preprocess import encode_cached
from flowforge.data.images import load_condition_images
from flowforge.data.prompts import IMAGE_TASKS, KRepeatSampler, PromptRecord, check_task, load_prompts
from flowforge.train.metrics import (MetricsLogger, StageTimer, write_provenance, sample_grid_path, save_grid, to_scalars,
                              within_group_diversity)
from flowforge.models import build_adapter
from flowforge.models.base import Conditioning
from flowforge.objectives import OBJECTIVES, TrainBatch
from flowforge.policy import Policy
from flowforge.train.preflight import preflight
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
    order: torch.Tensor  # [B] int64 training order of this rank's canonical share (row i = share[order[i]])
    global_group_ids: torch.Tensor  # [M*K] int64 group of every candidate of the step, canonical order
    rank_slice: slice  # this rank's share of the canonical order


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
        world = int(os.environ.get("WORLD_SIZE", "1"))
        report = preflight(cfg, world_size=world)
        self.dist = dist_lib.init(cfg.run.device)
        for warning in report.warnings:
            log.warning(warning)
        self.cfg = cfg
        self.progress = progress and self.dist.is_main
        if cfg.run.num_threads > 0:
            torch.set_num_threads(cfg.run.num_threads)
        torch.manual_seed(cfg.run.seed)
        device = cfg.run.device
        if device == "cuda" and self.dist.enabled:
            device = f"cuda:{self.dist.local_rank}"
        self.device = torch.device(device)
        self.run_dir = Path(cfg.run.output_dir) / cfg.run.name
        self.model_source = _model_source(cfg.model.path)
        if self.model_source is not None:
            ckpt.check_run_dir_outside_source(self.run_dir, self.model_source)
        self.train_prompts = load_prompts(cfg.data.prompts)  # bad prompt files fail before any model loads
        self.eval_prompts = load_prompts(cfg.data.eval_prompts)[: cfg.eval.max_prompts]
        check_task(self.train_prompts, cfg.model.task, "data.prompts")
        check_task(self.eval_prompts, cfg.model.task, "data.eval_prompts")
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(config_lib.dump_config(cfg))
            write_provenance(self.run_dir)
        dist_lib.barrier(self.dist)

        m = cfg.model
        self.adapter = build_adapter(m.adapter, m.path, task=m.task, dtype=DTYPES[m.dtype], device=self.device)
        self.latent_shape = tuple(self.adapter.latent_shape(m.height, m.width, m.frames))
        self.train_cond = _encode(self.adapter, self.train_prompts, cfg.data.cache_dir).to(self.device)
        self.eval_cond = _encode(self.adapter, self.eval_prompts, cfg.data.cache_dir).to(self.device)
        release = getattr(self.adapter, "release_text_encoder", None)
        if release is not None:
            release()
        self.sigmas = self._schedule()

        objective_cls = OBJECTIVES[cfg.train.algorithm]
        total = cfg.train.steps * objective_cls.optimizer_steps_per_batch(cfg)
        d = cfg.distributed
        wrap = None
        if self.dist.enabled:
            wrap = functools.partial(dist_lib.wrap, self.adapter, d.strategy, param_dtype=d.param_dtype,
                                     reduce_dtype=d.reduce_dtype)
        if d.activation_checkpointing:
            self.adapter.transformer.enable_gradient_checkpointing()
        self.policy = Policy(self.adapter, cfg.lora, cfg.train, total_optimizer_steps=total, wrap=wrap,
                             **objective_cls.policy_bank(cfg))
        self.objective = objective_cls(cfg, self.adapter, self.policy)

        self.sampler = KRepeatSampler(len(self.train_prompts), cfg.data.prompts_per_step, cfg.data.group_size,
                                      cfg.run.seed, num_replicas=self.dist.world_size, rank=self.dist.rank)
        r = cfg.reward
        names = list(dict.fromkeys([*r.weights, *cfg.eval.scorers]))
        self.rewards = RewardProcessor({n: build_scorer(n, **r.options.get(n, {})) for n in names}, r.weights,
                                       r.required, batch_size=r.batch_size)
        self.logger = MetricsLogger(self.run_dir) if self.dist.is_main else None
        self.sidecars = None
        if cfg.artifacts.root is not None:
            from flowforge.train.sidecars import SidecarWriter

            root = Path(cfg.artifacts.root)
            self.sidecars = SidecarWriter(root / f"rank_{self.dist.rank}" if self.dist.enabled else root,
                                          cfg.artifacts.keep)
        self.step = 0
        self.base_sha256 = ckpt.sha256_of_path(self.model_source) if self.model_source is not None else None
        self.resumed_from: Path | None = None
        if cfg.train.resume:
            self.resume(cfg.train.resume)

    def _schedule(self) -> torch.Tensor:
        """The sampling schedule; a dynamic-shift family's own pipeline schedule when the adapter provides one."""
        s, m = self.cfg.sampler, self.cfg.model
        pipeline_sigmas = getattr(self.adapter, "pipeline_sigmas", None)
        if s.schedule == "dynamic" and s.mu is None and pipeline_sigmas is not None:
            return pipeline_sigmas(s.num_steps, m.height, m.width).float().cpu()
        return sigmas_for(s, self.latent_shape)

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

    @property
    def _sharded(self) -> bool:
        return self.dist.enabled and self.cfg.distributed.strategy == "fsdp"

    def _dcp_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        opts = StateDictOptions(ignore_frozen_params=True)
        module = self.policy.live_module
        return {"model": get_model_state_dict(module, options=opts),
                "optim": get_optimizer_state_dict(module, self.policy.optimizer, options=opts)}

    def save(self) -> Path:
        """Commit a checkpoint of the current step: every bank policy's weights, the optimizer and LR schedule, the
        trainer state and every rank's RNG. Under FSDP the trainable weights and optimizer are saved sharded with
        torch.distributed.checkpoint (every rank writes its shard); otherwise as safetensors + ``optimizer.pt``."""
        names = [n for n in ("live", "old", "ema") if self.policy.has(n) and not (n == "live" and self._sharded)]
        tensors = {name: self.policy.named_weights(name) for name in names}  # collective under FSDP
        optim = {"scheduler": self.policy.scheduler.state_dict()}
        writer = None
        if self._sharded:
            import torch.distributed.checkpoint as dcp

            state = self._dcp_state()
            writer = lambda directory: dcp.save(state, checkpoint_id=str(directory))  # noqa: E731
        else:
            optim["optimizer"] = self.policy.optimizer.state_dict()
        return ckpt.save_checkpoint(self.run_dir, self.step, tensors=tensors, optimizer_state=optim,
                                    trainer_state=self.state_dict(), keep=self.cfg.checkpoint.keep,
                                    protect=self.resumed_from, rank=self.dist.rank,
                                    world_size=self.dist.world_size,
                                    barrier=(lambda: dist_lib.barrier(self.dist)) if self.dist.enabled else None,
                                    sharded_writer=writer)

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
        state = ckpt.load_checkpoint(path, rank=self.dist.rank)
        ckpt.check_contract(state.trainer_state, self.contract())
        for name, tensors in state.tensors.items():
            self.policy.load_named_weights(name, tensors)
        if "optimizer" in state.optimizer_state:
            self.policy.optimizer.load_state_dict(state.optimizer_state["optimizer"])
        else:
            self._load_sharded(path / ckpt.SHARDED_DIR)
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

    def _load_sharded(self, directory: Path) -> None:
        if not self._sharded:
            raise ValueError(f"{directory.parent} holds sharded (FSDP) state: resume it with distributed.strategy="
                             "'fsdp' under torchrun")
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        state = self._dcp_state()
        dcp.load(state, checkpoint_id=str(directory))  # fails if a trainable tensor is missing from the shards
        opts = StateDictOptions(ignore_frozen_params=True, strict=False)  # frozen base weights are not saved
        set_model_state_dict(self.policy.live_module, state["model"], options=opts)
        set_optimizer_state_dict(self.policy.live_module, self.policy.optimizer, state["optim"], options=opts)

    # ------------------------------------------------------------------------------------------------ stages
    def next_prompts(self) -> StepBatch:
        """Stage 1: this rank's M x K candidates, put in a seeded training order."""
        kb = self.sampler.next_batch()
        order = torch.randperm(kb.local_group_ids.numel(),
                               generator=torch.Generator().manual_seed(self.cfg.run.seed * 7919 + kb.step))
        return StepBatch(prompt_indices=kb.local_prompt_indices[order], group_ids=kb.local_group_ids[order],
                         candidate_ids=kb.local_candidate_ids[order], order=order, global_group_ids=kb.group_ids,
                         rank_slice=kb.rank_slice)

    def sample(self, batch: StepBatch, step: int):
        """Stage 2: roll out the objective's declared trajectories, chunked like the training micro-batches."""
        spec = self.objective.rollout_spec(step)
        cond = self._conditioning(self.train_cond, self.train_prompts, batch.prompt_indices)
        chunk = self.cfg.sampler.batch_size or self.cfg.train.micro_batch_size
        with self.policy.using(self.objective.sampling_policy):
            traj = rollout_chunked(self.adapter, cond, batch.candidate_ids.tolist(), self.sigmas, spec,
                                   latent_shape=self.latent_shape, seed=self.cfg.run.seed, batch_size=chunk,
                                   device=self.device)
        return traj, cond

    def _conditioning(self, cond: Conditioning, records: list[PromptRecord], prompt_indices: torch.Tensor):
        """The conditioning rows of ``prompt_indices``; for image tasks conditioned on each prompt's image by the
        adapter (``ImageConditioned.condition_on_images``; each distinct prompt loaded and encoded once)."""
        if self.cfg.model.task not in IMAGE_TASKS:
            return cond.index(prompt_indices)
        m = self.cfg.model
        distinct, inverse = torch.unique(prompt_indices, return_inverse=True)
        chosen = [records[i] for i in distinct.tolist()]
        images = load_condition_images([r.metadata["image"] for r in chosen], m.height, m.width)
        conditioned = self.adapter.condition_on_images(cond.index(distinct), [r.prompt for r in chosen],
                                                       images.to(self.device), self.latent_shape)
        return conditioned.index(inverse)

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        bs = self.cfg.reward.batch_size
        with torch.no_grad():
            return torch.cat([self.adapter.decode(latents[i:i + bs]) for i in range(0, latents.shape[0], bs)])

    def score(self, media: torch.Tensor, records: list[PromptRecord], group_ids: torch.Tensor):
        """Stage 3: every reward component ``[B]`` and the reward metrics. Video ``[B, 3, F, H, W]`` is scored
        frame by frame as images and each component averaged over the frames."""
        if media.ndim == 4:
            return self.rewards(media, [r.prompt for r in records], [r.metadata for r in records], group_ids)
        frames = media.shape[2]
        components, metrics = self.rewards(_frames(media), [r.prompt for r in records for _ in range(frames)],
                                           [r.metadata for r in records for _ in range(frames)],
                                           group_ids.repeat_interleave(frames))
        return {k: v.view(-1, frames).mean(1) for k, v in components.items()}, metrics

    def advantages(self, components: dict[str, torch.Tensor], batch: StepBatch):
        """Stage 4: group-relative advantages (combined over components, clipped) and the weighted total reward,
        both ``[B]`` in this rank's training order, plus statistics of the whole step.

        The components of every rank are gathered in the sampler's canonical order, so every group is seen whole
        and every rank computes the same advantages; each keeps its own share."""
        a = self.cfg.advantage
        weights = self.cfg.reward.weights
        canonical = torch.argsort(batch.order)
        every = {k: dist_lib.all_gather_cat(components[k][canonical], self.dist) for k in weights}
        gids = batch.global_group_ids
        adv = combine_components(every, weights, gids, mode=a.combine, std_mode=a.std_mode, eps=a.eps,
                                 std_floor=a.std_floor)
        adv = clip_advantages(adv, a.clip)
        total = sum(w * every[k] for k, w in weights.items())
        stats = group_stats(total, gids)
        metrics = {"reward/total_mean": total.mean(), "reward/group_std_mean": stats.std.mean(),
                   "reward/degenerate": stats.degenerate_fraction, "train/adv_abs_mean": adv.abs().mean()}
        for k, v in every.items():
            metrics[f"reward/{k}_mean"], metrics[f"reward/{k}_std"] = v.mean(), v.std(unbiased=False)
        mine = lambda t: t[batch.rank_slice][batch.order]  # noqa: E731
        return mine(adv), mine(total), metrics

    def optimize(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        """Stage 5: the objective's updates; skipped (and said so) when no group of the step, on any rank, has
        reward variance (one decision for every rank: data-parallel ranks must all train or all skip)."""
        active = torch.tensor([float(bool((batch.advantages != 0).any()))])
        if not bool(dist_lib.all_reduce_processes(active, "max")[0]):
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
                adv, total, adv_metrics = self.advantages(components, sb)
            if self.sidecars is not None:
                with timer("sidecars"):
                    self.sidecars.write(step, traj, sb.group_ids, [r.prompt for r in records],
                                        images if images.ndim == 4 else images[:, :, 0],
                                        candidate_ids=sb.candidate_ids, extras={"rewards": total, "advantages": adv})
            with timer("optimize"):
                train_metrics = self.optimize(TrainBatch(traj=traj, cond=cond, advantages=adv, group_ids=sb.group_ids,
                                                         rewards=total, candidate_ids=sb.candidate_ids))
            self.step = step + 1
            local = {**reward_metrics, **to_scalars(train_metrics)}
            local["train/diversity"] = float(within_group_diversity(images, sb.group_ids))
            times = timer.scalars()
            local.update(times)
            local["perf/samples_per_s"] = len(records) / max(sum(times.values()), 1e-9)
            scalars = {**dist_lib.mean_across_ranks(local, self.dist), **to_scalars(adv_metrics)}
            scalars["perf/samples_per_s"] = local["perf/samples_per_s"] * self.dist.world_size
            self.finish_step(scalars)
            bar.set_postfix(reward=f"{scalars['reward/total_mean']:.3f}")
        if self.logger is not None:
            self.logger.close()
        if self.step < cfg.train.steps or not self.dist.is_main:
            return self.run_dir
        from flowforge.train.report import write_report

        write_report(self.run_dir)
        return self.run_dir

    def finish_step(self, scalars: dict[str, float]) -> None:
        """Stage 6: log the step; evaluate every ``eval.every`` steps and after the last; checkpoint every
        ``checkpoint.every`` steps and after the last."""
        if self.logger is not None:
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
        every reward component and eval scorer, within-prompt diversity, and a sample grid ``samples/step_N.png``.
        Every rank generates (sharded forwards run in lockstep); rank 0 scores and logs."""
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
                cond = self._conditioning(self.eval_cond, self.eval_prompts, rows)
                finals.append(generate(self.adapter, cond, x_T[start:start + e.batch_size], self.sigmas,
                                       self.cfg.sampler.guidance_scale))
        images = self._decode(torch.cat(finals))
        if not self.dist.is_main:
            return {}
        records = [self.eval_prompts[i] for i in prompt_idx.tolist()]
        components, _ = self.score(images, records, prompt_idx)
        scalars = {f"eval/{name}": float(torch.nanmean(v)) for name, v in components.items()}
        scalars["eval/diversity"] = float(within_group_diversity(images, prompt_idx))
        self.logger.log_eval(step, scalars)
        firsts = images[::k]
        if firsts.ndim == 5:  # one row of frames per video
            save_grid(_frames(firsts), sample_grid_path(self.run_dir, step), nrow=firsts.shape[2], scale=2)
        else:
            save_grid(firsts, sample_grid_path(self.run_dir, step), nrow=10, scale=2)
        log.info("eval step %d: %s", step, ", ".join(f"{k_}={v:.4f}" for k_, v in scalars.items()))
        return scalars



def _frames(video: torch.Tensor) -> torch.Tensor:
    """``[B, 3, F, H, W]`` -> ``[B * F, 3, H, W]``, frames of a video consecutive."""
    return video.permute(0, 2, 1, 3, 4).flatten(0, 1)


def _model_source(path: str) -> Path | None:
    """The local directory (or file) holding the base weights, or None for a hub id."""
    from flowforge.models.sd3 import DEMO_BASE, demo_base_dir

    if path == DEMO_BASE:
        return demo_base_dir()
    return Path(path) if Path(path).exists() else None
