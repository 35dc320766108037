"""DiffusionNFT: negative-aware fine-tuning on the forward process (no likelihoods), and the velocity KL term.

Equations (reference mode; ``sg`` = stop-gradient; sums / means over non-batch elements)::

    v+      = beta * v + (1 - beta) * sg(v_old)          implicit positive policy
    v-      = (1 + beta) * sg(v_old) - beta * v          implicit negative policy
    x0±     = x_sigma - sigma * v±
    L±_i    = mean_el( (x0± - x0)^2 ) / sg( max(mean_el |x0± - x0|, 1e-5) )     per sample, adaptive weight
    L       = mean_i( c * (r_i L+_i + (1 - r_i) L-_i) / beta )

Paper objective (``mode="paper_velocity_mse"``; ``v_target = noise - x0 = (x_sigma - x0) / sigma``)::

    L       = mean_i( r_i mean_el((v+ - v_target)^2) + (1 - r_i) mean_el((v- - v_target)^2) )

KL term (per sample ``[B]``; also the per-sample flow-matching error when ``v_ref = noise - x0``)::

    velocity_mse_kl = mean_el( (v - v_ref)^2 )

Notation
    =============  =================================================================================
    ``v``          live-policy velocity ``[B, *latent]`` (``noise - x0`` convention)
    ``v_old``      old / sampling-policy velocity, a constant; ``v_ref`` the frozen reference's
    ``sigma``      noise level ``[B]`` in [0, 1]; ``x_sigma = (1 - sigma) x0 + sigma noise``
    ``r``          optimality probability ``[B]`` in [0, 1] (``advantages.nft_optimality``)
    ``beta``       mixing coefficient (not a KL weight), ``> 0``
    ``c``          ``adv_clip`` (DiffusionNFT ``adv_clip_max``)
    ``mean_el``    mean over all non-batch elements
    =============  =================================================================================

Source: Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement with Forward Process" (arXiv 2509.16117),
policy optimization objective; reference implementation NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py`` (the
"reference" mode and the KL term).
"""

from __future__ import annotations

from typing import Tuple, Union

import torch

from ..common import compute_dtype, per_sample
from ._common import Metrics, el_mean

__all__ = ["nft_loss", "velocity_mse_kl", "NFT_MODES"]

NFT_MODES = ("reference", "paper_velocity_mse")


