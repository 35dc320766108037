"""Transition kernels: Euler parity with diffusers, sampled moments, step-0 std, log-prob conventions, errors."""
import math

import pytest
import torch

from flowforge.algorithms import (
    euler_step,
    flow_match_sigmas,
    grpo_clip_loss,
    sde_diffusion_coefficient,
    transition,
)

diffusers = pytest.importorskip("diffusers")


def _xv(shape=(2, 4, 4, 4), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=dtype), torch.randn(shape, generator=g, dtype=dtype)


def test_sde_with_zero_noise_equals_diffusers_euler_step():
    n, shift = 10, 3.0
    sched = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    sched.set_timesteps(n)
    sig = flow_match_sigmas(n, shift)
    x, _ = _xv(seed=1)
    gen = torch.Generator().manual_seed(2)
    for i, t in enumerate(sched.timesteps):
        v = torch.randn(x.shape, generator=gen)
        ref = sched.step(v, t, x).prev_sample
        ours = transition("sde", x, v, sig[i], sig[i + 1], 0.0, sigma_max=sig[1], compute_log_prob=False)
        assert ours.log_prob is None
        assert torch.equal(ours.std, torch.zeros(2))
        torch.testing.assert_close(ours.x_next, ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(euler_step(x, v, sig[i], sig[i + 1]), ref, rtol=0, atol=1e-6)
        ode = transition("ode", x, v, sig[i], sig[i + 1], 0.0)
        assert torch.equal(ode.x_next, euler_step(x, v, sig[i], sig[i + 1])) and ode.log_prob is None
        x = ref


@pytest.mark.parametrize("kind,eta,step", [("sde", 0.7, 3), ("sde", 0.7, 0), ("dance", 0.3, 4), ("cps", 0.8, 2)])
def test_sampled_moments_match_mean_and_std(kind, eta, step):
    n_draws = 8192
    sig = flow_match_sigmas(10, 3.0)
    x1, v1 = _xv((1, 4, 2, 2), seed=3)
    x, v = x1.expand(n_draws, -1, -1, -1), v1.expand(n_draws, -1, -1, -1)
    gen = torch.Generator().manual_seed(4)
    tr = transition(kind, x, v, sig[step], sig[step + 1], eta, sigma_max=sig[1], generator=gen)
    std = tr.std[0].item()
    assert std > 0 and torch.equal(tr.std, tr.std[:1].expand(n_draws))
    emp_mean, emp_std = tr.x_next.mean(0), tr.x_next.std(0)
    se_mean, se_std = std / math.sqrt(n_draws), std / math.sqrt(2 * n_draws)
    assert (emp_mean - tr.mean[0]).abs().max().item() < 5 * se_mean
    assert (emp_std - std).abs().max().item() < 5 * se_std


def test_step0_transition_std_is_exactly_eta_not_the_diffusion_coefficient():
    eta = 0.7
    sig = flow_match_sigmas(12, 3.0)
    x, v = _xv()
    tr32 = transition("sde", x, v, sig[0], sig[1], eta, sigma_max=sig[1])
    assert (tr32.std - eta).abs().max().item() <= 1e-6
    sig64 = sig.double()
    tr64 = transition("sde", x.double(), v.double(), sig64[0], sig64[1], eta, sigma_max=sig64[1])
    assert (tr64.std - eta).abs().max().item() <= 1e-12
    # flow_grpo's std_dev_t (the SDE diffusion coefficient) is NOT eta at step 0: it is eta / sqrt(1 - sigmas[1])
    g = sde_diffusion_coefficient(sig64[:1], eta, sigma_max=sig64[1])
    assert abs(g.item() - eta / math.sqrt(1 - sig64[1].item())) <= 1e-12
    assert g.item() > 5 * eta
    # and the later steps' transition std is not eta
    tr1 = transition("sde", x.double(), v.double(), sig64[1], sig64[2], eta)
    assert (tr1.std - eta).abs().min().item() > 1e-3


def test_log_prob_is_gaussian_density_mean_over_elements():
    sig = flow_match_sigmas(10, 3.0)
    x, v = _xv(seed=5)
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(6))
    for kind, extra in [("sde", {}), ("dance", {}), ("cps", {"cps_log_prob": "gaussian"})]:
        tr = transition(kind, x, v, sig[2], sig[3], 0.5, noise=noise, **extra)
        torch.testing.assert_close(tr.x_next, tr.mean + tr.std.view(-1, 1, 1, 1) * noise)
        dist = torch.distributions.Normal(tr.mean, tr.std.view(-1, 1, 1, 1))
        torch.testing.assert_close(tr.log_prob, dist.log_prob(tr.x_next).mean(dim=(1, 2, 3)))
        by_hand = (-0.5 * noise**2).mean(dim=(1, 2, 3)) - torch.log(tr.std) - 0.5 * math.log(2 * math.pi)
        torch.testing.assert_close(tr.log_prob, by_hand)
        scored = transition(kind, x, v, sig[2], sig[3], 0.5, x_next=tr.x_next, **extra)
        torch.testing.assert_close(scored.log_prob, tr.log_prob)


