"""Objectives on the real loop (tiny random SD3): NFT smoke, first-update consistency, guard, sampling policy."""

import json

import pytest
import torch

from flowforge.algorithms.advantages import nft_optimality
from tests.test_trainer import one_step, tiny_cfg, train_batch
from flowforge.train.trainer import Trainer


@pytest.fixture
def make(tiny_model_dir, tmp_path, encode_cache_dir):
    def build(*extra, name="o"):
        return Trainer(tiny_cfg(tiny_model_dir, tmp_path, encode_cache_dir, f"run.name={name}", *extra),
                       progress=False)
    return build


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


@pytest.mark.parametrize("algorithm", ["grpo_guard", "awm", "dgpo", "dpo", "crd"])
def test_every_objective_two_step_smoke(make, algorithm):
    extra = ["crd.kl_beta=0.1"] if algorithm == "crd" else []
    run_dir = make(f"train.algorithm={algorithm}", *extra, name=algorithm).train()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/skipped"] == 0.0 for r in rows)
    assert all(r["train/loss"] == r["train/loss"] for r in rows)  # finite, not NaN


def test_grpo_guard_first_update_ratio_is_one(make):
    trainer = make("train.algorithm=grpo_guard")
    sb, traj, cond, adv, total = one_step(trainer)
    assert traj.means is not None and traj.means.shape == traj.latents.shape
    m = trainer.objective.optimize(train_batch(sb, traj, cond, adv, total))
    assert float(m["first_update_ratio_dev"]) == 0.0


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
