"""DiffusionNFT on the real loop: smoke, first-update consistency with the reference gradient, guard, old policy."""

import json

import pytest
import torch

from flowforge.algorithms.advantages import nft_optimality
from tests.train.test_trainer import one_step, train_batch


def test_nft_two_step_smoke(make):
    run_dir = make("train.algorithm=nft", "forward.inner_epochs=2").train()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("train/loss", "train/positive_loss", "train/negative_loss", "train/old_deviation",
                "train/old_decay", "train/r_mean", "train/grad_norm"):
        assert key in rows[0], key
    # 2 updates x 2 inner epochs per step; the old policy's decay follows min(0.001 n, 0.5)
    assert rows[0]["train/old_decay"] == pytest.approx(0.004)
    assert rows[1]["train/old_decay"] == pytest.approx(0.008)


def test_nft_first_update_live_equals_old_and_gradient_is_reference(make):
    trainer = make("train.algorithm=nft")
    sb, traj, cond, adv, total = one_step(trainer)
    batch = train_batch(sb, traj, cond, adv, total)
    obj = trainer.objective
    r, keep = obj.optimality(batch)
    assert keep.all()
    torch.testing.assert_close(r, nft_optimality(adv, trainer.cfg.nft.adv_clip))
    rows = torch.arange(2)
    sub = batch.select(rows)
    (sigma_index, slot), = obj.visits(batch, 0)
    loss, m = obj.micro_loss(sub, {"r": r[rows]}, obj.make_visit(sub, sigma_index[rows], slot))
    # live == old before any update: both implicit branches coincide
    assert float(m["old_deviation"]) == 0.0
    assert float(m["positive_loss"]) == float(m["negative_loss"])
    obj.policy.backward(loss)
    grads = {id(p): p.grad.clone() for p in obj.policy.params if p.grad is not None}
    obj.policy.optimizer.zero_grad(set_to_none=True)
    visit = obj.make_visit(sub, sigma_index[rows], slot)
    # reference gradient at live == old (DiffusionNFT): d/dv [c (2r - 1) L(v)] with
    # L = mean((x0_hat - x0)^2) / sg(mean|x0_hat - x0|), x0_hat = x_sigma - sigma v   (beta = 1)
    x0, sigma, noise = sub.traj.final, sub.traj.sigmas[sigma_index[rows]], visit.noise
    s = sigma.reshape(-1, 1, 1, 1)
    torch.testing.assert_close(visit.x_sigma, (1 - s) * x0 + s * noise, rtol=0, atol=0)
    v = trainer.adapter.velocity(visit.x_sigma, sigma, sub.cond, 1.0)
    err = visit.x_sigma - s * v - x0
    per_sample = (err ** 2).mean((1, 2, 3)) / err.abs().mean((1, 2, 3)).detach().clamp_min(1e-5)
    c = trainer.cfg.nft.adv_clip
    (c * (2 * r[rows] - 1) * per_sample).mean().backward()
    ref = {id(p): p.grad for p in obj.policy.params if p.grad is not None}
    assert ref.keys() == grads.keys() and ref
    for k in ref:
        torch.testing.assert_close(grads[k], ref[k], rtol=1e-4, atol=1e-7)


def test_nft_guard_skips_tied_groups_and_counts_them(make):
    trainer = make("train.algorithm=nft", "nft.guard=true", "nft.guard_min_best=2.0")
    sb, traj, cond, adv, total = one_step(trainer)
    before = trainer.policy.named_weights("live")
    m = trainer.objective.optimize(train_batch(sb, traj, cond, adv, total))
    assert float(m["guard_skipped_groups"]) == 2.0  # every group's best digit probability is < 2
    after = trainer.policy.named_weights("live")
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow  # 15-30 s of training on 2 cores: CI runs it in the slow set (the default run stays near 10 min)
def test_nft_samples_with_old_policy(make):
    trainer = make("train.algorithm=nft", "forward.decay_rate=0.0")
    trainer.train()  # decay 0: old tracks live exactly after every batch
    live, old = trainer.policy.named_weights("live"), trainer.policy.named_weights("old")
    assert all(torch.equal(live[k], old[k]) for k in live)
    assert trainer.objective.sampling_policy == "old"
    stale = make("train.algorithm=nft", "forward.decay_rate=1.0", "forward.decay_max=0.99", name="stale")
    stale.train()  # decay 0.99 after the first steps: old lags behind live
    live, old = stale.policy.named_weights("live"), stale.policy.named_weights("old")
    assert any(not torch.equal(live[k], old[k]) for k in live)
