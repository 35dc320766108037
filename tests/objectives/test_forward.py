"""Forward-process machinery: group-shared noise and sigma, visits seeded by the batch's own training step."""

from dataclasses import replace

import torch

from tests.train.test_trainer import one_step, train_batch


def test_group_objectives_share_noise_within_groups(make):
    trainer = make("train.algorithm=dgpo")
    sb, traj, cond, adv, total = one_step(trainer)
    batch = train_batch(sb, traj, cond, adv, total)
    obj = trainer.objective
    keys = obj.noise_keys(batch)
    for g in batch.group_ids.unique():
        assert keys[batch.group_ids == g].unique().numel() == 1
    assert keys.unique().numel() == batch.group_ids.unique().numel()
    visit = obj.make_visit(batch, obj.visits(batch, 0)[0][0], obj.visits(batch, 0)[0][1])
    for g in batch.group_ids.unique():
        rows = batch.group_ids == g
        assert torch.equal(visit.noise[rows][0], visit.noise[rows][-1])
        assert visit.sigma[rows].unique().numel() == 1
    assert obj._micro_size(batch) % 4 == 0  # whole groups of K = 4


def test_visits_follow_the_batch_step_not_the_last_rollout(make):
    """The visit noise slots of a batch are a function of ``batch.step`` (and the inner epoch) only: rolling out
    another step in between changes nothing (no state kept between the sample and optimize stages)."""
    trainer = make("train.algorithm=nft", "forward.inner_epochs=2", "forward.sigma_mode=full_schedule")
    obj = trainer.objective
    batch = train_batch(*one_step(trainer, step=3))
    batch = replace(batch, step=3)
    num_steps, inner = trainer.cfg.sampler.num_steps, trainer.cfg.forward.inner_epochs
    first = obj.visits(batch, 1)
    obj.rollout_spec(7)
    again = obj.visits(batch, 1)
    assert [slot for _, slot in first] == [slot for _, slot in again]
    base = -2 - (3 * inner + 1) * num_steps
    assert [slot for _, slot in first] == [base - j for j in range(num_steps)]
    assert [slot for _, slot in obj.visits(replace(batch, step=4), 1)] != [slot for _, slot in first]
    assert batch.select(torch.arange(2)).step == 3  # a micro-batch keeps its step


def test_the_trainer_hands_each_batch_its_step(make, monkeypatch):
    trainer = make("train.algorithm=nft")
    seen = []
    optimize = trainer.objective.optimize
    monkeypatch.setattr(trainer.objective, "optimize", lambda batch: seen.append(batch.step) or optimize(batch))
    trainer.train()
    assert seen == [0, 1]
