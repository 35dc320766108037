"""GRPO-Guard: the normalized ratio is the centred ratio of the sampling noise, first-update value and gradient
relative to ``grpo_clip_loss``, [B, S] steps with clipping against a loop, input errors.
"""
import math

import pytest
import torch

from flowforge.algorithms.losses import grpo_clip_loss, grpo_guard_loss
from flowforge.algorithms.sde import transition
from tests.algorithms.losses.helpers import F64, randn

torch.set_num_threads(1)


def _guard_step(seed=0, b=4, sigma=0.7, sigma_next=0.55, eta=0.8, perturb=0.05, zero_noise=False):
    x = randn(seed, b, 2, 3, 3)
    v_old = randn(seed + 1, b, 2, 3, 3)
    v_live = v_old + perturb * randn(seed + 2, b, 2, 3, 3)
    eps = torch.zeros_like(x) if zero_noise else randn(seed + 3, b, 2, 3, 3)
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
    x = randn(11, 4, 2, 3, 3)
    v_old = randn(12, 4, 2, 3, 3)
    old = transition("sde", x, v_old, sigma, sigma_next, 0.7, noise=randn(13, 4, 2, 3, 3), sigma_max=0.95)
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
    lp_old = randn(20, b, s_steps) * 0.01
    lp = (lp_old + 0.002 * randn(21, b, s_steps)).requires_grad_(True)
    mean_old = randn(22, b, s_steps, 4)
    mean = mean_old + 0.01 * randn(23, b, s_steps, 4)
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
