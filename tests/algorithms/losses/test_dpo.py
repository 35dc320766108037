"""Online Diffusion-DPO: values by hand, behaviour at the reference, an end-to-end step, pair formation, errors.
"""
import math

import pytest
import torch

from flowforge.algorithms.losses import best_worst_pairs, diffusion_dpo_loss
from tests.algorithms.losses.helpers import F64, fm_err, randn, sgd

torch.set_num_threads(1)


def test_diffusion_dpo_by_hand():
    beta = 2.0
    lw = torch.tensor([0.30, 0.50], dtype=F64)
    ll = torch.tensor([0.40, 0.45], dtype=F64)
    rw = torch.tensor([0.35, 0.50], dtype=F64)
    rl = torch.tensor([0.35, 0.50], dtype=F64)
    loss, m = diffusion_dpo_loss(lw, ll, rw, rl, beta=beta)
    # pair 0: z = -1 * ((0.30 - 0.35) - (0.40 - 0.35)) = 0.1 ; pair 1: z = -1 * (0 - (-0.05)) = -0.05
    z = [0.1, -0.05]
    expected = sum(math.log1p(math.exp(-zi)) for zi in z) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert m["implicit_accuracy"].item() == 0.5
    assert m["reward_margin"].item() == pytest.approx(0.025, rel=1e-12)
    assert m["reward_chosen"].item() == pytest.approx((0.05 + 0.0) / 2, rel=1e-12)
    assert m["reward_rejected"].item() == pytest.approx((-0.05 + 0.05) / 2, abs=1e-15)


def test_diffusion_dpo_at_reference_is_log2_and_pushes_errors_apart():
    g = torch.Generator().manual_seed(0)
    lw = torch.rand(5, generator=g, dtype=F64).requires_grad_(True)
    ll = torch.rand(5, generator=g, dtype=F64).requires_grad_(True)
    loss, m = diffusion_dpo_loss(lw, ll, lw.detach(), ll.detach(), beta=1000.0)
    loss.backward()
    assert loss.item() == pytest.approx(math.log(2), rel=1e-12) and m["implicit_accuracy"].item() == 0.0
    # d loss / d err_w = beta / 4 / P > 0 (descent lowers the chosen error), the opposite for the rejected one
    torch.testing.assert_close(lw.grad, torch.full((5,), 1000.0 / 4 / 5, dtype=F64))
    torch.testing.assert_close(ll.grad, -lw.grad)


def test_diffusion_dpo_end_to_end_step_on_velocities():
    x0, noise = randn(1, 4, 3, 2), randn(2, 2, 3, 2).repeat_interleave(2, 0)  # pairs share noise
    target = noise - x0
    v_ref = target + 0.3 * randn(3, 4, 3, 2)
    v = v_ref.clone().requires_grad_(True)
    err = fm_err(v, target)
    err_ref = fm_err(v_ref, target)
    loss, _ = diffusion_dpo_loss(err[0::2], err[1::2], err_ref[0::2], err_ref[1::2], beta=50.0)
    loss.backward()
    change = fm_err(sgd(v_ref, v.grad, 1e-3), target) - err_ref
    assert (change[0::2] < 0).all() and (change[1::2] > 0).all()


def test_diffusion_dpo_errors():
    t = torch.zeros(3)
    with pytest.raises(ValueError, match="beta"):
        diffusion_dpo_loss(t, t, t, t, beta=0.0)
    with pytest.raises(ValueError, match="err_ref_l"):
        diffusion_dpo_loss(t, t, t, torch.zeros(2), beta=1.0)
    loss, m = diffusion_dpo_loss(t.half(), t, t, t, beta=1.0)
    assert loss.dtype == torch.float32


def test_best_worst_pairs_per_group():
    rewards = torch.tensor([0.2, 0.9, 0.5, 0.9, 0.3, 0.3, 0.7, 0.1, 0.4, 0.1])
    ids = ["a", "a", "b", "a", "c", "c", "b", "d", "b", "e"]
    chosen, rejected = best_worst_pairs(rewards, ids)
    # a: best 0.9 first at index 1, worst index 0; b: best 6, worst 8... (0.5 at 2, 0.7 at 6, 0.4 at 8)
    # c: tie -> no pair; d, e: singletons -> no pair
    assert chosen.tolist() == [1, 6] and rejected.tolist() == [0, 8]
    assert chosen.dtype == torch.int64
    # slow loop reference on random data with integer ids
    g = torch.Generator().manual_seed(4)
    r = torch.randint(0, 3, (40,), generator=g).to(F64)
    gid = torch.randint(0, 7, (40,), generator=g)
    ch, rj = best_worst_pairs(r, gid)
    exp_c, exp_r = [], []
    for k in sorted(set(gid.tolist())):
        members = [i for i in range(40) if gid[i] == k]
        vals = [float(r[i]) for i in members]
        if max(vals) > min(vals):
            exp_c.append(min(i for i in members if float(r[i]) == max(vals)))
            exp_r.append(min(i for i in members if float(r[i]) == min(vals)))
    assert ch.tolist() == exp_c and rj.tolist() == exp_r and len(exp_c) > 0
    with pytest.raises(ValueError, match="finite"):
        best_worst_pairs(torch.tensor([0.1, float("nan")]), [0, 0])
    with pytest.raises(ValueError, match="float"):
        best_worst_pairs(torch.tensor([1, 2]), [0, 0])
