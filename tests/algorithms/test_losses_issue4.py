"""Losses for AWM, DGPO, GRPO-Guard, Diffusion-DPO (+ pair formation) and CRD.

Values against slow per-sample loops written here, first-update consistency with ``grpo_clip_loss``, gradient
directions after a small step, and input errors.
"""
import math

import pytest
import torch

from flowforge.algorithms.losses import (
    AWM_WEIGHTINGS,
    awm_loss,
    best_worst_pairs,
    cfg_velocity,
    crd_loss,
    dgpo_loss,
    diffusion_dpo_loss,
    grpo_clip_loss,
    grpo_guard_loss,
)
from flowforge.algorithms.sde import transition

torch.set_num_threads(1)
F64 = torch.float64


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _sgd(v, grad, lr):
    return (v - lr * grad).detach()


def _err(v, target):
    return ((v - target) ** 2).mean(dim=tuple(range(1, v.ndim)))


# --------------------------------------------------------------------------------------------------------- AWM


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
    x0, noise, v_old = _randn(seed, 4, 2, 3, 3), _randn(seed + 1, 4, 2, 3, 3), _randn(seed + 2, 4, 2, 3, 3)
    v_live = v_old + 0.05 * _randn(seed + 3, 4, 2, 3, 3)
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
        return -sigma * _err(v, target)

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
    before = _err(v_old, noise - x0)
    after = _err(_sgd(v_old, v.grad, 1e-2), noise - x0)
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


# -------------------------------------------------------------------------------------------------------- DGPO


def _dgpo_inputs(seed=0):
    b = 6
    x0 = _randn(seed, b, 2, 4)
    group_noise = _randn(seed + 1, 2, 2, 4)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    target = group_noise[groups] - x0  # noise shared within a group
    v_ref = target + 0.5 * _randn(seed + 2, b, 2, 4)
    v_live = v_ref + 0.1 * _randn(seed + 3, b, 2, 4)
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
    change = _err(_sgd(v_live, v.grad, 1e-2), target) - _err(v_live, target)
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


# -------------------------------------------------------------------------------------------------- GRPO-Guard


def _guard_step(seed=0, b=4, sigma=0.7, sigma_next=0.55, eta=0.8, perturb=0.05, zero_noise=False):
    x = _randn(seed, b, 2, 3, 3)
    v_old = _randn(seed + 1, b, 2, 3, 3)
    v_live = v_old + perturb * _randn(seed + 2, b, 2, 3, 3)
    eps = torch.zeros_like(x) if zero_noise else _randn(seed + 3, b, 2, 3, 3)
    old = transition("sde", x, v_old, sigma, sigma_next, eta, noise=eps)
    return x, v_old, v_live, eps, old


def test_guard_ratio_is_the_centred_ratio_of_the_sampling_noise():
    sigma, sigma_next = 0.7, 0.55
    x, v_old, v_live, eps, old = _guard_step(sigma=sigma, sigma_next=sigma_next)
    v1 = v_live.clone().requires_grad_(True)
    live = transition("sde", x, v1, sigma, sigma_next, 0.8, x_next=old.x_next)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=F64)
    loss, m = grpo_guard_loss(live.log_prob, old.log_prob, adv, 10.0, mean=live.mean, old_mean=old.mean,
                              std=old.std, step_weight="none")
    loss.backward()
    # RatioNorm: (logp - logp_old + b) * s == mean_el((mu - mu_old) * eps), zero-mean in eps; same gradient too
    v2 = v_live.clone().requires_grad_(True)
    mu = transition("sde", x, v2, sigma, sigma_next, 0.8, x_next=old.x_next).mean
    closed = (-adv * torch.exp(((mu - old.mean) * eps).mean(dim=(1, 2, 3)))).mean()
    closed.backward()
    assert loss.item() == pytest.approx(closed.item(), rel=1e-10)
    torch.testing.assert_close(v1.grad, v2.grad, rtol=1e-8, atol=1e-14)
    raw = torch.exp(live.log_prob.detach() - old.log_prob)
    assert m["raw_ratio_mean"].item() == pytest.approx(raw.mean().item(), rel=1e-12)
    # the normalized spread is |mu - mu_old|, the raw one |mu - mu_old| / s: far wider at this std
    assert m["ratio_max"].item() - m["ratio_min"].item() < (raw.max() - raw.min()).item()


