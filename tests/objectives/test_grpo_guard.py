"""GRPO-Guard on the real loop: the rollout stores transition means and the first update's ratio is exactly 1."""

from tests.train.test_trainer import one_step, train_batch


def test_grpo_guard_first_update_ratio_is_one(make):
    trainer = make("train.algorithm=grpo_guard")
    sb, traj, cond, adv, total = one_step(trainer)
    assert traj.means is not None and traj.means.shape == traj.latents.shape
    m = trainer.objective.optimize(train_batch(sb, traj, cond, adv, total))
    assert float(m["first_update_ratio_dev"]) == 0.0
