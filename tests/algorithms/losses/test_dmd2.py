"""DMD2's losses against hand-computed arithmetic (flowforge.algorithms.losses.dmd2)."""

import math

import pytest
import torch

from flowforge.algorithms import losses


def test_dmd_gradient_is_the_fake_minus_real_difference_over_the_mean_abs_teacher_residual():
    # two samples of 2 elements each, numbers chosen by hand
    x = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    real = torch.tensor([[0.0, 0.0], [1.0, -3.0]])  # |x - real| means: (1 + 2) / 2 = 1.5 ; (1 + 3) / 2 = 2
    fake = torch.tensor([[3.0, -1.5], [2.0, 1.0]])
    g = losses.dmd_gradient(x, real, fake)
    expected = torch.tensor([[3.0 / 1.5, -1.5 / 1.5], [(2.0 - 1.0) / 2.0, (1.0 + 3.0) / 2.0]])
    torch.testing.assert_close(g, expected)


def test_dmd_gradient_is_zero_where_the_fake_score_equals_the_teacher_and_finite_at_a_perfect_sample():
    x = torch.randn(3, 1, 4, 4)
    real = torch.randn(3, 1, 4, 4)
    assert torch.equal(losses.dmd_gradient(x, real, real.clone()), torch.zeros_like(x))
    g = losses.dmd_gradient(x, x.clone(), x + 1)  # the teacher reproduces x exactly: floored, not inf / NaN
    assert torch.isfinite(g).all()


def test_dmd_loss_value_and_its_gradient_is_g_over_the_element_count():
    x = torch.tensor([[1.0, 2.0], [0.0, 0.0]], requires_grad=True)
    g = torch.tensor([[2.0, -1.0], [0.5, 2.0]])
    loss, metrics = losses.dmd_loss(x, g)
    # 1/2 mean((x - (x - g))^2) = 1/2 mean(g^2) = 1/2 * (4 + 1 + 0.25 + 4) / 4
    assert math.isclose(loss.item(), 0.5 * 9.25 / 4, rel_tol=1e-6)
    assert math.isclose(metrics["dm_grad_abs"].item(), 5.5 / 4, rel_tol=1e-6)
    loss.backward()
    torch.testing.assert_close(x.grad, g / 4)  # descending moves x by -g: toward the teacher, away from the fake


def test_fake_score_loss_is_flow_matching_on_detached_samples():
    x = torch.tensor([[1.0, -1.0]], requires_grad=True)
    noise = torch.tensor([[0.5, 0.5]])
    v = torch.tensor([[0.0, 1.0]], requires_grad=True)
    loss, metrics = losses.fake_score_loss(v, x, noise)
    # target = noise - x = [-0.5, 1.5]; mean((v - target)^2) = (0.25 + 0.25) / 2
    assert math.isclose(loss.item(), 0.25, rel_tol=1e-6) and metrics["loss_fake"] == loss.detach()
    loss.backward()
    assert x.grad is None and v.grad is not None  # only the fake score learns from it


def test_gan_losses_are_the_non_saturating_softplus_terms():
    gen = torch.tensor([0.0, 2.0])
    real = torch.tensor([1.0])
    lg, _ = losses.gan_generator_loss(gen)
    assert math.isclose(lg.item(), (math.log(2) + math.log1p(math.exp(-2.0))) / 2, rel_tol=1e-6)
    ld, m = losses.gan_discriminator_loss(real, gen)
    assert math.isclose(ld.item(), math.log1p(math.exp(-1.0)) + (math.log(2) + math.log1p(math.exp(2.0))) / 2,
                        rel_tol=1e-6)
    assert math.isclose(m["disc_acc"].item(), 1 / 3, rel_tol=1e-6)  # real right; 0.0 and 2.0 not < 0


def test_float64_stays_float64_and_shape_mismatches_are_refused():
    x = torch.randn(2, 3, dtype=torch.float64)
    assert losses.dmd_gradient(x, x + 1, x - 1).dtype == torch.float64
    with pytest.raises(ValueError, match="one shape"):
        losses.dmd_gradient(x, torch.zeros(2, 4), x)
    with pytest.raises(ValueError, match="one shape"):
        losses.dmd_loss(x, torch.zeros(3, 3))
