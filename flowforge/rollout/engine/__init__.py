"""Decoupled rollout: worker processes that hold a copy of the policy, receive its weights by verified sync and run
the one rollout loop (:mod:`flowforge.rollout.loop`) bit-identically to the trainer's own rollout.

* :mod:`~flowforge.rollout.engine.weight_sync`: manifest, buckets, verification, commit; the engine's errors.
* :mod:`~flowforge.rollout.engine.worker`: what a worker builds and runs; how a rollout is split between workers.
* :mod:`~flowforge.rollout.engine.backends`: a worker as a ``torch.multiprocessing`` process or a Ray actor.
* :mod:`~flowforge.rollout.engine.engine`: :class:`WorkerEngine`, the trainer's handle on its workers.
"""

from flowforge.rollout.engine.backends import BACKENDS, start_worker
from flowforge.rollout.engine.engine import WorkerEngine
from flowforge.rollout.engine.weight_sync import (SYNC_MODES, EngineError, SyncManifest, SyncReceiver, TensorEntry,
                                                  WeightSyncError, WorkerLostError, iter_buckets, make_manifest)
from flowforge.rollout.engine.worker import (RolloutTask, RolloutWorker, WorkerRecipe, split_rows, trajectory_to,
                                             worker_tasks)

__all__ = ["BACKENDS", "SYNC_MODES", "EngineError", "RolloutTask", "RolloutWorker", "SyncManifest", "SyncReceiver",
           "TensorEntry", "WeightSyncError", "WorkerEngine", "WorkerLostError", "WorkerRecipe", "iter_buckets",
           "make_manifest", "split_rows", "start_worker", "trajectory_to", "worker_tasks"]
