"""CRD (Centered Reward Distillation): values against a per-group loop, first-update gradient by hand and
direction, batch-wide centring, the reward-adaptive KL to a CFG teacher, input errors.
"""
import math

import pytest
import torch

from flowforge.algorithms.losses import cfg_velocity, crd_loss
from tests.algorithms.losses.helpers import F64, fm_err, randn, sgd

torch.set_num_threads(1)


def _crd_inputs(seed=0, b=6):
    x0, noise = randn(seed, b, 2, 3), randn(seed + 1, b, 2, 3)
    target = noise - x0
    v_old = target + 0.4 * randn(seed + 2, b, 2, 3)
    v_live = v_old + 0.1 * randn(seed + 3, b, 2, 3)
    groups = [0, 0, 0, 1, 1, 1][:b]
    adv = torch.tensor([2.0, -1.0, -1.0, 7.0, 0.0, -7.0], dtype=F64)[:b]
    return v_live, v_old, target, groups, adv


def _crd_loop(v_live, v_old, target, groups, adv, beta, c, loss_type, tau=None, adaptive=True):
    b = len(groups)
    r, a = [], []
    for i in range(b):
        e = float(((v_live[i] - target[i]) ** 2).mean())
        eo = float(((v_old[i] - target[i]) ** 2).mean())
        if adaptive:
            e /= max(float((v_live[i] - target[i]).abs().mean()), 1e-5)
            eo /= max(float((v_old[i] - target[i]).abs().mean()), 1e-5)
        r.append(-(e - eo))
        a.append(min(max(max(min(float(adv[i]), c), -c) / c / 2 + 0.5, 0.0), 1.0))

    def one_direction(sign):
        total = 0.0
        for i in range(b):
            members = [j for j in range(b) if groups[j] == groups[i]]
            if tau is None:
                p = {j: 1 / len(members) for j in members}
            else:
                z = sum(math.exp(sign * a[j] / tau) for j in members)
                p = {j: math.exp(sign * a[j] / tau) / z for j in members}
            rc = a[i] - sum(p[j] * a[j] for j in members)
            rtc = r[i] - sum(p[j] * r[j] for j in members)
            if loss_type == "mse":
                total += (beta * rtc - rc) ** 2
            else:
                x, y = beta * rtc, 1 / (1 + math.exp(-rc))
                total += max(x, 0) - x * y + math.log1p(math.exp(-abs(x)))
        return total / b

    raw = one_direction(1) if tau is None else 0.5 * one_direction(1) + 0.5 * one_direction(-1)
    return raw * c / beta, a


@pytest.mark.parametrize("loss_type,tau,adaptive", [("mse", None, True), ("bce", None, True), ("mse", 0.3, True),
                                                    ("bce", 0.5, False)])
def test_crd_value_matches_a_per_group_loop(loss_type, tau, adaptive):
    v_live, v_old, target, groups, adv = _crd_inputs()
    beta, c = 2.0, 5.0
    loss, m = crd_loss(v_live, v_old, target, groups, adv, beta=beta, adv_clip=c, loss_type=loss_type,
                       weight_temp=tau, adaptive=adaptive)
    expected, _ = _crd_loop(v_live, v_old, target, groups, adv, beta, c, loss_type, tau, adaptive)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert m["kl_loss"].item() == 0.0 and m["policy_loss"].item() == pytest.approx(expected, rel=1e-12)


def _group_centre(a, weights):
    out = a.clone()
    for lo in (0, 3):
        w = weights[lo:lo + 3] / weights[lo:lo + 3].sum()
        out[lo:lo + 3] = a[lo:lo + 3] - (w * a[lo:lo + 3]).sum()
    return out


@pytest.mark.parametrize("tau", [None, 0.3])
def test_crd_first_update_gradient_by_hand(tau):
    _, v_old, target, groups, adv = _crd_inputs(seed=3)
    beta, c = 2.0, 5.0
    v = v_old.clone().requires_grad_(True)
    loss, m = crd_loss(v, v_old, target, groups, adv, beta=beta, adv_clip=c, weight_temp=tau)
    loss.backward()
    a = (adv.clamp(-c, c) / c / 2 + 0.5).clamp(0, 1)
    if tau is None:
        rcs = [_group_centre(a, torch.ones(6, dtype=F64))]
    else:
        rcs = [_group_centre(a, torch.exp(a / tau)), _group_centre(a, torch.exp(-a / tau))]
    assert loss.item() == pytest.approx(sum(c / beta * (rc**2).mean().item() for rc in rcs) / len(rcs), rel=1e-12)
    assert m["implicit_reward_mean"].item() == 0.0
    # d/dv_i of c/beta * mean_j (beta r_j - Rc_j)^2 at r = 0, with the centring and the scales held constant:
    # 4 c Rc_i (v_i - target_i) / (B D mae_i), averaged over the centring directions
    rc = sum(rcs) / len(rcs)
    d = v_old[0].numel()
    mae = (v_old - target).abs().mean(dim=(1, 2))
    expected = 4 * c * rc.view(-1, 1, 1) * (v_old - target) / (6 * d * mae.view(-1, 1, 1))
    torch.testing.assert_close(v.grad, expected, rtol=1e-10, atol=1e-15)


