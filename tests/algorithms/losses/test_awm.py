"""AWM (Advantage Weighted Matching): values against a per-sample loop, first-update consistency with
``grpo_clip_loss``, gradient directions after a small step, advantage clipping, input errors.
"""
import math

import pytest
import torch

from flowforge.algorithms.losses import (
    AWM_WEIGHTINGS,
    awm_loss,
    grpo_clip_loss,
)
from tests.algorithms.losses.helpers import F64, fm_err, randn, sgd

torch.set_num_threads(1)


def _awm_logp_loop(v, x0, noise, sigma, weighting, p=0.25):
    out = []
    for i in range(v.shape[0]):
        e = float(((v[i] - (noise[i] - x0[i])) ** 2).mean())
        s = float(sigma[i])
        if weighting == "uniform":
            out.append(-e)
        elif weighting == "t":
            out.append(-e * s)
        elif weighting == "t**2":
            out.append(-e * s * s)
        elif weighting == "huber":
            out.append(-(math.sqrt(e + 1e-10) - 1e-5) * s)
        else:
            out.append(-((e + 1e-10) ** p - (1e-10) ** p) * s / p)
    return out


def _awm_inputs(seed=0):
    x0, noise, v_old = randn(seed, 4, 2, 3, 3), randn(seed + 1, 4, 2, 3, 3), randn(seed + 2, 4, 2, 3, 3)
    v_live = v_old + 0.05 * randn(seed + 3, 4, 2, 3, 3)
    sigma = torch.tensor([0.9, 0.6, 0.3, 0.75], dtype=F64)
    adv = torch.tensor([1.5, -0.5, -2.0, 0.7], dtype=F64)
    return v_live, v_old, x0, noise, sigma, adv


@pytest.mark.parametrize("weighting", AWM_WEIGHTINGS)
def test_awm_value_matches_a_per_sample_loop(weighting):
    v_live, v_old, x0, noise, sigma, adv = _awm_inputs()
    eps_lo, eps_hi = 0.002, 0.004
    loss, m = awm_loss(v_live, v_old, x0, noise, sigma, adv, clip_low=eps_lo, clip_high=eps_hi, weighting=weighting)
    lp = _awm_logp_loop(v_live, x0, noise, sigma, weighting)
    lp_old = _awm_logp_loop(v_old, x0, noise, sigma, weighting)
    terms, clipped = [], 0
    for i in range(4):
        ratio = math.exp(lp[i] - lp_old[i])
        a = float(adv[i])
        terms.append(max(-a * ratio, -a * min(max(ratio, 1 - eps_lo), 1 + eps_hi)))
        clipped += ratio > 1 + eps_hi or ratio < 1 - eps_lo
    assert loss.item() == pytest.approx(sum(terms) / 4, rel=1e-12, abs=1e-15)
    assert m["clip_fraction"].item() == pytest.approx(clipped / 4)
    assert m["ratio_min"].item() < 1 < m["ratio_max"].item()  # the perturbation moves ratios both ways
    assert all(not t.requires_grad and t.ndim == 0 for t in m.values())


def test_awm_first_update_equals_grpo_clip_on_the_same_log_probs():
    _, v_old, x0, noise, sigma, adv = _awm_inputs(seed=5)
    target = noise - x0

    def logp(v):  # the "t" weighting written out: -sigma * err
        return -sigma * fm_err(v, target)

    v1 = v_old.clone().requires_grad_(True)
    loss, m = awm_loss(v1, v_old, x0, noise, sigma, adv, clip_low=1e-4, weighting="t")
    loss.backward()
    v2 = v_old.clone().requires_grad_(True)
    ref_loss, _ = grpo_clip_loss(logp(v2), logp(v_old), adv, 1e-4)
    ref_loss.backward()
    assert loss.item() == pytest.approx(-adv.mean().item(), abs=1e-15)
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-15)
    torch.testing.assert_close(v1.grad, v2.grad, rtol=1e-12, atol=1e-15)
    assert v1.grad.abs().sum() > 0
    assert m["ratio_mean"].item() == 1.0 and m["clip_fraction"].item() == 0.0 and m["approx_kl"].item() == 0.0


@pytest.mark.parametrize("weighting", ["uniform", "ghuber"])
def test_awm_step_lowers_error_of_positive_and_raises_negative(weighting):
    _, v_old, x0, noise, sigma, _ = _awm_inputs(seed=9)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=F64)
    v = v_old.clone().requires_grad_(True)
    loss, _ = awm_loss(v, v_old, x0, noise, sigma, adv, clip_low=1.0, weighting=weighting)
    loss.backward()
    before = fm_err(v_old, noise - x0)
    after = fm_err(sgd(v_old, v.grad, 1e-2), noise - x0)
    assert (torch.sign(after - before) == -torch.sign(adv)).all()


def test_awm_adv_clip_and_rescale():
    _, v_old, x0, noise, sigma, _ = _awm_inputs()
    adv = torch.tensor([10.0, -0.5, 2.5, -7.0], dtype=F64)
    loss, _ = awm_loss(v_old, v_old, x0, noise, sigma, adv, clip_low=0.1, adv_clip=5.0, adv_max=1.0)
    effective = torch.tensor([1.0, -0.1, 0.5, -1.0], dtype=F64)
    assert loss.item() == pytest.approx(-effective.mean().item(), abs=1e-15)
    loss, _ = awm_loss(v_old, v_old, x0, noise, sigma, adv, clip_low=0.1, adv_clip=5.0)
    assert loss.item() == pytest.approx(-torch.tensor([5.0, -0.5, 2.5, -5.0]).mean().item(), abs=1e-12)


def test_awm_errors_and_dtype():
    v_live, v_old, x0, noise, sigma, adv = _awm_inputs()
    with pytest.raises(ValueError, match="ghuber"):
        awm_loss(v_live, v_old, x0, noise, sigma, adv, clip_low=0.1, weighting="Uniform")
    with pytest.raises(ValueError, match="clip"):
        awm_loss(v_live, v_old, x0, noise, sigma, adv, clip_low=0.0)
    with pytest.raises(ValueError, match="adv_max"):
        awm_loss(v_live, v_old, x0, noise, sigma, adv, clip_low=0.1, adv_max=1.0)
    with pytest.raises(ValueError, match=r"sigma must lie in \[0, 1\]"):
        awm_loss(v_live, v_old, x0, noise, sigma * 1000, adv, clip_low=0.1)
    with pytest.raises(ValueError, match="advantages"):
        awm_loss(v_live, v_old, x0, noise, sigma, adv[:3], clip_low=0.1)
    with pytest.raises(ValueError, match="noise"):
        awm_loss(v_live, v_old, x0, noise[:, :1], sigma, adv, clip_low=0.1)
    loss, m = awm_loss(v_live.to(torch.bfloat16), v_old.float(), x0.float(), noise.float(), 0.5, adv.float(),
                       clip_low=0.1)
    assert loss.dtype == torch.float32 and m["fm_error"].dtype == torch.float32
