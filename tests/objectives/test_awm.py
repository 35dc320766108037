"""AWM on the real loop: the first update's ratio is exactly 1 and the old policy resyncs to live."""

import torch

from tests.train.test_trainer import one_step, train_batch


def test_awm_first_update_ratio_is_one_and_old_resyncs(make):
    trainer = make("train.algorithm=awm", "train.num_updates_per_batch=1", "train.allow_unit_ratio=true")
    sb, traj, cond, adv, total = one_step(trainer)
    batch = train_batch(sb, traj, cond, adv, total)
    obj = trainer.objective
    (sigma_index, slot), = obj.visits(batch, 0)
    rows = torch.arange(2)
    sub = batch.select(rows)
    loss, m = obj.micro_loss(sub, {}, obj.make_visit(sub, sigma_index[rows], slot))
    assert float(m["ratio_min"]) == 1.0 and float(m["ratio_max"]) == 1.0
    obj.policy.backward(loss)
    obj.policy.optimizer.zero_grad(set_to_none=True)
    obj.optimize(batch)
    live, old = obj.policy.named_weights("live"), obj.policy.named_weights("old")
    assert all(torch.equal(live[k], old[k]) for k in live)  # AWM: old = the next batch's sampling policy
