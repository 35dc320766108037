"""The Ray backend: the same worker as a Ray actor (runs only where Ray is installed: pip install 'flowforge[ray]')."""

import pytest
import torch

from flowforge.rollout.engine import WeightSyncError, WorkerEngine, WorkerLostError
from flowforge.train.rollout_workers import worker_recipe
from tests.rollout.test_engine import (_batch, _engine_rollout, _local_rollout, _moved_weights,
                                       assert_same_trajectory, make_trainer)

ray = pytest.importorskip("ray")


@pytest.mark.slow
def test_ray_worker_matches_local_and_is_rebuilt_after_it_is_killed(tiny_model_dir, tmp_path, encode_cache_dir):
    trainer = make_trainer(tiny_model_dir, tmp_path, encode_cache_dir, "ray-ref")
    cond, ids, spec = _batch(trainer)
    weights = _moved_weights(trainer, 0.1)
    with WorkerEngine(worker_recipe(trainer.cfg, trainer.policy, "cpu"), num_workers=2, backend="ray") as engine:
        engine.sync(weights, 3)
        traj, version = _engine_rollout(trainer, engine, cond, ids, spec)
        assert version == 3
        assert_same_trajectory(traj, _local_rollout(trainer, weights, cond, ids, spec))
        with pytest.raises(WeightSyncError, match="full weight sync of version 4 refused"):  # raised in the actor
            engine.sync(dict(trainer.adapter.transformer.state_dict()), 4, mode="full")
        assert engine.version == 3 and engine.failures == 1
        ray.kill(engine.workers[0].actor)
        with pytest.raises(WorkerLostError, match="rollout worker 0"):
            _engine_rollout(trainer, engine, cond, ids, spec)
        assert engine.rebuild() == 1
        traj, _ = _engine_rollout(trainer, engine, cond, ids, spec)
        assert torch.equal(traj.log_probs, _local_rollout(trainer, weights, cond, ids, spec).log_probs)
