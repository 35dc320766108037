"""DGPO: values against a per-group loop, reference vs paper gradients, gradient directions, the old-policy
clip, input errors.
"""
import math

import pytest
import torch

from flowforge.algorithms.losses import dgpo_loss
from tests.algorithms.losses.helpers import F64, fm_err, randn, sgd

torch.set_num_threads(1)


def _dgpo_inputs(seed=0):
    b = 6
    x0 = randn(seed, b, 2, 4)
    group_noise = randn(seed + 1, 2, 2, 4)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    target = group_noise[groups] - x0  # noise shared within a group
    v_ref = target + 0.5 * randn(seed + 2, b, 2, 4)
    v_live = v_ref + 0.1 * randn(seed + 3, b, 2, 4)
    adv = torch.tensor([1.2, -0.2, -1.0, 0.5, 0.5, -1.0], dtype=F64)
    return v_live, v_ref, target, groups, adv


def _dgpo_group_terms(v_live, v_ref, target, groups, adv, beta):
    s = {}
    for g in groups.unique().tolist():
        members = [i for i in range(len(groups)) if groups[i] == g]
        tot = 0.0
        for i in members:
            d = float(((v_live[i] - target[i]) ** 2).mean())
            d_ref = float(((v_ref[i] - target[i]) ** 2).mean())
            tot += float(adv[i]) * (d - d_ref)
        s[g] = beta * tot / len(members)
    return s


@pytest.mark.parametrize("mode", ["reference", "paper"])
def test_dgpo_value_matches_a_per_group_loop(mode):
    v_live, v_ref, target, groups, adv = _dgpo_inputs()
    beta = 40.0
    loss, m = dgpo_loss(v_live, v_ref, target, groups, adv, beta=beta, mode=mode)
    s = _dgpo_group_terms(v_live, v_ref, target, groups, adv, beta)
    softplus = {g: math.log1p(math.exp(x)) for g, x in s.items()}
    if mode == "paper":
        expected = sum(softplus.values()) / 2
    else:
        expected = sum(
            1 / (1 + math.exp(-s[int(groups[i])])) * float(adv[i]) * float(((v_live[i] - target[i]) ** 2).mean())
            for i in range(6)
        ) / 6
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert m["dpo_loss"].item() == pytest.approx(sum(softplus.values()) / 2, rel=1e-12)
    assert m["preference_margin"].item() == pytest.approx(-(s[0] + s[1]) / 2, rel=1e-12)
    assert m["preference_accuracy"].item() == pytest.approx(sum(x < 0 for x in s.values()) / 2)


def test_dgpo_reference_gradient_is_paper_gradient_over_beta():
    v_live, v_ref, target, groups, adv = _dgpo_inputs(seed=3)
    beta = 25.0
    grads = {}
    for mode in ("reference", "paper"):
        v = v_live.clone().requires_grad_(True)
        loss, _ = dgpo_loss(v, v_ref, target, groups, adv, beta=beta, mode=mode)
        loss.backward()
        grads[mode] = v.grad
    torch.testing.assert_close(grads["paper"], beta * grads["reference"], rtol=1e-10, atol=1e-14)
    assert grads["reference"].abs().sum() > 0


def test_dgpo_step_lowers_error_of_positive_advantage_samples():
    v_live, v_ref, target, groups, adv = _dgpo_inputs(seed=4)
    v = v_live.clone().requires_grad_(True)
    loss, _ = dgpo_loss(v, v_ref, target, groups, adv, beta=10.0)
    loss.backward()
    change = fm_err(sgd(v_live, v.grad, 1e-2), target) - fm_err(v_live, target)
    assert (torch.sign(change) == -torch.sign(adv)).all()


def test_dgpo_group_with_zero_advantages_gets_no_gradient():
    v_live, v_ref, target, groups, adv = _dgpo_inputs(seed=6)
    adv = adv.clone()
    adv[3:] = 0.0
    v = v_live.clone().requires_grad_(True)
    loss, _ = dgpo_loss(v, v_ref, target, groups, adv, beta=10.0, mode="paper")
    loss.backward()
    assert v.grad[3:].abs().max().item() == 0.0 and v.grad[:3].abs().sum() > 0


def test_dgpo_clip_freezes_samples_that_left_the_band():
    v_live, v_ref, target, groups, adv = _dgpo_inputs(seed=8)
    eps = 1e-3
    v_old = v_live.clone()
    # sample 0 (A > 0) already improved beyond the band: its error is far below the old one -> clipped
    v_old[0] = v_live[0] + 0.5
    # sample 2 (A < 0) got worse beyond the band -> clipped; the others sit at ratio 1 -> kept
    v_old[2] = target[2]
    v = v_live.clone().requires_grad_(True)
    loss, m = dgpo_loss(v, v_ref, target, groups, adv, beta=10.0, v_old=v_old, clip_range=eps)
    loss.backward()
    expected_mask = torch.tensor([1, 0, 1, 0, 0, 0], dtype=F64)
    torch.testing.assert_close(m["clip_mask"], expected_mask)
    assert m["clip_fraction"].item() == pytest.approx(2 / 6)
    assert v.grad[0].abs().max().item() == 0.0 and v.grad[2].abs().max().item() == 0.0
    assert all(v.grad[i].abs().sum() > 0 for i in (1, 3, 4, 5))
    unclipped, _ = dgpo_loss(v_live, v_ref, target, groups, adv, beta=10.0)
    assert loss.item() == pytest.approx(unclipped.item(), rel=1e-12)  # clipping removes gradient, not value


def test_dgpo_errors():
    v_live, v_ref, target, groups, adv = _dgpo_inputs()
    with pytest.raises(ValueError, match="reference"):
        dgpo_loss(v_live, v_ref, target, groups, adv, beta=1.0, mode="ema")
    with pytest.raises(ValueError, match="beta"):
        dgpo_loss(v_live, v_ref, target, groups, adv, beta=0.0)
    with pytest.raises(ValueError, match="together"):
        dgpo_loss(v_live, v_ref, target, groups, adv, beta=1.0, clip_range=0.1)
    with pytest.raises(ValueError, match="group_ids"):
        dgpo_loss(v_live, v_ref, target, groups[:5], adv, beta=1.0)
    with pytest.raises(ValueError, match="v_ref"):
        dgpo_loss(v_live, v_ref[:, :1], target, groups, adv, beta=1.0)