def test_cps_reference_log_prob_is_unnormalized():
    sig = flow_match_sigmas(10, 3.0)
    x, v = _xv(seed=7)
    tr = transition("cps", x, v, sig[2], sig[3], 0.8)
    torch.testing.assert_close(tr.log_prob, -((tr.x_next - tr.mean) ** 2).mean(dim=(1, 2, 3)))
    last = transition("cps", x, v, sig[9], sig[10], 0.8)  # std 0 at sigma_next 0; reference mode stays defined
    assert torch.equal(last.std, torch.zeros(2)) and torch.equal(last.log_prob, torch.zeros(2))
    with pytest.raises(ValueError, match="std is 0"):
        transition("cps", x, v, sig[9], sig[10], 0.8, cps_log_prob="gaussian")


def test_zero_std_log_prob_raises():
    sig = flow_match_sigmas(10, 3.0)
    x, v = _xv()
    with pytest.raises(ValueError, match="compute_log_prob=False"):
        transition("sde", x, v, sig[2], sig[3], 0.0)


def test_summed_log_probs_would_overflow_but_mean_convention_stays_finite():
    sig = flow_match_sigmas(10, 3.0)
    x, v_old = _xv((2, 16, 16, 16), seed=8)
    v_new = v_old + torch.randn(x.shape, generator=torch.Generator().manual_seed(9))
    old = transition("sde", x, v_old, sig[5], sig[6], 0.7, generator=torch.Generator().manual_seed(10))
    new = transition("sde", x, v_new, sig[5], sig[6], 0.7, x_next=old.x_next)
    numel = 16 * 16 * 16
    summed_diff = (new.log_prob - old.log_prob) * numel
    assert bool((summed_diff.abs() > 89).all())  # exp overflows float32 above ~88.7
    assert not bool(torch.isfinite(torch.exp(summed_diff.abs())).any())
    loss, m = grpo_clip_loss(new.log_prob[:, None], old.log_prob[:, None], torch.tensor([1.0, -1.0]), 1e-4)
    assert bool(torch.isfinite(loss)) and bool(torch.isfinite(m["ratio_max"]))
    assert 0.5 < m["ratio_min"].item() <= m["ratio_max"].item() < 2.0


def test_dtypes_fp32_compute_and_float64_kept():
    sig = flow_match_sigmas(10, 3.0)
    x, v = _xv(seed=11)
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(12))
    ref = transition("sde", x, v, sig[3], sig[4], 0.7, noise=noise)
    bf = transition("sde", x.bfloat16(), v.bfloat16(), sig[3], sig[4], 0.7, noise=noise.bfloat16())
    assert bf.x_next.dtype == bf.mean.dtype == bf.log_prob.dtype == torch.float32
    exact = transition("sde", x.bfloat16().float(), v.bfloat16().float(), sig[3], sig[4], 0.7,
                       noise=noise.bfloat16().float())
    torch.testing.assert_close(bf.log_prob, exact.log_prob, rtol=0, atol=0)
    d = transition("sde", x.double(), v.double(), sig[3].double(), sig[4].double(), 0.7, noise=noise.double())
    assert d.log_prob.dtype == torch.float64
    torch.testing.assert_close(d.log_prob.float(), ref.log_prob, rtol=1e-5, atol=1e-6)


def test_sigma_float_0d_and_per_sample_agree():
    sig = flow_match_sigmas(10, 3.0)
    x, v = _xv(seed=13)
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(14))
    a = transition("dance", x, v, float(sig[3]), float(sig[4]), 0.3, noise=noise)
    b = transition("dance", x, v, sig[3], sig[4], 0.3, noise=noise)
    c = transition("dance", x, v, sig[3].expand(2), sig[4].expand(2), 0.3, noise=noise)
    torch.testing.assert_close(a.log_prob, b.log_prob, rtol=0, atol=0)
    torch.testing.assert_close(b.log_prob, c.log_prob, rtol=0, atol=0)
    # per-sample sigmas: each row equals its own scalar computation
    mixed = transition("dance", x, v, sig[[3, 5]], sig[[4, 6]], 0.3, noise=noise)
    row1 = transition("dance", x[1:], v[1:], sig[5], sig[6], 0.3, noise=noise[1:])
    torch.testing.assert_close(mixed.log_prob[1:], row1.log_prob)
    with pytest.raises(ValueError, match=r"\[B\]"):
        transition("dance", x, v, sig[:3], sig[1:4], 0.3)


def test_gradient_flows_through_mean_only_and_generator_is_deterministic():
    sig = flow_match_sigmas(10, 3.0)
    x, v = _xv(seed=15)
    v = v.clone().requires_grad_(True)
    t1 = transition("sde", x, v, sig[3], sig[4], 0.7, generator=torch.Generator().manual_seed(0))
    t2 = transition("sde", x, v, sig[3], sig[4], 0.7, generator=torch.Generator().manual_seed(0))
    assert torch.equal(t1.x_next, t2.x_next) and not t1.x_next.requires_grad
    t1.log_prob.sum().backward()
    assert v.grad is not None and v.grad.abs().sum().item() > 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(kind="euler"), "sde"),
    (dict(kind="sde", noise_level=-0.1), "noise_level"),
    (dict(kind="cps", noise_level=1.5), "cps"),
    (dict(kind="cps", cps_log_prob="normal"), "unnormalized"),
])
def test_bad_arguments_raise(kwargs, match):
    x, v = _xv()
    args = dict(kind="sde", noise_level=0.5)
    args.update(kwargs)
    kind, eta = args.pop("kind"), args.pop("noise_level")
    with pytest.raises(ValueError, match=match):
        transition(kind, x, v, 0.5, 0.4, eta, **args)
