"""PSNR / SSIM per frame (flowforge.algorithms.video_metrics): hand values, identities, refusals."""

import math

import pytest
import torch

from flowforge.algorithms.video_metrics import PSNR_CAP, psnr, ssim


def test_psnr_by_hand_and_identity():
    x = torch.zeros(2, 4, 4)
    y = torch.full((2, 4, 4), 0.1)
    assert torch.allclose(psnr(x, y), torch.full((2,), 20.0))  # mse 0.01 -> 20 dB
    assert float(psnr(x[0], x[0])) == PSNR_CAP
    with pytest.raises(ValueError, match="share"):
        psnr(x, y[:1])


def test_ssim_identity_contrast_and_shape():
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(3, 2, 32, 32, generator=gen)
    assert torch.allclose(ssim(x, x), torch.ones(3, 2), atol=1e-5)
    assert ssim(x, x).shape == (3, 2)
    noisy = (x + 0.3 * torch.randn(x.shape, generator=gen)).clamp(0, 1)
    assert bool((ssim(x, noisy) < 0.9).all())
    flat = torch.full((1, 32, 32), 0.5)
    # a constant frame against another constant: luminance term only, (2 mu_a mu_b + C1) / (mu_a^2 + mu_b^2 + C1)
    other = torch.full((1, 32, 32), 0.25)
    expected = (2 * 0.5 * 0.25 + 1e-4) / (0.25 + 0.0625 + 1e-4)
    assert float(ssim(flat, other)) == pytest.approx(expected, rel=1e-4)
    assert not math.isnan(float(ssim(flat[:, :5, :5], other[:, :5, :5])))  # window shrinks to small frames
