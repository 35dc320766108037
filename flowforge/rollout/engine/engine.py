"""The worker rollout engine: N workers, verified two-phase weight sync, rollouts split on chunk boundaries.

* **Sync** (:meth:`WorkerEngine.sync`): the manifest goes to every worker, then the buckets are streamed to all of
  them, then every worker verifies (phase 1); only when all verified does each commit (phase 2). A refusal or a
  failed verification on any worker aborts the sync on all of them: every worker keeps the previous version, the
  engine's :attr:`~WorkerEngine.version` does not move, ``failures`` counts it, and :class:`WeightSyncError` is
  raised, so a retry of the same weights rebuilds the same version.
* **Rollout** (:meth:`WorkerEngine.rollout`): the rows are cut on multiples of the chunk size and handed out as
  consecutive shares (:func:`~flowforge.rollout.engine.worker.split_rows`); each worker runs
  :func:`~flowforge.rollout.loop.rollout_chunked` on its share, so every chunk is the chunk the trainer's own
  rollout would run, and the concatenation is bit-identical to it. Every worker must report the engine's version.
* **Recovery** (:meth:`WorkerEngine.rebuild`): workers that ended are started again and given the last committed
  weights at the committed version (kept by the engine, CPU copies), also after a resume.

Workers start on first use (:meth:`WorkerEngine.start`); :meth:`WorkerEngine.close` stops them (also when the
engine is garbage collected), and a later use starts them again.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Mapping, Sequence

import torch

from flowforge.models.base import Conditioning
from flowforge.rollout.engine.backends import start_worker
from flowforge.rollout.engine.weight_sync import (EngineError, WeightSyncError, WorkerLostError, iter_buckets,
                                                  make_manifest)
from flowforge.rollout.engine.worker import WorkerRecipe, worker_tasks
from flowforge.rollout.loop import RolloutSpec, Trajectory

log = logging.getLogger("flowforge")

MIB = 2**20


def _close_all(workers: list) -> None:
    for w in workers:
        try:
            w.close()
        except Exception as exc:  # shutting down: one worker that fails to stop must not keep the others running
            log.warning("rollout worker %s did not close cleanly: %s", getattr(w, "index", "?"), exc)
    workers.clear()


class WorkerEngine:
    """Rollout workers of one trainer rank.

    Args:
        recipe: how each worker builds its model (:class:`~flowforge.rollout.engine.worker.WorkerRecipe`).
        num_workers: worker count (>= 1).
        backend: ``"process"`` | ``"ray"`` (:func:`~flowforge.rollout.engine.backends.start_worker`).
        bucket_mb: weight-sync bucket size in MiB.

    Attributes:
        version: the committed policy version (``-1``: none yet).
        failures: weight syncs that failed so far.
        last_sync: ``{"tensors", "mb", "seconds"}`` of the last committed sync.
    """

    def __init__(self, recipe: WorkerRecipe, *, num_workers: int, backend: str = "process", bucket_mb: float = 64.0):
        if num_workers < 1:
            raise ValueError(f"rollout.num_workers={num_workers} must be >= 1")
        self.recipe, self.num_workers, self.backend = recipe, num_workers, backend
        self.bucket_bytes = max(1, int(bucket_mb * MIB))
        self.workers: list = []
        self.version = -1
        self.failures = 0
        self.restarts = 0
        self.last_sync = {"tensors": 0, "mb": 0.0, "seconds": 0.0}
        self._committed: Mapping[str, torch.Tensor] | None = None  # the last committed weights (for rebuilds)
        self._committed_version = -1
        self._finalizer = weakref.finalize(self, _close_all, self.workers)

    # ------------------------------------------------------------------------------------------------ life cycle
    @property
    def started(self) -> bool:
        return bool(self.workers)

    def start(self) -> None:
        """Start every worker (in parallel) and wait until each has built its model."""
        if self.started:
            return
        self.workers.extend(start_worker(self.backend, i, self.recipe) for i in range(self.num_workers))
        try:
            for w in self.workers:
                w.wait_ready()
        except BaseException:
            _close_all(self.workers)
            raise
        self.version = -1

    def pids(self) -> list[int | None]:
        """The workers' process ids."""
        return [w.pid for w in self.workers]

    def rebuild(self) -> int:
        """Start again every worker that ended and give it the committed weights at the committed version (the
        others keep theirs). Returns the number of workers rebuilt."""
        if not self.started:
            self.start()
            fresh = list(self.workers)
        else:
            dead = [i for i, w in enumerate(self.workers) if not w.alive()]
            for i in dead:
                try:
                    self.workers[i].close(timeout=1.0)
                except Exception:  # it is gone already; nothing to stop
                    pass
                self.workers[i] = start_worker(self.backend, i, self.recipe)
            for i in dead:
                self.workers[i].wait_ready()
            fresh = [self.workers[i] for i in dead]
        if fresh and self._committed is not None:
            self._sync(self._committed, self._committed_version, self.recipe.sync_mode, fresh)
        self.restarts += len(fresh)
        return len(fresh)

    def close(self) -> None:
        """Stop every worker (idempotent); a later :meth:`start` builds them again."""
        _close_all(self.workers)
        self.version = -1

    def __enter__(self) -> "WorkerEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ sync
    def sync(self, weights: Mapping[str, torch.Tensor], version: int, mode: str | None = None) -> dict[str, float]:
        """Send ``weights`` (the sampling policy's, by name) to every worker as policy ``version``, verified and
        committed on all or none (see the module docstring). Starts the workers if needed.

        Args:
            mode: ``"adapter"`` | ``"full"`` (default: the one the workers take, ``recipe.sync_mode``); a worker
                refuses any other.

        Returns:
            ``{"tensors", "mb", "seconds"}`` of this sync.
        Raises:
            WeightSyncError: a worker refused or failed verification (all kept the previous version).
            WorkerLostError: a worker ended during the sync.
        """
        self.start()
        return self._sync(weights, version, mode or self.recipe.sync_mode, self.workers)

    def _sync(self, weights, version: int, mode: str, workers: Sequence) -> dict[str, float]:
        t0 = time.perf_counter()
        manifest = make_manifest(weights, version=version, mode=mode, bucket_bytes=self.bucket_bytes)
        try:
            self._send(workers, manifest, weights)
            for pending in [w.submit("sync_verify") for w in workers]:
                pending.result()
        except EngineError:
            self.failures += 1
            self._abort(workers)
            raise
        for pending in [w.submit("sync_commit") for w in workers]:
            pending.result()
        if len(workers) == len(self.workers):  # every worker holds it now
            self.version = version
        self._committed, self._committed_version = weights, version
        self.last_sync = {"tensors": manifest.count, "mb": manifest.total_bytes / MIB,
                          "seconds": time.perf_counter() - t0}
        return dict(self.last_sync)

    def _send(self, workers: Sequence, manifest, weights) -> None:
        """Phase 0: manifest to all (each may refuse it), then every bucket to all, streamed without replies."""
        first_error = None
        for pending in [w.submit("sync_begin", manifest) for w in workers]:
            try:
                pending.result()
            except WeightSyncError as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        for index, data in enumerate(iter_buckets(weights, manifest)):
            for w in workers:
                w.cast("sync_bucket", index, data)

    def _abort(self, workers: Sequence) -> None:
        for w in workers:
            try:
                w.submit("sync_abort").result()
            except WorkerLostError:  # rebuilt on the next use
                pass

    # ------------------------------------------------------------------------------------------------ rollout
    def rollout(self, cond: Conditioning, candidate_ids: Sequence[int], sigmas: torch.Tensor, spec: RolloutSpec, *,
                latent_shape: Sequence[int], seed: int, batch_size: int) -> tuple[Trajectory, int]:
        """Roll out ``B = len(candidate_ids)`` candidates across the workers, chunked by ``batch_size`` exactly as
        :func:`~flowforge.rollout.loop.rollout_chunked` would; returns the trajectory (rows in order, CPU) and the
        policy version every worker rolled out with.

        Raises:
            WeightSyncError: no version committed yet, or a worker reported another version.
            WorkerLostError: a worker ended (the others' results are drained first; :meth:`rebuild` recovers).
        """
        if self.version < 0 or not self.started:
            raise WeightSyncError("rollout before any weight sync: the workers hold no committed policy version")
        tasks = worker_tasks(cond.to("cpu"), candidate_ids, sigmas, spec, latent_shape=latent_shape, seed=seed,
                             batch_size=batch_size, num_workers=self.num_workers)
        pending = [self.workers[i].submit("rollout", task) for i, task in enumerate(tasks)]
        parts, error = [], None
        for p in pending:
            try:
                parts.append(p.result())
            except EngineError as exc:
                error = error or exc
        if error is not None:
            raise error
        versions = sorted({v for _, v in parts})
        if versions != [self.version]:
            raise WeightSyncError(f"workers rolled out with policy versions {versions}, expected {self.version}")
        return Trajectory.cat([t for t, _ in parts]), self.version