def test_crd_first_update_direction():
    _, v_old, target, groups, adv = _crd_inputs(seed=3)
    beta, c = 1.0, 5.0
    v = v_old.clone().requires_grad_(True)
    loss, m = crd_loss(v, v_old, target, groups, adv, beta=beta, adv_clip=c)
    loss.backward()
    a = (adv.clamp(-c, c) / c / 2 + 0.5).clamp(0, 1)
    above = _group_centre(a, torch.ones(6, dtype=F64))
    change = fm_err(sgd(v_old, v.grad, 1e-3), target) - fm_err(v_old, target)
    assert int((above != 0).sum()) == 5
    assert (torch.sign(change[above != 0]) == -torch.sign(above[above != 0])).all()
    assert v.grad[4].abs().max().item() == 0.0  # sample 4 (A = 0 in a group [7, 0, -7]) sits at its group mean


def test_crd_single_group_is_batch_wide_centring():
    v_live, v_old, target, _, adv = _crd_inputs(seed=5)
    one, _ = crd_loss(v_live, v_old, target, [7] * 6, adv)
    expected, _ = _crd_loop(v_live, v_old, target, [0] * 6, adv, 1.0, 5.0, "mse")
    split, _ = crd_loss(v_live, v_old, target, [0, 0, 0, 1, 1, 1], adv)
    assert one.item() == pytest.approx(expected, rel=1e-12) and abs(one.item() - split.item()) > 1e-6


def test_crd_reward_adaptive_kl_to_cfg_teacher():
    v_live, v_old, target, groups, adv = _crd_inputs(seed=6)
    v_u, v_c = randn(30, 6, 2, 3), randn(31, 6, 2, 3)
    teacher = cfg_velocity(v_u, v_c, 4.5)
    torch.testing.assert_close(teacher, v_u + 4.5 * (v_c - v_u))
    torch.testing.assert_close(cfg_velocity(v_u, v_c, 1.0), v_c)
    kl_beta = 0.1
    loss, m = crd_loss(v_live, v_old, target, groups, adv, v_teacher=teacher, kl_beta=kl_beta)
    base, _ = crd_loss(v_live, v_old, target, groups, adv)
    kl = ((v_live - teacher) ** 2).mean(dim=(1, 2))
    a = (adv.clamp(-5, 5) / 10 + 0.5).clamp(0, 1)
    mcoef = 1e-4 / kl_beta
    expected_kl = kl_beta * ((mcoef + a * (1 - mcoef)) * kl).mean()
    assert m["kl_loss"].item() == pytest.approx(expected_kl.item(), rel=1e-12)
    assert loss.item() == pytest.approx(base.item() + expected_kl.item(), rel=1e-12)
    plain, m2 = crd_loss(v_live, v_old, target, groups, adv, v_teacher=teacher, kl_beta=kl_beta,
                         reward_adaptive_kl=False)
    assert m2["kl_loss"].item() == pytest.approx(kl_beta * kl.mean().item(), rel=1e-12)


def test_crd_errors():
    v_live, v_old, target, groups, adv = _crd_inputs()
    with pytest.raises(ValueError, match="mse"):
        crd_loss(v_live, v_old, target, groups, adv, loss_type="l1")
    with pytest.raises(ValueError, match="v_teacher"):
        crd_loss(v_live, v_old, target, groups, adv, kl_beta=0.1)
    with pytest.raises(ValueError, match="weight_temp"):
        crd_loss(v_live, v_old, target, groups, adv, weight_temp=0.0)
    with pytest.raises(ValueError, match="beta"):
        crd_loss(v_live, v_old, target, groups, adv, beta=-1.0)
    with pytest.raises(ValueError, match="group_ids"):
        crd_loss(v_live, v_old, target, groups[:4], adv)
    with pytest.raises(ValueError, match="v_uncond"):
        cfg_velocity(v_live[:, :1], v_live, 2.0)
