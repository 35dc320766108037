"""DiffusionNFT loss: independence of r at v == v_old, paper-mode gradient by hand, gradient direction, errors."""
import pytest
import torch

from flowforge.algorithms.advantages import nft_optimality
from flowforge.algorithms.losses import nft_loss
from tests.algorithms.losses.helpers import F64


def _nft_inputs(seed=0, b=3):
    g = torch.Generator().manual_seed(seed)
    x0, noise, v_old = (torch.randn(b, 2, 4, 4, generator=g, dtype=F64) for _ in range(3))
    sigma = torch.tensor([0.9, 0.5, 0.2][:b], dtype=F64)
    s = sigma.view(-1, 1, 1, 1)
    return x0, noise, v_old, sigma, (1 - s) * x0 + s * noise


@pytest.mark.parametrize("mode", ["reference", "paper_velocity_mse"])
def test_nft_with_live_equal_old_does_not_depend_on_r(mode):
    x0, noise, v_old, sigma, x_sigma = _nft_inputs()
    s = sigma.view(-1, 1, 1, 1)
    beta, c = 0.3, 5.0
    losses = []
    for r in ([0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.2, 0.9, 0.5]):
        loss, m = nft_loss(v_old.clone(), v_old, x_sigma, x0, sigma, torch.tensor(r, dtype=F64),
                           beta=beta, adv_clip=c, mode=mode)
        torch.testing.assert_close(m["positive_loss"], m["negative_loss"], rtol=0, atol=1e-14)
        losses.append(loss.item())
    assert max(losses) - min(losses) <= 1e-14
    if mode == "reference":
        err = x_sigma - s * v_old - x0
        per = (err**2).mean(dim=(1, 2, 3)) / err.abs().mean(dim=(1, 2, 3))
        hand = (c * per / beta).mean().item()
    else:
        hand = ((v_old - (noise - x0)) ** 2).mean().item()
    assert losses[0] == pytest.approx(hand, rel=1e-12)


def test_nft_paper_mode_gradient_by_hand():
    x0, noise, v_old, sigma, x_sigma = _nft_inputs(seed=1)
    beta = 0.5
    r = torch.tensor([0.0, 1.0, 0.25], dtype=F64)
    v = v_old.clone().requires_grad_(True)
    loss, _ = nft_loss(v, v_old, x_sigma, x0, sigma, r, beta=beta, adv_clip=1.0, mode="paper_velocity_mse")
    loss.backward()
    # at v == v_old both branches sit at v_old: d/dv = 2 beta (r - (1 - r)) (v_old - target) / numel_total
    target = noise - x0
    expected = 2 * beta * (2 * r - 1).view(-1, 1, 1, 1) * (v_old - target) / v.numel()
    torch.testing.assert_close(v.grad, expected, rtol=1e-10, atol=1e-14)


def test_nft_reference_gradient_direction_follows_r():
    x0, noise, v_old, sigma, x_sigma = _nft_inputs(seed=2)
    grads = []
    for r in (1.0, 0.0):
        v = v_old.clone().requires_grad_(True)
        loss, _ = nft_loss(v, v_old, x_sigma, x0, sigma, torch.full((3,), r, dtype=F64), beta=1.0, adv_clip=1.0)
        loss.backward()
        grads.append(v.grad)
    torch.testing.assert_close(grads[0], -grads[1], rtol=1e-10, atol=1e-14)
    assert grads[0].abs().sum().item() > 0


def test_nft_errors_and_optimality_link():
    x0, noise, v_old, sigma, x_sigma = _nft_inputs()
    r = nft_optimality(torch.tensor([1.0, -2.0, 9.0], dtype=F64), 5.0)
    with pytest.raises(ValueError, match="reference"):
        nft_loss(v_old, v_old, x_sigma, x0, sigma, r, beta=1.0, adv_clip=5.0, mode="x0")
    with pytest.raises(ValueError, match="beta"):
        nft_loss(v_old, v_old, x_sigma, x0, sigma, r, beta=0.0, adv_clip=5.0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        nft_loss(v_old, v_old, x_sigma, x0, sigma, r + 1, beta=1.0, adv_clip=5.0)
    with pytest.raises(ValueError, match="sigma > 0"):
        nft_loss(v_old, v_old, x_sigma, x0, torch.zeros(3, dtype=F64), r, beta=1.0, adv_clip=5.0,
                 mode="paper_velocity_mse")
    loss, m = nft_loss(v_old.float(), v_old.float(), x_sigma.float(), x0.float(), 0.5, r.float(), beta=1.0,
                       adv_clip=5.0)
    assert loss.dtype == torch.float32 and m["positive_loss"].shape == (3,)