def nft_loss(
    v_live: torch.Tensor,
    v_old: torch.Tensor,
    x_sigma: torch.Tensor,
    x0: torch.Tensor,
    sigma: Union[float, torch.Tensor],
    r: torch.Tensor,
    *,
    beta: float,
    adv_clip: float,
    mode: str = "reference",
) -> Tuple[torch.Tensor, Metrics]:
    """DiffusionNFT negative-aware fine-tuning loss (no KL term; add one with ``velocity_mse_kl``).

    Args:
        v_live: ``[B, *latent]`` live-policy velocity at ``(x_sigma, sigma)``, carries the graph.
        v_old: same shape, old (sampling) policy velocity; detached here.
        x_sigma: ``[B, *latent]`` noised clean sample. x0: ``[B, *latent]`` the clean sample (the rollout's output).
        sigma: ``[B]``, 0-d or float, in (0, 1] for "paper_velocity_mse", [0, 1] for "reference".
        r: ``[B]`` optimality probability in [0, 1] (``advantages.nft_optimality``).
        beta: mixing coefficient ``> 0``. adv_clip: ``c > 0``; scales the "reference" loss by ``c / beta`` (as the
            reference code; the paper objective has no such factor and ignores ``adv_clip``).
        mode: "reference" (NVlabs/DiffusionNFT code: x0-space error with adaptive per-sample weight) |
            "paper_velocity_mse" (the paper's velocity-space objective, plain MSE to ``noise - x0``).
    Returns:
        ``loss`` 0-d and ``metrics``: ``positive_loss`` ``[B]``, ``negative_loss`` ``[B]`` (per-sample branch losses
        ``L+``, ``L-`` before the ``r`` weighting), ``r_mean`` 0-d — detached.
    Raises:
        ValueError: unknown ``mode`` (allowed listed), ``beta <= 0``, ``adv_clip <= 0``, shape mismatch, ``r``
            outside [0, 1], ``sigma == 0`` in "paper_velocity_mse" (the velocity target is undefined).
    Source: NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py`` (reference); DiffusionNFT paper, Zheng et al. 2025,
        "DiffusionNFT: Online Diffusion Reinforcement with Forward Process", policy optimization objective
        (paper_velocity_mse).
    """
    if mode not in NFT_MODES:
        raise ValueError(f"mode={mode!r} is not one of {NFT_MODES}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not adv_clip > 0:
        raise ValueError(f"adv_clip must be > 0, got {adv_clip}")
    shape = v_live.shape
    for name, t in (("v_old", v_old), ("x_sigma", x_sigma), ("x0", x0)):
        if t.shape != shape:
            raise ValueError(f"{name} must have the shape of v_live {tuple(shape)}, got {tuple(t.shape)}")
    if len(shape) < 2:
        raise ValueError(f"v_live must be [B, *latent], got {tuple(shape)}")
    dtype = compute_dtype(v_live, v_old, x_sigma, x0, r)
    b, nd, dev = shape[0], len(shape), v_live.device
    if r.shape != (b,):
        raise ValueError(f"r must have shape [B]=[{b}], got {tuple(r.shape)}")
    rr = r.detach().to(dtype)
    if bool(((rr < 0) | (rr > 1)).any()):
        raise ValueError("r must lie in [0, 1] (use advantages.nft_optimality)")
    s = per_sample(sigma, "sigma", (b,), dtype, dev).reshape(b, *([1] * (nd - 1)))
    v = v_live.to(dtype)
    vo = v_old.detach().to(dtype)
    xs, x0f = x_sigma.to(dtype), x0.to(dtype)
    v_pos = beta * v + (1.0 - beta) * vo
    v_neg = (1.0 + beta) * vo - beta * v

    if mode == "reference":

        def branch(vel: torch.Tensor) -> torch.Tensor:
            err = (xs - s * vel) - x0f
            weight = el_mean(err.detach().abs()).clamp(min=1e-5)
            return el_mean(err**2) / weight

        pos, neg = branch(v_pos), branch(v_neg)
        loss = (adv_clip * (rr * pos + (1.0 - rr) * neg) / beta).mean()
    else:
        if bool((s == 0).any()):
            raise ValueError("mode='paper_velocity_mse' needs sigma > 0 (v_target = (x_sigma - x0) / sigma)")
        target = (xs - x0f) / s
        pos = el_mean((v_pos - target) ** 2)
        neg = el_mean((v_neg - target) ** 2)
        loss = (rr * pos + (1.0 - rr) * neg).mean()
    metrics = {"positive_loss": pos.detach(), "negative_loss": neg.detach(), "r_mean": rr.mean()}
    return loss, metrics


def velocity_mse_kl(v: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    """Velocity-space KL surrogate ``mean_el((v - v_ref)^2)`` per sample.

    Args: ``v`` ``[B, *latent]`` (graph), ``v_ref`` same shape (reference policy, detached here).
    Returns: ``[B]``, fp32 (float64 stays float64).
    Raises: ValueError on shape mismatch.
    Source: DiffusionNFT ``train_nft_sd3.py`` KL term (``((v - v_ref)^2).mean`` over non-batch dims); for a
        Gaussian step with equal std it is proportional to the transition KL.
    """
    if v.shape != v_ref.shape or v.ndim < 2:
        raise ValueError(f"v and v_ref must share a [B, *latent] shape, got {tuple(v.shape)}, {tuple(v_ref.shape)}")
    dtype = compute_dtype(v, v_ref)
    return el_mean((v.to(dtype) - v_ref.detach().to(dtype)) ** 2)
