"""Online Diffusion-DPO on the real loop: each group's best and worst candidates form the pair."""

from tests.train.test_trainer import one_step, train_batch


def test_dpo_pairs_best_and_worst_of_each_group(make):
    trainer = make("train.algorithm=dpo")
    sb, traj, cond, adv, total = one_step(trainer)
    batch = train_batch(sb, traj, cond, adv, total)
    sub, extras, m = trainer.objective.prepare(batch)
    assert float(m["pairs"]) == 2.0
    for g in batch.group_ids.unique():
        in_group = total[batch.group_ids == g]
        chosen = sub.rewards[(sub.group_ids == g) & extras["chosen"].bool()]
        rejected = sub.rewards[(sub.group_ids == g) & ~extras["chosen"].bool()]
        assert float(chosen) == float(in_group.max()) and float(rejected) == float(in_group.min())