def test_guard_removes_the_left_shift_at_zero_noise():
    x, v_old, v_live, eps, old = _guard_step(seed=2, zero_noise=True)
    live = transition("sde", x, v_live, 0.7, 0.55, 0.8, x_next=old.x_next)
    loss, m = grpo_guard_loss(live.log_prob, old.log_prob, torch.ones(4, dtype=F64), 0.2, mean=live.mean,
                              old_mean=old.mean, std=old.std, step_weight="none")
    shift = ((live.mean - old.mean) ** 2).mean(dim=(1, 2, 3)) / (2 * old.std**2)
    assert m["raw_ratio_mean"].item() == pytest.approx(torch.exp(-shift).mean().item(), rel=1e-12)
    assert m["raw_ratio_mean"].item() < 1.0
    assert m["ratio_mean"].item() == pytest.approx(1.0, abs=1e-12)
    assert loss.item() == pytest.approx(-1.0, abs=1e-12)


@pytest.mark.parametrize("step_weight", ["none", "inv_dt"])
def test_guard_first_update_value_and_gradient_relative_to_grpo_clip(step_weight):
    sigma, sigma_next = torch.tensor([0.9, 0.8, 0.6, 0.4], dtype=F64), torch.tensor([0.8, 0.6, 0.4, 0.3], dtype=F64)
    x = _randn(11, 4, 2, 3, 3)
    v_old = _randn(12, 4, 2, 3, 3)
    old = transition("sde", x, v_old, sigma, sigma_next, 0.7, noise=_randn(13, 4, 2, 3, 3), sigma_max=0.95)
    adv = torch.tensor([1.0, -2.0, 0.5, 0.25], dtype=F64)
    dt = sigma_next - sigma

    def live_step():
        v = v_old.clone().requires_grad_(True)
        return v, transition("sde", x, v, sigma, sigma_next, 0.7, x_next=old.x_next, sigma_max=0.95)

    v1, live = live_step()
    loss, m = grpo_guard_loss(live.log_prob, old.log_prob, adv, 1e-3, mean=live.mean, old_mean=old.mean,
                              std=old.std, dt=dt, step_weight=step_weight)
    loss.backward()
    v2, live2 = live_step()
    ref, _ = grpo_clip_loss(live2.log_prob, old.log_prob, adv, 1e-3)
    ref.backward()
    w = torch.ones(4, dtype=F64) if step_weight == "none" else 1 / (-dt)
    assert m["ratio_mean"].item() == 1.0 and m["clip_fraction"].item() == 0.0
    assert loss.item() == pytest.approx((-adv * w).mean().item(), abs=1e-14)
    if step_weight == "none":
        assert loss.item() == pytest.approx(ref.item(), abs=1e-15)
    # per sample: guard gradient = s * w * FlowGRPO gradient (the bias term is flat at mu == mu_old)
    scale = (old.std * w).view(-1, 1, 1, 1)
    torch.testing.assert_close(v1.grad, scale * v2.grad, rtol=1e-10, atol=1e-15)
    assert not torch.allclose(v1.grad, v2.grad)


