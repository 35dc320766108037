"""Per-frame fidelity of generated video against the real one: PSNR and SSIM.

=========  ===========================================================================================================
metric     definition (frames ``x``, ``y`` in [0, 1], grey ``[..., H, W]``)
=========  ===========================================================================================================
PSNR       ``10 log10(1 / mean((x - y)^2))`` dB per frame (peak 1); identical frames give ``+inf``, capped at
           :data:`PSNR_CAP` so means stay finite
SSIM       mean over the frame of ``((2 mu_x mu_y + C1)(2 s_xy + C2)) / ((mu_x^2 + mu_y^2 + C1)(s_x^2 + s_y^2 + C2))``
           with local statistics under a Gaussian window (sigma 1.5, 11 x 11 taps, zero padding cropped away: only
           fully inside windows, "valid"), ``C1 = (0.01)^2``, ``C2 = (0.03)^2``
=========  ===========================================================================================================

Sources: Wang, Bovik, Sheikh and Simoncelli 2004, "Image Quality Assessment: From Error Visibility to Structural
Similarity" (SSIM, its constants and window); PSNR is the standard definition. Computed in float32 (float64 stays).
"""

from __future__ import annotations

import torch

PSNR_CAP = 100.0
"""dB reported for identical frames."""


def psnr(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """PSNR ``[...]`` dB of frames ``x, y [..., H, W]`` in [0, 1] (peak 1, capped at :data:`PSNR_CAP`).

    Raises:
        ValueError: shapes differ or fewer than 2 dimensions.
    """
    if x.shape != y.shape or x.ndim < 2:
        raise ValueError(f"x and y must share a [..., H, W] shape, got {tuple(x.shape)} and {tuple(y.shape)}")
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    mse = (x.to(dt) - y.to(dt)).pow(2).mean(dim=(-2, -1))
    return (10.0 * torch.log10(1.0 / mse)).clamp(max=PSNR_CAP)


def _gaussian_window(size: int, sigma: float, dtype: torch.dtype) -> torch.Tensor:
    t = torch.arange(size, dtype=dtype) - (size - 1) / 2
    g = torch.exp(-(t ** 2) / (2 * sigma ** 2))
    g = g / g.sum()
    return (g[:, None] * g[None, :])[None, None]


def ssim(x: torch.Tensor, y: torch.Tensor, *, window: int = 11, sigma: float = 1.5) -> torch.Tensor:
    """SSIM ``[...]`` of frames ``x, y [..., H, W]`` in [0, 1] (module table; the window shrinks to the frame for
    frames smaller than ``window``).

    Raises:
        ValueError: shapes differ or fewer than 2 dimensions.
    """
    if x.shape != y.shape or x.ndim < 2:
        raise ValueError(f"x and y must share a [..., H, W] shape, got {tuple(x.shape)} and {tuple(y.shape)}")
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    lead, (h, w) = x.shape[:-2], x.shape[-2:]
    size = min(window, h, w)
    k = _gaussian_window(size, sigma, dt)
    a, b = x.to(dt).reshape(-1, 1, h, w), y.to(dt).reshape(-1, 1, h, w)
    conv = lambda t: torch.nn.functional.conv2d(t, k)  # noqa: E731
    mu_a, mu_b = conv(a), conv(b)
    var_a = conv(a * a) - mu_a ** 2
    var_b = conv(b * b) - mu_b ** 2
    cov = conv(a * b) - mu_a * mu_b
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
    return s.mean(dim=(-3, -2, -1)).reshape(lead)
