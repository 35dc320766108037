"""The differentiable sampler tails of reward-gradient training (DRaFT-K, DRaFT-LV, ReFL) on hand-made velocities."""

import pytest
import torch

from flowforge.algorithms.reward_grad import ode_tail, predict_x0, renoise
from flowforge.algorithms.sde import euler_step


def linear_field(w):
    """v(x, sigma) = w * x + sigma: a one-parameter velocity field ([B, C, H, W])."""
    return lambda x, sigma: w * x + sigma.reshape(-1, 1, 1, 1)


def test_ode_tail_is_the_euler_loop_and_checkpointing_changes_nothing():
    x = torch.randn(3, 1, 4, 4)
    sigmas = torch.tensor([0.6, 0.3, 0.1, 0.0])
    grads, outs = [], []
    for use_checkpoint in (True, False):
        w = torch.tensor(0.7, requires_grad=True)
        out = ode_tail(linear_field(w), x, sigmas, use_checkpoint=use_checkpoint)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append(w.grad)
    ref = x
    for i in range(3):  # the loop written out
        ref = euler_step(ref, 0.7 * ref + sigmas[i], sigmas[i], sigmas[i + 1])
    assert torch.equal(outs[0], ref) and torch.equal(outs[1], ref)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_ode_tail_gradient_is_the_closed_form():
    # one step from sigma=s to 0 with v = w x: x_out = x - s w x, d sum(x_out) / dw = -s sum(x)
    x, s = torch.randn(2, 1, 3, 3), 0.4
    w = torch.tensor(0.5, requires_grad=True)
    ode_tail(lambda x_, sig: w * x_, x, torch.tensor([s, 0.0])).sum().backward()
    torch.testing.assert_close(w.grad, -s * x.sum())


def test_predict_x0_is_one_euler_step_to_zero_and_recovers_x0_from_the_true_velocity():
    x0, noise, s = torch.randn(2, 1, 4, 4), torch.randn(2, 1, 4, 4), 0.3
    x_s = renoise(x0, noise, s)
    torch.testing.assert_close(x_s, (1 - s) * x0 + s * noise)
    torch.testing.assert_close(predict_x0(lambda x, sig: noise - x0, x_s, torch.tensor(s)), x0)
    w = torch.tensor(0.2)
    assert torch.equal(predict_x0(linear_field(w), x_s, torch.tensor(s)),
                       ode_tail(linear_field(w), x_s, torch.tensor([s, 0.0]), use_checkpoint=False))



def test_ode_tail_needs_a_step():
    with pytest.raises(ValueError, match="at least 2"):
        ode_tail(lambda x, s: x, torch.zeros(1, 1, 2, 2), torch.tensor([0.0]))