def test_guard_two_dimensional_steps_and_clipping_by_loop():
    b, s_steps = 3, 2
    lp_old = _randn(20, b, s_steps) * 0.01
    lp = (lp_old + 0.002 * _randn(21, b, s_steps)).requires_grad_(True)
    mean_old = _randn(22, b, s_steps, 4)
    mean = mean_old + 0.01 * _randn(23, b, s_steps, 4)
    std = torch.tensor([[0.3, 0.2], [0.25, 0.15], [0.4, 0.1]], dtype=F64)
    dt = torch.tensor([[-0.1, -0.05], [-0.1, -0.05], [-0.1, -0.05]], dtype=F64)
    adv = torch.tensor([1.0, -1.0, 0.5], dtype=F64)
    eps = 2e-4
    loss, m = grpo_guard_loss(lp, lp_old, adv, eps, mean=mean, old_mean=mean_old, std=std, dt=dt)
    total, clipped = 0.0, 0
    for i in range(b):
        for j in range(s_steps):
            bias = float(((mean[i, j] - mean_old[i, j]) ** 2).mean()) / (2 * float(std[i, j]) ** 2)
            r = math.exp((float(lp.detach()[i, j]) - float(lp_old[i, j]) + bias) * float(std[i, j]))
            a = float(adv[i])
            total += max(-a * r, -a * min(max(r, 1 - eps), 1 + eps)) / -float(dt[i, j])
            clipped += abs(r - 1) > eps
    assert loss.item() == pytest.approx(total / (b * s_steps), rel=1e-12)
    assert 0 < clipped < b * s_steps and m["clip_fraction"].item() == pytest.approx(clipped / (b * s_steps))


def test_guard_errors():
    lp = torch.zeros(2, dtype=F64)
    mean = torch.zeros(2, 3, dtype=F64)
    adv = torch.ones(2, dtype=F64)
    with pytest.raises(ValueError, match="inv_dt"):
        grpo_guard_loss(lp, lp, adv, 0.1, mean=mean, old_mean=mean, std=0.5, step_weight="dt")
    with pytest.raises(ValueError, match="dt is required"):
        grpo_guard_loss(lp, lp, adv, 0.1, mean=mean, old_mean=mean, std=0.5)
    with pytest.raises(ValueError, match="dt must be < 0"):
        grpo_guard_loss(lp, lp, adv, 0.1, mean=mean, old_mean=mean, std=0.5, dt=0.1)
    with pytest.raises(ValueError, match="std must be > 0"):
        grpo_guard_loss(lp, lp, adv, 0.1, mean=mean, old_mean=mean, std=torch.tensor([0.5, 0.0]), dt=-0.1)
    with pytest.raises(ValueError, match="mean and old_mean"):
        grpo_guard_loss(lp, lp, adv, 0.1, mean=mean, old_mean=mean[:, :2], std=0.5, dt=-0.1)
    with pytest.raises(ValueError, match="std must be a float"):
        grpo_guard_loss(lp, lp, adv, 0.1, mean=mean, old_mean=mean, std=torch.ones(3), dt=-0.1)


# ----------------------------------------------------------------------------------------------- Diffusion-DPO


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
    x0, noise = _randn(1, 4, 3, 2), _randn(2, 2, 3, 2).repeat_interleave(2, 0)  # pairs share noise
    target = noise - x0
    v_ref = target + 0.3 * _randn(3, 4, 3, 2)
    v = v_ref.clone().requires_grad_(True)
    err = _err(v, target)
    err_ref = _err(v_ref, target)
    loss, _ = diffusion_dpo_loss(err[0::2], err[1::2], err_ref[0::2], err_ref[1::2], beta=50.0)
    loss.backward()
    change = _err(_sgd(v_ref, v.grad, 1e-3), target) - err_ref
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


# --------------------------------------------------------------------------------------------------------- CRD


def _crd_inputs(seed=0, b=6):
    x0, noise = _randn(seed, b, 2, 3), _randn(seed + 1, b, 2, 3)
    target = noise - x0
    v_old = target + 0.4 * _randn(seed + 2, b, 2, 3)
    v_live = v_old + 0.1 * _randn(seed + 3, b, 2, 3)
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
    change = _err(_sgd(v_old, v.grad, 1e-3), target) - _err(v_old, target)
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
    v_u, v_c = _randn(30, 6, 2, 3), _randn(31, 6, 2, 3)
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
