"""The training loop: six named stages per step, nothing else.

::

    for step in range(state.step, train.steps):
        batch   = next_prompts()               # 1 prompts    M prompts x K candidates, this rank's share, in order
        traj    = sample(batch, step)          # 2 sample     trajectories (+ per-step log-probs when needed)
        media, rewards = score(traj, batch)    # 3 reward     decoded media, [B] per component
        adv     = advantages(rewards, batch)   # 4 advantage  group-relative, over all ranks
        metrics = optimize(traj, adv)          # 5 optimize   the objective's updates
        finish_step(step, ...)                 # 6 log / eval / checkpoint

Seams, not methods to override (:mod:`flowforge.train.seams`): a *prompt source* picks each step's prompts and is told
what became of them (the sampler's by default; the pipeline's condition ledger), and *step hooks* are called at fixed
points (before the step, rolled out, scored, trained, before / after an evaluation). A group whose weighted reward
failed (NaN) is dropped with zero weight and counted, in every run.

Rows are put in a seeded training order *before* the rollout, chunked exactly like the training micro-batches, so
replaying the first update runs the same computations as the rollout (ratio exactly 1).

Beside the loop: the run directory's lifecycle (:class:`~flowforge.train.run_lifecycle.RunDirectory`), save /
resume (:class:`~flowforge.train.checkpoint.manager.CheckpointManager`), the decode at the rollout boundary
(:func:`flowforge.rollout.decode_needed`: only what is read).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from flowforge import config as config_lib
from flowforge.runtime import context_parallel as cp, distributed as dist_lib
from flowforge.runtime.dtypes import resolve_dtype
from flowforge.runtime.interrupt import Interrupted, StopSignals
from flowforge.algorithms.advantages import clip_advantages, combine_components, group_stats
from flowforge.config import Config
from flowforge.data.preprocess import StreamedConditioning, encode_run_prompts
from flowforge.data.images import condition_inputs
from flowforge.data.prompts import IMAGE_TASKS, KRepeatSampler, PromptRecord, condition_images
from flowforge.train import evaluation
from flowforge.train.metrics import StageTimer, to_scalars, within_group_diversity
from flowforge.train.sample_change import StartSamples
from flowforge.train.step_batch import StepBatch  # noqa: F401 -- also imported from here
from flowforge.train.seams import PromptSource, SamplerPrompts, StepHook, drop_failed_groups, dropped_metrics
from flowforge.runtime.run_dir import sha256_of_path
from flowforge.demo.paths import resolve_demo_path
from flowforge.models import build_adapter, configure_sampling
from flowforge.models.base import Conditioning
from flowforge.objectives import OBJECTIVES, TrainBatch
from flowforge.objectives.anchors import anchor_policy_bank, build_anchor
from flowforge.policy import OptimizerSettings, Policy, TrainableWeights
from flowforge.settings import resume_fingerprint
from flowforge.train.preflight import check_loaded_model, preflight
from flowforge.rollout import Trajectory, decode_needed, rollout_chunked, rollout_grouped, sigmas_for
from flowforge.runtime.lock import RunLock
from flowforge.train.checkpoint.manager import CheckpointManager, TrainerState, training_contract
from flowforge.train.guard import RewardHackingGuard
from flowforge.train.perf import PerfMeter, compute_dtype, set_cpu_threads
from flowforge.train.sidecars import SidecarWriter
from flowforge.train.trackers import TRAIN_LOG, log_progress, run_logging
from flowforge.train.async_rollout import Lookahead
from flowforge.train.rollout_workers import build_rollout_engine, closing_engine, engine_metrics
from flowforge.train.run_lifecycle import RunDirectory
from flowforge.train.scorer_checks import build_reward_processor
from flowforge.rewards.differentiable import DifferentiableReward

log = logging.getLogger("flowforge")


class Trainer(RunDirectory):
    """Builds everything a run needs from a validated config, then runs :meth:`train`.

    Args:
        cfg: the run's config. progress: a progress bar (rank 0). overwrite: move an existing run aside.
        prompts: the prompt source (:class:`~flowforge.train.seams.PromptSource`); default the sampler's prompts.
        hooks: step hooks (:class:`~flowforge.train.seams.StepHook`), called in order at fixed points of each step.
        own_area: the area around the run its owner writes (a pipeline stage: the pipeline directory).
        expected_resume_changes: config keys / sections changed on purpose against the checkpoint the run resumes
            (no warning about them).

    Raises:
        PreflightError: the config is invalid (every violation listed), before any model loads.
    """

    def __init__(self, cfg: Config, *, progress: bool = True, overwrite: bool = False,
                 prompts: PromptSource | None = None, hooks: Sequence[StepHook] = (), own_area: Path | None = None,
                 expected_resume_changes: tuple[str, ...] = ()):
        self.prompts: PromptSource = prompts if prompts is not None else SamplerPrompts()
        self.hooks: tuple[StepHook, ...] = tuple(hooks)
        self.own_area = own_area
        self.expected_resume_changes = tuple(expected_resume_changes)
        self.overwrite = overwrite  # --overwrite: move an existing run in the run directory aside
        self.run_lock: RunLock | None = None
        self._created_run_dir = False
        try:
            self._setup(cfg, progress=progress)
        except BaseException:
            self._fail()  # a refused command leaves the run directory as it found it
            raise

    def _setup(self, cfg: Config, *, progress: bool) -> None:
        """Everything :meth:`__init__` builds, in order; the run directory is written only at the end."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        report = preflight(cfg, world_size=world)
        self._checked_prompts = report.prompts  # the prompt files preflight read: _prepare_run keeps them
        self.dist = dist_lib.init(cfg.run.device)  # the processes; self.data: over which samples are sharded
        self.data, self.context_mesh = cp.training_setup(cfg.distributed.context_parallel, self.dist,
                                                         torch.device(cfg.run.device).type)
        for warning in report.warnings:
            log.warning(warning)
        self.cfg = cfg
        self.progress = progress and self.dist.is_main
        if cfg.run.num_threads != "auto" and cfg.run.num_threads > 0:  # loading and encoding run on them too
            torch.set_num_threads(cfg.run.num_threads)
        torch.manual_seed(cfg.run.seed)
        device = cfg.run.device
        if device == "cuda" and self.dist.enabled:
            device = f"cuda:{self.dist.local_rank}"
        self.device = torch.device(device)
        self._prepare_run()

        m = cfg.model
        log.info("loading model %s (%s) ...", m.path, m.adapter)  # startup stages, timed: minutes on a big model
        started = time.perf_counter()
        self.adapter = build_adapter(m.adapter, resolve_demo_path(m.path), task=m.task,
                                     dtype=resolve_dtype(m.dtype, key="model.dtype"), device=self.device)
        check_loaded_model(cfg, self.adapter, world_size=self.data.world_size,  # what only the model can tell
                           already=report.warnings, prompts={"data.prompts": self.train_prompts,
                                                             "data.eval_prompts": self.eval_prompts})
        configure_sampling(self.adapter, cfg.sampler)  # before encoding and latent_shape
        self.latent_shape = tuple(self.adapter.latent_shape(m.height, m.width, m.frames))
        log.info("model loaded in %.1f s; encoding %d train + %d eval prompts ...", time.perf_counter() - started,
                 len(self.train_prompts), len(self.eval_prompts))
        started = time.perf_counter()
        conds = encode_run_prompts(self.adapter, {"train": self.train_prompts, "eval": self.eval_prompts},
                                   cfg.data.cache_dir, self.device)
        self.train_cond, self.eval_cond = conds["train"], conds["eval"]
        log.info("prompts encoded in %.1f s", time.perf_counter() - started)
        self.sigmas = self._schedule()

        objective_cls = OBJECTIVES[cfg.train.algorithm]
        context = objective_cls.context(cfg)
        total = cfg.train.steps * objective_cls.optimizer_steps_per_batch(context)
        d = cfg.distributed
        wrap = cp.training_wrapper(self.adapter, self.context_mesh, d.context_parallel.attention_backend,
                                   functools.partial(dist_lib.wrap, self.adapter, d.strategy, param_dtype=d.param_dtype,
                                                     reduce_dtype=d.reduce_dtype, offload=d.offload)
                                   if self.dist.enabled else None)
        if d.activation_checkpointing:
            self.adapter.enable_gradient_checkpointing()
        self.policy = Policy(self.adapter, TrainableWeights.from_section(cfg.lora),
                             OptimizerSettings.from_section(cfg.train), total_optimizer_steps=total, wrap=wrap,
                             offload=d.offload, device=self.device,
                             **anchor_policy_bank(cfg.anchor, objective_cls.policy_bank(context)))
        self.objective = objective_cls(context, self.adapter, self.policy)
        self.objective.anchor = build_anchor(cfg.anchor, self.adapter, self.policy, seed=cfg.run.seed,
                                             cache_dir=cfg.data.cache_dir)  # world models: real-clip anchor losses
        self.engine = build_rollout_engine(cfg, self.policy, self.objective.sampling_policy, self.device)  # or None
        # after acceptance (a refused command says nothing of threads), before the MFU's peak: the steps' count
        self.threads = set_cpu_threads(cfg.run.num_threads, self.device)  # for provenance.json
        self.perf = PerfMeter(lambda: self.adapter.transformer, self.device, compute_dtype(self.adapter, d, self.dist),
                              rollout_elsewhere=self.engine is not None)  # perf/mfu; the peak is logged here
        self._stream = None  # reward.overlap: the step's score stream, from sample() to score()
        self.lookahead = Lookahead(self)  # train.max_staleness: the rollouts submitted ahead of their step

        self.sampler = KRepeatSampler(len(self.train_prompts), cfg.data.prompts_per_step, cfg.data.group_size,
                                      cfg.run.seed, num_replicas=self.data.world_size, rank=self.data.rank)
        self._build_outputs()
        base_sha256 = sha256_of_path(self.model_source) if self.model_source is not None else None
        self.state = TrainerState(step=0, contract=training_contract(cfg.lora, self.policy, base_sha256),
                                  config_fingerprint=resume_fingerprint(cfg), config=config_lib.to_dict(cfg),
                                  expected_changes=self.expected_resume_changes)
        self.checkpoints = CheckpointManager(self.run_dir, policy=self.policy, record=self.state, sampler=self.sampler,
                                             keep=cfg.checkpoint.keep, dist=self.dist, objective=self.objective)
        if cfg.train.resume:
            self.checkpoints.restore(cfg.train.resume, max_step=cfg.train.steps)
        self._accept_run()

    @property
    def step(self) -> int:
        """Completed training steps (the trainer record's)."""
        return self.state.step

    def _build_outputs(self) -> None:
        """Reward processor (training components, eval scorers, draft's reward_fn), metrics logger, sidecars."""
        cfg = self.cfg
        self.rewards = build_reward_processor(cfg, self.adapter, self.run_dir)
        if self.objective.needs_reward_fn:
            self.objective.reward_fn = DifferentiableReward(self.rewards.scorers, cfg.reward.weights)
        self.guard = RewardHackingGuard.from_config(cfg, self.run_dir, is_main=self.dist.is_main)  # guard.patience
        self.logger = None  # opened by _accept_run: nothing is written before the command is accepted
        self.sidecars = None
        if cfg.artifacts.root is not None:
            root = Path(cfg.artifacts.root)
            self.sidecars = SidecarWriter(root / f"rank_{self.dist.rank}" if self.dist.enabled else root,
                                          cfg.artifacts.keep)

    def media_needs(self) -> frozenset[str]:
        """What a step's readers read (``RewardProcessor.inputs``, the hooks' ``needs``, pixels for sidecars)."""
        return self.rewards.inputs().union(*(h.needs for h in self.hooks),
                                           {"pixels"} if self.sidecars is not None else ())

    def _schedule(self) -> torch.Tensor:
        """The sampling schedule; a dynamic-shift family's own pipeline schedule when the adapter provides one."""
        s, m = self.cfg.sampler, self.cfg.model
        dynamic = s.schedule == "dynamic" and s.mu is None
        pipeline = self.adapter.pipeline_sigmas(s.num_steps, m.height, m.width) if dynamic else None
        if pipeline is not None:
            return pipeline.float().cpu()
        return sigmas_for(s, self.latent_shape)

    # ------------------------------------------------------------------------------------------------ stages
    def next_prompts(self) -> StepBatch:
        """Stage 1: this rank's M x K candidates, put in a seeded training order; the sampler fixes the layout, the
        prompt source the prompt of each group (:meth:`~flowforge.train.seams.PromptSource.groups`)."""
        kb = self.sampler.next_batch()
        order = torch.randperm(kb.local_group_ids.numel(),
                               generator=torch.Generator().manual_seed(self.cfg.run.seed * 7919 + kb.step))
        prompt_indices = self.prompts.groups(self, self.step, kb.prompt_indices)[kb.local_group_ids][order]
        return StepBatch(prompt_indices=prompt_indices, group_ids=kb.local_group_ids[order],
                         candidate_ids=kb.local_candidate_ids[order], order=order, global_group_ids=kb.group_ids,
                         rank_slice=kb.rank_slice, records=[self.train_prompts[i] for i in prompt_indices.tolist()])

    def sample(self, batch: StepBatch, step: int):
        """Stage 2: roll out the objective's declared trajectories, chunked like the training micro-batches; with
        ``reward.overlap`` group after group, each chunk decoded at once (:meth:`media_needs`) and its completed
        groups sent to the group scorers while the next chunks roll out (:mod:`flowforge.rewards.stream`)."""
        cond, request = self.rollout_request(batch, step)
        if self.engine is not None:  # rollout.engine=workers: the same loop in worker processes, same bits
            return self.engine.sample(cond, **request, step=step), cond
        with self.policy.using(self.objective.sampling_policy):
            if not self.cfg.reward.overlap:
                return rollout_chunked(self.adapter, cond, **request, device=self.device), cond
            self._stream = stream = self.rewards.stream([r.prompt for r in batch.records],
                                                        [r.metadata for r in batch.records], batch.group_ids,
                                                        self.media_needs() | {"latents"})
            on_chunk = lambda rows, part: stream.add(rows, decode_needed(  # noqa: E731 (no audio: refused with overlap)
                self.adapter, part.final, self.cfg.reward.batch_size, self.media_needs())[0], part.final)
            with stream.closed_on_error():
                traj = rollout_grouped(self.adapter, cond, request.pop("candidate_ids"), batch.group_ids,
                                       **request, device=self.device, on_chunk=on_chunk)
        return traj, cond

    def rollout_request(self, batch: StepBatch, step: int) -> tuple[Conditioning, dict]:
        """``batch``'s conditioning rows and the arguments of its rollout as step ``step`` (``candidate_ids``,
        ``sigmas``, ``spec``, ``latent_shape``, ``seed``, ``batch_size``: the chunk), one source for every engine."""
        spec = self.objective.rollout_spec(step)
        cond = self._conditioning(self.train_cond, self.train_prompts, batch.prompt_indices)
        chunk = self.cfg.sampler.batch_size or self.cfg.train.micro_batch_size
        return cond, {"candidate_ids": batch.candidate_ids.tolist(), "sigmas": self.sigmas, "spec": spec,
                      "latent_shape": self.latent_shape, "seed": self.cfg.run.seed, "batch_size": chunk}

    def _conditioning(self, cond: Conditioning | StreamedConditioning, records, prompt_indices: torch.Tensor):
        """The conditioning rows of ``prompt_indices`` (``[B]`` int64 into ``records``, a PromptSet or list; a
        streamed ``cond`` encodes just those); for image tasks conditioned on each prompt's image(s) by the
        adapter (``ImageConditioned.condition_on_images``; each distinct prompt loaded and encoded once)."""
        if self.cfg.model.task not in IMAGE_TASKS:
            return cond.index(prompt_indices)
        m = self.cfg.model
        distinct, inverse = torch.unique(prompt_indices, return_inverse=True)
        chosen = [records[i] for i in distinct.tolist()]
        images = condition_inputs([condition_images(r.metadata) for r in chosen], m.height, m.width,
                                  originals=self.adapter.takes_original_images)
        images = images.to(self.device) if isinstance(images, torch.Tensor) else images  # PIL: the adapter's
        conditioned = self.adapter.condition_on_images(cond.index(distinct), [r.prompt for r in chosen], images,
                                                       self.latent_shape)
        return conditioned.index(inverse)

    def score(self, traj: Trajectory, batch: StepBatch):
        """Stage 3: ``(media, components, metrics)``: the media :meth:`media_needs` names (``[B, 3, H, W]`` or video
        ``[B, 3, F, H, W]`` in [0, 1]; None when nothing reads pixels), every reward component ``[B]`` (latent scorers:
        of ``traj.final``), the reward metrics with ``time/reward_wait`` and ``perf/reward_overlap`` (with
        ``reward.overlap`` :meth:`sample` already sent the groups; this waits for their scores)."""
        stream, self._stream = self._stream, None
        if stream is not None:  # reward.overlap: the groups were sent during the rollout
            return stream.finish()
        media, audio = decode_needed(self.adapter, traj.final, self.cfg.reward.batch_size, self.media_needs())
        components, metrics = self.score_media(media, batch.records, batch.group_ids, self.data, audio=audio,
                                               latents=traj.final)
        metrics.update({"time/reward_wait": metrics["reward/score_time"], "perf/reward_overlap": 0.0})
        return media, components, metrics

    def score_media(self, media: torch.Tensor | None, records: list[PromptRecord], group_ids: torch.Tensor,
                    dist: dist_lib.DistInfo | None = None, audio=None, paid_groups: int | None = None,
                    latents: torch.Tensor | None = None):
        """Every reward component ``[B]`` and the reward metrics (:class:`~flowforge.rewards.processor.RewardProcessor`:
        video whole to ``takes_video`` scorers, else frame by frame; ``audio`` to ``takes_audio`` ones, ``latents``
        ``[B, *latent]`` to ``takes_latents`` ones, ``media`` None when none reads pixels). With ``dist`` (training)
        group scorers see groups that straddle ranks whole; ``paid_groups``: paid scorers on that many groups only."""
        return self.rewards(media, [r.prompt for r in records], [r.metadata for r in records], group_ids, dist=dist,
                            audio=audio, paid_groups=paid_groups, latents=latents)

    def advantages(self, components: dict[str, torch.Tensor], batch: StepBatch):
        """Stage 4: group-relative advantages (combined over components, clipped) and the weighted total reward,
        both ``[B]`` in this rank's training order, plus statistics of the whole step.

        The components of every rank are gathered in the sampler's canonical order, so every group is seen whole
        and every rank computes the same advantages; each keeps its own share. A failed group (a weighted component
        NaN, :func:`~flowforge.train.seams.drop_failed_groups`) gets advantage 0 and total NaN, counted in
        ``reward/judge_failed_groups``; ``reward/total_mean`` is over the other rows."""
        components, drop, failed = drop_failed_groups(components, self.cfg.reward.weights, batch.group_ids)
        adv, total, metrics = self._advantages(components, batch)
        metrics.update(dropped_metrics(total, drop, failed, int(batch.global_group_ids.max()) + 1))
        return adv.masked_fill(drop.to(adv.device), 0.0), total.masked_fill(drop.to(total.device), math.nan), metrics

    def _advantages(self, components: dict[str, torch.Tensor], batch: StepBatch):
        """:meth:`advantages` of finite components."""
        a = self.cfg.advantage
        weights = self.cfg.reward.weights
        canonical = torch.argsort(batch.order)
        every = {k: dist_lib.all_gather_cat(components[k][canonical], self.data) for k in weights}
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
        reward variance and the objective ``uses_advantages`` (one decision for every rank: all train or all skip)."""
        active = torch.tensor([float(bool((batch.advantages != 0).any()))])
        if self.objective.uses_advantages and not bool(dist_lib.all_reduce_processes(active, "max")[0]):
            return {"train/skipped": torch.ones(())}
        metrics = self.objective.optimize(batch)
        out = {f"train/{k}": v for k, v in metrics.items()}
        out["train/skipped"] = torch.zeros(())
        out["train/lr"] = torch.tensor(self.policy.lr)
        return out

    # ------------------------------------------------------------------------------------------------ loop
    def train(self, stop_at: int | None = None, signals: StopSignals | None = None) -> Path:
        """Run to ``train.steps`` steps (evaluating before the first, every ``eval.every`` and after the last);
        writes ``metrics.jsonl``, ``eval.jsonl``, ``samples/``, ``train.log``, ``report.html`` and the
        ``metrics.trackers``. Returns the run directory.

        ``stop_at`` ends the run early after that many steps, as an interruption would (no final eval / report;
        the LR schedule still spans ``train.steps``); a later ``train.resume`` continues it exactly.

        SIGINT / SIGTERM (``signals``, the caller's handlers; else installed for this call,
        :mod:`flowforge.runtime.interrupt`): the current step finishes, its checkpoint is committed and
        :class:`~flowforge.runtime.interrupt.Interrupted` is raised (``graceful``); a second signal, or one before
        the first step, raises it at once.

        A failure before the first step completes leaves the run directory as it was before this command; a later
        one keeps what the completed steps wrote; the lock is released either way
        (:meth:`~flowforge.train.run_lifecycle.RunDirectory._fail`).

        Raises:
            Interrupted: a signal stopped the run (see above).
        """
        signals = signals or StopSignals()
        try:
            with signals, run_logging(self.run_dir / TRAIN_LOG if self.dist.is_main else None), \
                    closing_engine(self.engine), self.perf.counting():
                run_dir, stopped = self._train(stop_at, signals)
        except BaseException:
            self._fail()
            raise
        if stopped is not None:
            raise Interrupted(stopped, graceful=True, step=self.step)
        return run_dir

    def _train(self, stop_at: int | None, signals: StopSignals) -> tuple[Path, int | None]:
        """The loop of :meth:`train`; returns the run directory and the signal that stopped it (None: not one)."""
        cfg = self.cfg
        if self.run_lock is not None:
            self.run_lock.acquire()  # released at the end of an earlier train()
        if self.step == 0:
            self.evaluate(0)
            self.guard.sync(self.policy)  # the base weights are the first rollback target
        end = cfg.train.steps if stop_at is None else min(stop_at, cfg.train.steps)
        bar = tqdm(range(self.step, end), desc=cfg.run.name, disable=not self.progress,
                   initial=self.step, total=cfg.train.steps)
        stopped = None
        signals.armed = True  # from here a first signal lets the step finish and commits it
        for step in bar:
            timer = StageTimer()
            self.perf.begin_step()
            batch, traj, cond = self.lookahead.rollout(step, end, timer)  # stages 1-2 (train.max_staleness)
            with timer("sample"):
                self.prompts.rolled_out(self, step, batch)
                for hook in self.hooks:
                    hook.on_rolled_out(self, step, batch)
            self.perf.end_rollout()
            with timer("reward"):
                media, components, reward_metrics = self.score(traj, batch)
                self.prompts.scored(self, step, batch, components)  # may stop the run before the update
                for hook in self.hooks:
                    hook.on_scored(self, step, batch, media, components, reward_metrics)
            with timer("advantage"):
                adv, total, adv_metrics = self.advantages(components, batch)
            if self.sidecars is not None:  # media_needs asked for pixels
                with timer("sidecars"):
                    self.sidecars.write(step, traj, batch.group_ids, [r.prompt for r in batch.records],
                                        media if media.ndim == 4 else media[:, :, 0],
                                        candidate_ids=batch.candidate_ids, extras={"rewards": total, "advantages": adv})
            kept = torch.isfinite(total.detach().cpu())  # a failed group's rows: total NaN (advantages)
            with timer("optimize"):
                train_metrics = self.optimize(TrainBatch(
                    traj=traj, cond=cond, advantages=adv, group_ids=batch.group_ids, rewards=total,
                    candidate_ids=batch.candidate_ids, step=step, records=tuple(batch.records),
                    keep=None if bool(kept.all()) else torch.nonzero(kept).view(-1)))
            times = timer.scalars()
            local = {**reward_metrics, **to_scalars(train_metrics), **engine_metrics(self.engine),
                     **self.perf.metrics(times)}
            if not local.get("train/skipped", 0.0):
                self.prompts.trained_on(self, step, batch)
                for hook in self.hooks:
                    hook.on_trained(self, step, batch, local)
            scalars = self.finish_step(step, batch, media, local, adv_metrics, times)
            bar.set_postfix(reward=f"{scalars['reward/total_mean']:.3f}")
            if not self.progress and self.dist.is_main:  # --no-progress: a line every metrics.log_every steps
                log_progress(self.step, cfg.train.steps, scalars, cfg.metrics.log_every)
            if self.guard.stopped:
                break  # reward hacking: the guard stopped the run (after a rollback with guard.action=rollback)
            stopped = signals.agreed(self.dist.enabled)  # every rank: one decision at the step boundary
            if stopped is not None:
                break
        self.lookahead.drain()  # a stop before the end: queued rollouts discarded, the sampler rewound
        ended = self.step == cfg.train.steps or self.guard.stopped
        if (ended or stopped is not None) and self.checkpoints.saved_step != self.step:
            self.checkpoints.save()  # the trained model is never lost, also with checkpoint.every=0
        if self.logger is not None:
            self.logger.close()
        self.close()
        if not ended or not self.dist.is_main:
            return self.run_dir, None if ended else stopped
        from flowforge.report.run import write_report

        write_report(self.run_dir)
        return self.run_dir, None

    def finish_step(self, step: int, batch: StepBatch, media: torch.Tensor, local: dict[str, float],
                    adv_metrics: dict[str, torch.Tensor], times: dict[str, float]) -> dict[str, float]:
        """Stage 6: count step ``step`` as done; log its metrics (this rank's ``local`` ones, within-group
        diversity, stage ``times`` and throughput averaged over ranks, plus the step-wide advantage statistics);
        evaluate every ``eval.every`` steps and after the last; checkpoint every ``checkpoint.every`` steps and after
        the last. Returns the logged scalars."""
        self.state.step = step + 1
        if media is not None:  # a step whose scorers read only latents decoded no pixels to compare
            local["train/diversity"] = float(within_group_diversity(media, batch.group_ids))
        local.update(times)
        local["perf/samples_per_s"] = len(batch.records) / max(sum(times.values()), 1e-9)
        scalars = {**dist_lib.mean_across_ranks(local, self.dist), **to_scalars(adv_metrics)}
        scalars["perf/samples_per_s"] = local["perf/samples_per_s"] * self.data.world_size
        if self.logger is not None:
            self.logger.log(self.step, scalars)
        self.guard.observe_step(self.step, scalars)
        every = self.cfg.eval.every
        if (every and self.step % every == 0) or self.step == self.cfg.train.steps:
            self.evaluate(self.step)
        self.guard.sync(self.policy)  # every rank: stop / roll back on rank 0's verdict, before the checkpoint
        c = self.cfg.checkpoint
        if c.every and (self.step % c.every == 0 or self.step == self.cfg.train.steps):
            self.checkpoints.save()
        return scalars

    @functools.cached_property
    def start_samples(self) -> StartSamples:
        """The step-0 eval's samples of this run (:mod:`flowforge.train.sample_change`), for ``eval/sample_change``."""
        return evaluation.start_samples(self)

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out eval (:func:`flowforge.train.evaluation.evaluate`): fixed noise (eval seed, prompt index, sample
        index) and the ODE sampler; the mean of every reward component and eval scorer (paid ones on the first
        ``eval.teacher_groups`` prompts only, their billed requests as ``eval/billed/<name>``), within-prompt
        diversity, ``eval/sample_change`` and a sample grid ``samples/step_N.png``. Every rank generates; rank 0
        scores and logs and returns the scalars (``{}`` elsewhere). The hooks' ``before_eval`` runs first,
        ``on_evaluated`` last."""
        for hook in self.hooks:
            hook.before_eval(self, step)
        scalars = evaluation.evaluate(self, step)
        for hook in self.hooks:
            hook.on_evaluated(self, step, scalars)
        return scalars
