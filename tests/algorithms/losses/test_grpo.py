"""FlowGRPO clipped surrogate (values, gradients, clipping, dtype, errors) and the transition / velocity KL terms."""
import pytest
import torch

from flowforge.algorithms.losses import grpo_clip_loss, transition_mean_kl, velocity_mse_kl
from tests.algorithms.losses.helpers import F64


def test_grpo_at_ratio_one_is_minus_mean_advantage_with_gradient_minus_a_over_n():
    adv = torch.tensor([2.0, -1.0, 0.5], dtype=F64)
    old = torch.tensor([[0.1, -0.2], [0.3, 0.0], [-0.5, 0.25]], dtype=F64)
    lp = old.clone().requires_grad_(True)
    loss, m = grpo_clip_loss(lp, old, adv, 1e-4)
    assert loss.item() == pytest.approx(-adv.mean().item(), abs=1e-15)
    loss.backward()
    n = lp.numel()
    torch.testing.assert_close(lp.grad, (-adv / n)[:, None].expand(3, 2), rtol=0, atol=1e-15)
    assert m["ratio_mean"].item() == 1.0 and m["clip_fraction"].item() == 0.0 and m["approx_kl"].item() == 0.0
    assert all(not t.requires_grad and t.ndim == 0 for t in m.values())


def test_one_step_leaving_the_band_does_not_zero_the_others():
    eps = 1e-3
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    old = torch.zeros(2, 3, dtype=F64)
    lp = old.clone()
    lp[0, 0] = 0.01   # ratio 1.01 > 1 + eps with A > 0: clipped branch is the max -> zero gradient
    lp[1, 0] = 0.01   # ratio 1.01 with A < 0: the unclipped (pessimistic) branch is the max -> keeps its gradient
    lp.requires_grad_(True)
    loss, m = grpo_clip_loss(lp, old, adv, eps)
    loss.backward()
    n = lp.numel()
    ratio = torch.exp(lp.detach())
    expected = -adv[:, None] * ratio / n
    expected[0, 0] = 0.0
    torch.testing.assert_close(lp.grad, expected, rtol=0, atol=1e-15)
    assert (lp.grad[:, 1:] != 0).all()
    assert m["clip_fraction"].item() == pytest.approx(2 / 6)
    unclipped = (-adv[:, None] * ratio)
    unclipped[0, 0] = -adv[0] * (1 + eps)
    assert loss.item() == pytest.approx(unclipped.mean().item(), abs=1e-15)


def test_asymmetric_clip_and_adv_clip():
    old = torch.zeros(4, dtype=F64)
    lp = torch.log(torch.tensor([1.2, 0.85, 1.2, 0.95], dtype=F64)).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 10.0, -1.0], dtype=F64)
    loss, m = grpo_clip_loss(lp, old, adv, 0.1, 0.3, adv_clip=2.0)
    loss.backward()
    # sample 0: within [0.9, 1.3]: gradient kept; sample 1: below 0.9 with A<0 -> clipped, zero gradient
    # sample 2: A clamped to 2; sample 3: in band
    ratio = torch.exp(lp.detach())
    a = torch.tensor([1.0, -1.0, 2.0, -1.0], dtype=F64)
    expected = -a * ratio / 4
    expected[1] = 0.0
    torch.testing.assert_close(lp.grad, expected, rtol=0, atol=1e-15)
    assert m["clip_fraction"].item() == pytest.approx(0.25)
    assert m["ratio_max"].item() == pytest.approx(1.2) and m["ratio_min"].item() == pytest.approx(0.85)
    assert m["approx_kl"].item() == pytest.approx(0.5 * (lp.detach() ** 2).mean().item())


def test_grpo_dtype_and_errors():
    lp = torch.zeros(2, 3, dtype=torch.bfloat16)
    loss, m = grpo_clip_loss(lp, lp, torch.ones(2, dtype=torch.bfloat16), 0.2)
    assert loss.dtype == torch.float32 and m["ratio_std"].dtype == torch.float32
    with pytest.raises(ValueError, match="clip"):
        grpo_clip_loss(lp, lp, torch.ones(2), 0.0)
    with pytest.raises(ValueError, match="advantages"):
        grpo_clip_loss(lp, lp, torch.ones(3), 0.2)
    with pytest.raises(ValueError, match="share"):
        grpo_clip_loss(lp, lp[:, :2], torch.ones(2), 0.2)


def test_kl_terms():
    g = torch.Generator().manual_seed(3)
    v, v_ref = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    torch.testing.assert_close(velocity_mse_kl(v, v_ref), ((v - v_ref) ** 2).mean(dim=(1, 2)))
    std = torch.tensor([0.3, 0.7])
    kl = transition_mean_kl(v, v_ref, std)
    ref = torch.distributions.kl_divergence(torch.distributions.Normal(v, std.view(-1, 1, 1)),
                                            torch.distributions.Normal(v_ref, std.view(-1, 1, 1)))
    torch.testing.assert_close(kl, ref.mean(dim=(1, 2)))
    torch.testing.assert_close(transition_mean_kl(v, v_ref, 0.3), transition_mean_kl(v, v_ref, torch.tensor([0.3, 0.3])))
    with pytest.raises(ValueError, match="std"):
        transition_mean_kl(v, v_ref, torch.tensor([0.3, 0.0]))
    with pytest.raises(ValueError, match="shape"):
        velocity_mse_kl(v, v_ref[:1])
