"""The trainer's side of ``rollout.engine: workers``: build the workers' recipe from the config, sync the sampling
policy before each rollout, check the version, retry after a failure, report the engine's metrics.

Policy versions count optimizer rounds: version ``v`` is the sampling policy's weights after ``v`` training steps
(the resumed step after a resume), so the rollout of step ``s`` needs version ``s``. Before it, the sampling policy's
weights (:meth:`flowforge.policy.Policy.named_weights`: LoRA tensors, or the full state dict) are synced to every
worker as version ``s`` (:meth:`~flowforge.rollout.engine.WorkerEngine.sync`) — after each optimizer round, and
once at the start of a run or a resume (workers always start from the trainer's committed weights). The returned
trajectory must carry version ``s`` when the objective samples with the live policy (on-policy); a failed sync or a
lost worker is retried ``rollout.max_retries`` times, rebuilding lost workers from the committed weights.

Metrics (logged every step): ``train/policy_version``, ``train/weight_sync_tensors``, ``train/weight_sync_mb``
(per worker), ``time/weight_sync`` (seconds), ``train/weight_sync_failures`` and ``train/worker_restarts``
(counts since the engine was built).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Sequence

import torch

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
        self.device = device
        self._metrics: dict[str, float] = {}

    def sample(self, cond: Conditioning, candidate_ids: Sequence[int], sigmas: torch.Tensor, spec: RolloutSpec, *,
               latent_shape: Sequence[int], seed: int, batch_size: int, step: int) -> Trajectory:
        """The rollout of training step ``step`` (as :func:`~flowforge.rollout.loop.rollout_chunked`) by the
        workers, after syncing version ``step`` when they hold another.

        Raises:
            WeightSyncError: the sync still fails after ``rollout.max_retries`` retries, or (on-policy) the
                trajectory's version is not ``step``.
            WorkerLostError: a worker is still lost after the retries.
        """
        weights = self.policy.named_weights(self.sampling_policy)  # every rank gathers (a collective under FSDP)
        sync = None
        for attempt in range(self.max_retries + 1):
            try:
                if attempt:  # inside the try: a rebuild that fails (a fresh worker dies) uses up a retry too
                    self.engine.rebuild()
                self.engine.start()  # first use: build the workers (not counted as sync time)
                if self.engine.version != step:
                    sync = self.engine.sync(weights, step, self.mode)
                traj, version = self.engine.rollout(cond, candidate_ids, sigmas, spec, latent_shape=latent_shape,
                                                    seed=seed, batch_size=batch_size)
                break
            except EngineError as exc:
                if attempt == self.max_retries:
                    raise
                log.warning("rollout engine: %s; rebuilding lost workers and retrying (%d of %d)", exc, attempt + 1,
                            self.max_retries)
        check_version(version, step, on_policy=self.on_policy)
        self._metrics = {"train/policy_version": float(version),
                         "train/weight_sync_tensors": float(sync["tensors"] if sync else 0),
                         "train/weight_sync_mb": float(sync["mb"] if sync else 0.0),
                         "time/weight_sync": float(sync["seconds"] if sync else 0.0),
                         "train/weight_sync_failures": float(self.engine.failures),
                         "train/worker_restarts": float(self.engine.restarts)}
        return trajectory_to(traj, self.device)

    def metrics(self) -> dict[str, float]:
        """The engine metrics of the last :meth:`sample`."""
        return dict(self._metrics)

    def close(self) -> None:
        """Stop the workers (a later :meth:`sample` starts them again from the trainer's weights)."""
        self.engine.close()


def check_version(version: int, expected: int, *, on_policy: bool) -> None:
    """A trajectory rolled out with policy ``version`` where the trainer expects ``expected``: an error on-policy
    (the importance ratio and the policy gradient would be off), and also off-policy when the version is newer
    than the trainer's (it cannot have come from this run's weights).

    Raises:
        WeightSyncError: as above.
    """
    if version > expected or (on_policy and version != expected):
        raise WeightSyncError(f"trajectory rolled out with policy version {version}, the trainer expects {expected} "
                              f"({'on' if on_policy else 'off'}-policy)")


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
