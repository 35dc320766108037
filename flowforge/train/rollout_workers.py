"""The trainer's side of ``rollout.engine: workers``: build the workers' recipe from the config, sync the sampling
policy before each rollout, check the version, retry after a failure, report the engine's metrics.

Policy versions count optimizer rounds: version ``v`` is the sampling policy's weights after ``v`` training steps
(the resumed step after a resume), so the rollout of step ``s`` needs version ``s``. Before it, the sampling policy's
weights (:meth:`flowforge.policy.Policy.named_weights`: LoRA tensors, or the full state dict) are synced to every
worker as version ``s`` (:meth:`~flowforge.rollout.engine.WorkerEngine.sync`) — after each optimizer round, and
once at the start of a run or a resume (workers always start from the trainer's committed weights). The returned
trajectory must carry version ``s`` when the objective samples with the live policy (on-policy); a failed sync or a
lost worker is retried ``rollout.max_retries`` times, rebuilding lost workers from the committed weights.

With ``train.max_staleness: s > 0`` (:mod:`flowforge.train.async_rollout`) the rollout of a later step is submitted
(:meth:`WorkerRollout.submit`) with the weights of the version the trainer holds then, and runs in a thread while the
trainer updates; the trajectory may then lag its step by up to ``s`` versions. Every trajectory carries the version
that sampled it (``Trajectory.policy_version``).

Metrics (logged every step): ``train/policy_version`` (of the step's rollout), ``train/staleness`` (the step minus
that version), ``time/rollout`` (the rollout's own seconds, sync included), ``train/weight_sync_tensors``,
``train/weight_sync_mb`` (per worker), ``time/weight_sync`` (seconds), ``train/weight_sync_failures`` and
``train/worker_restarts`` (counts since the engine was built).
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Iterator, Sequence

import torch

from flowforge.algorithms.staleness import policy_staleness
from flowforge.demo.paths import resolve_demo_path
from flowforge.models.base import Conditioning
from flowforge.rollout import RolloutSpec, Trajectory
from flowforge.rollout.engine import EngineError, WeightSyncError, WorkerEngine, WorkerRecipe, trajectory_to

log = logging.getLogger("flowforge")


def worker_recipe(cfg, policy, device: torch.device | str) -> WorkerRecipe:
    """The :class:`WorkerRecipe` that rebuilds the trainer's model from a root ``Config`` (the policy bank gives the
    resolved LoRA targets)."""
    m, lora = cfg.model, cfg.lora
    return WorkerRecipe(adapter=m.adapter, path=resolve_demo_path(m.path), task=m.task, dtype=m.dtype,
                        device=str(device), trainable=lora.trainable, lora_rank=lora.resolved_rank,
                        lora_alpha=lora.resolved_alpha, lora_targets=tuple(policy.targets) if policy.lora else (),
                        modules=tuple(policy.modules), threads=cfg.rollout.threads,
                        sampler_options=tuple(cfg.sampler.model_options.items()))


class WorkerRollout:
    """Stage 2 through rollout workers (see the module docstring).

    Args:
        cfg: the root config (``rollout``, ``model``, ``lora`` are read).
        policy: the policy bank; ``sampling_policy`` (``live`` | ``old``) is the one shipped to the workers.
        device: the trainer's device (trajectories are returned there).
    """

    def __init__(self, cfg, policy, sampling_policy: str, device: torch.device | str):
        r = cfg.rollout
        self.engine = WorkerEngine(worker_recipe(cfg, policy, device), num_workers=r.num_workers, backend=r.backend,
                                   bucket_mb=r.sync_bucket_mb)
        self.mode = r.sync_mode(cfg.lora.trainable)
        self.policy, self.sampling_policy = policy, sampling_policy
        self.on_policy = sampling_policy == "live"
        self.max_retries = r.max_retries
        self.max_staleness = cfg.train.max_staleness
        self.device = device
        self._metrics: dict[str, float] = {}
        self._pool: ThreadPoolExecutor | None = None  # train.max_staleness > 0: the submitted rollouts' thread

    def sample(self, cond: Conditioning, candidate_ids: Sequence[int], sigmas: torch.Tensor, spec: RolloutSpec, *,
               latent_shape: Sequence[int], seed: int, batch_size: int, step: int) -> Trajectory:
        """The rollout of training step ``step`` (as :func:`~flowforge.rollout.loop.rollout_chunked`) by the
        workers with policy version ``step``, synced first when they hold another; the trajectory is tagged with it
        (``policy_version``).

        Raises:
            WeightSyncError: the sync still fails after ``rollout.max_retries`` retries, or (on-policy) the
                trajectory's version is not ``step``.
            WorkerLostError: a worker is still lost after the retries.
        """
        weights = self.policy.named_weights(self.sampling_policy)  # every rank gathers (a collective under FSDP)
        return self._accept(self._rollout(weights, cond, candidate_ids, sigmas, spec, latent_shape=latent_shape,
                                          seed=seed, batch_size=batch_size, step=step, version=step))

    def submit(self, cond: Conditioning, candidate_ids: Sequence[int], sigmas: torch.Tensor, spec: RolloutSpec, *,
               latent_shape: Sequence[int], seed: int, batch_size: int, step: int, version: int) -> Future:
        """Start the rollout of training step ``step`` with the sampling policy's current weights as policy
        ``version`` (``train.max_staleness``: ``step - version`` steps behind) and return at once; :meth:`take`
        waits for it. The weights are copied here, in the caller's thread, so the update that runs meanwhile cannot
        change what the workers receive. One rollout runs at a time; later submissions queue behind it."""
        weights = self.policy.named_weights(self.sampling_policy)  # a copy; a collective under FSDP (every rank)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowforge-rollout")
        return self._pool.submit(self._rollout, weights, cond, candidate_ids, sigmas, spec, latent_shape=latent_shape,
                                 seed=seed, batch_size=batch_size, step=step, version=version)

    def take(self, pending: Future) -> Trajectory:
        """The trajectory of a :meth:`submit`, once it is done (its errors are raised here); its engine metrics
        become :meth:`metrics`."""
        return self._accept(pending.result())

    def _accept(self, result: tuple[Trajectory, dict[str, float]]) -> Trajectory:
        traj, self._metrics = result
        return trajectory_to(traj, self.device)

    def _rollout(self, weights, cond, candidate_ids, sigmas, spec, *, latent_shape, seed, batch_size, step,
                 version) -> tuple[Trajectory, dict[str, float]]:
        """Sync ``weights`` as ``version`` (when the workers hold another), roll out, retry after engine failures;
        the trajectory tagged with its version, and the engine metrics. Touches nothing of the trainer but the
        engine, so it may run in :meth:`submit`'s thread."""
        sync = None
        started = time.perf_counter()
        for attempt in range(self.max_retries + 1):
            try:
                if attempt:  # inside the try: a rebuild that fails (a fresh worker dies) uses up a retry too
                    self.engine.rebuild()
                self.engine.start()  # first use: build the workers (not counted as sync time)
                if self.engine.version != version:
                    sync = self.engine.sync(weights, version, self.mode)
                traj, got = self.engine.rollout(cond, candidate_ids, sigmas, spec, latent_shape=latent_shape,
                                                seed=seed, batch_size=batch_size)
                break
            except EngineError as exc:
                if attempt == self.max_retries:
                    raise
                log.warning("rollout engine: %s; rebuilding lost workers and retrying (%d of %d)", exc, attempt + 1,
                            self.max_retries)
        if got != version:
            raise WeightSyncError(f"trajectory rolled out with policy version {got}, requested {version}")
        check_version(got, step, on_policy=self.on_policy, max_staleness=self.max_staleness)
        metrics = {"train/policy_version": float(got), "train/staleness": float(step - got),
                   "train/weight_sync_tensors": float(sync["tensors"] if sync else 0),
                   "train/weight_sync_mb": float(sync["mb"] if sync else 0.0),
                   "time/weight_sync": float(sync["seconds"] if sync else 0.0),
                   "time/rollout": time.perf_counter() - started,
                   "train/weight_sync_failures": float(self.engine.failures),
                   "train/worker_restarts": float(self.engine.restarts)}
        return replace(traj, policy_version=got), metrics

    def metrics(self) -> dict[str, float]:
        """The engine metrics of the last :meth:`sample`."""
        return dict(self._metrics)

    def close(self) -> None:
        """Wait for a submitted rollout, then stop the workers (a later :meth:`sample` starts them again from the
        trainer's weights)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self.engine.close()


def check_version(version: int, expected: int, *, on_policy: bool, max_staleness: int = 0) -> None:
    """A trajectory rolled out with policy ``version`` where the trainer is at ``expected``: an error on-policy
    when it lags by more than ``max_staleness`` versions (:func:`~flowforge.algorithms.staleness.policy_staleness`;
    0: it must be ``expected``, else the importance ratio and the policy gradient would be off), and also off-policy
    when the version is newer than the trainer's (it cannot have come from this run's weights).

    Raises:
        WeightSyncError: as above.
    """
    try:
        policy_staleness(expected, version, max_staleness if on_policy else max(expected - version, 0))
    except ValueError as exc:
        raise WeightSyncError(f"trajectory rolled out with policy version {version}, the trainer expects {expected} "
                              f"({'on' if on_policy else 'off'}-policy): {exc}") from None


def build_rollout_engine(cfg, policy, sampling_policy: str, device) -> WorkerRollout | None:
    """A :class:`WorkerRollout` under ``rollout.engine: workers``; ``None`` under ``local`` (the trainer rolls out
    itself). No worker starts before the first rollout."""
    if cfg.rollout.engine == "local":
        return None
    return WorkerRollout(cfg, policy, sampling_policy, device)


@contextlib.contextmanager
def closing_engine(engine: WorkerRollout | None) -> Iterator[None]:
    """Stops ``engine``'s workers when the block ends, normally or by an error (nothing for the local engine)."""
    try:
        yield
    finally:
        if engine is not None:
            engine.close()


def engine_metrics(engine: WorkerRollout | None) -> dict[str, float]:
    """The worker engine's metrics of the last rollout (none for the local engine)."""
    return {} if engine is None else engine.metrics()
