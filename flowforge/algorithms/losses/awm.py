"""Advantage Weighted Matching (AWM): the PPO clip on a flow-matching likelihood proxy (no KL term).

For each (sample, training sigma) row ``i``, ``logp_i = w(err(v_i), sigma_i)`` with ``err`` the per-sample
flow-matching error against ``target = noise - x0``, ``logp_old_i`` the same with the old velocity on the SAME
``x_sigma``, ``sigma``; then FlowGRPO's clipped surrogate of ``exp(logp - logp_old)`` times the advantage.

Equations (``w`` the weighting, default "ghuber")::

    err(v)  = mean_el((v - (noise - x0))^2)          at x_sigma = (1 - sigma) x0 + sigma noise
    logp    = w(err(v), sigma)     uniform: -err     t: -sigma err     t**2: -sigma^2 err
                                   huber:  -sigma (sqrt(err + 1e-10) - 1e-5)
                                   ghuber: -sigma ((err + 1e-10)^p - 1e-10^p) / p
    ratio   = exp(logp - sg(logp_old))
    L       = mean( max(-A ratio, -A clamp(ratio, 1 - eps_lo, 1 + eps_hi)) )

With "uniform" the ratio is ``exp(-(err_live - err_old))``; "t" / "t**2" scale the exponent by ``sigma`` /
``sigma^2``; "huber" / "ghuber" replace ``err`` by a robust root of it (times ``sigma``), which caps the pull of
outliers. Rows are independent: several training sigmas per sample are stacked along the batch dimension (``N = B *
T`` rows, the advantage repeated per row) and the loss is the mean over rows (the reference's
``loss_type="exp_first"``; its ``"sum_first"`` variant, which averages ``logp`` over the T sigmas of a sample before
the ratio, is not implemented).

Notation
    =============  =================================================================================
    ``v``          live-policy velocity ``[N, *latent]``; ``v_old`` the old / sampling policy's, a constant
    ``sigma``      flow-matching noise level ``[N]`` in [0, 1] (not a 0-1000 timestep)
    ``A``          advantages ``[N]``
    ``p``          ``ghuber_power``; ``eps_lo/hi`` ``clip_low`` / ``clip_high``
    ``sg``         stop-gradient; ``mean_el`` mean over all non-batch elements
    =============  =================================================================================

Source: Xue et al. 2025, "Advantage Weighted Matching: Aligning RL with Pretraining in Diffusion Models" (arXiv
2509.25050); reference implementation scxue/advantage_weighted_matching
``advantage_weighted_matching/scripts/train_sd3_awm.py`` (``compute_log_prob_awm``: weightings and the 1e-10 / 1e-5
constants; the training loop: ``exp_first`` ratio, clip, ``adv_clip_max`` / ``advantage_max``), configs
``config/dgx_awm.py``; cross-checked with X-GenGroup/Flow-Factory ``trainers/rl/awm.py``. The reference computes
``logp`` in float64; here it follows the package rule (fp32, float64 inputs stay float64).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch

from ..common import compute_dtype, per_sample
from ._common import (
    Metrics,
    check_adv_clip,
    check_clip,
    check_per_sample,
    check_velocity_like,
    fm_error,
    ppo_clip,
    prepared_advantages,
    ratio_metrics,
)

__all__ = ["awm_loss", "AWM_WEIGHTINGS"]

AWM_WEIGHTINGS = ("uniform", "t", "t**2", "huber", "ghuber")

# The AWM reference adds this inside the (generalized) Huber root so d/d err stays finite at err == 0.
_AWM_HUBER_EPS = 1e-10


def awm_loss(
    v_live: torch.Tensor,
    v_old: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor,
    sigma: Union[float, torch.Tensor],
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: Optional[float] = None,
    weighting: str = "ghuber",
    ghuber_power: float = 0.25,
    adv_clip: Optional[float] = None,
    adv_max: Optional[float] = None,
) -> Tuple[torch.Tensor, Metrics]:
    """Advantage Weighted Matching: PPO-clipped surrogate on the flow-matching likelihood proxy (module docstring).

    Args:
        v_live: ``[N, *latent]`` live-policy velocity at ``x_sigma = (1 - sigma) x0 + sigma noise``, carries the graph.
        v_old: same shape, old / sampling-policy velocity on the same inputs (detached here).
        x0: ``[N, *latent]`` clean rollout sample (the final latent). noise: ``[N, *latent]`` the forward-process noise
            used for ``x_sigma``; the same draw must be used for ``v_live`` and ``v_old``.
        sigma: ``[N]``, 0-d or float in [0, 1] (the flow-matching sigma, not a 0–1000 timestep).
        advantages: ``[N]`` (detached here).
        clip_low: ``eps_lo > 0``; clip_high: ``eps_hi > 0``, default ``clip_low``. The AWM reference configs use
            ``clip_range = 1`` (SD3.5 recipes; base config 1e-4); Flow-Factory recommends 1e-5.
        weighting: one of ``AWM_WEIGHTINGS``; default "ghuber" (the reference's SD3.5 recipes).
        ghuber_power: ``p > 0`` of "ghuber" (reference default 0.25); ignored otherwise.
        adv_clip: if given, advantages are clamped to ``[-adv_clip, adv_clip]`` (reference ``adv_clip_max``, 5).
        adv_max: if given (needs ``adv_clip``), clamped advantages are rescaled by ``adv_max / adv_clip`` (reference
            ``advantage_max``, 1: advantages end in [-1, 1]).
    Returns:
        ``loss`` 0-d, ``metrics``: ``ratio_mean``, ``ratio_std``, ``ratio_min``, ``ratio_max``, ``clip_fraction``,
        ``approx_kl`` (``0.5 mean (logp - logp_old)^2``), ``fm_error`` (mean live error), ``fm_error_old`` — 0-d,
        detached.
    Raises:
        ValueError: unknown ``weighting`` (allowed listed); non-positive clip / ``ghuber_power`` / ``adv_clip`` /
            ``adv_max``; ``adv_max`` without ``adv_clip``; shape mismatches; ``sigma`` outside [0, 1].
    Source: Xue et al. 2025 (arXiv 2509.25050); scxue/advantage_weighted_matching ``scripts/train_sd3_awm.py``.
    """
    clip_high = _check_awm_args(weighting, clip_low, clip_high, ghuber_power, adv_clip, adv_max)
    check_velocity_like("v_live", v_live, v_old=v_old, x0=x0, noise=noise)
    n = v_live.shape[0]
    check_per_sample("advantages", advantages, n)
    dtype = compute_dtype(v_live, v_old, x0, noise, advantages)
    s = per_sample(sigma, "sigma", (n,), dtype, v_live.device)
    if bool(((s < 0) | (s > 1)).any()):
        raise ValueError("sigma must lie in [0, 1] (flow-matching sigma, not a 0-1000 timestep)")
    target = noise.to(dtype) - x0.to(dtype)
    adv = prepared_advantages(advantages, adv_clip, dtype, 1)
    if adv_max is not None:
        adv = adv * (adv_max / adv_clip)
    err_live = fm_error(v_live.to(dtype), target)
    err_old = fm_error(v_old.detach().to(dtype), target)
    log_ratio = _weighted_log_prob(err_live, s, weighting, ghuber_power) - _weighted_log_prob(
        err_old, s, weighting, ghuber_power)
    ratio = torch.exp(log_ratio)
    loss = ppo_clip(ratio, adv, clip_low, clip_high).mean()
    metrics = ratio_metrics(ratio, log_ratio, clip_low, clip_high)
    metrics["fm_error"] = err_live.detach().mean()
    metrics["fm_error_old"] = err_old.mean()
    return loss, metrics


def _check_awm_args(weighting: str, clip_low: float, clip_high: Optional[float], ghuber_power: float,
                    adv_clip: Optional[float], adv_max: Optional[float]) -> float:
    """Validate ``awm_loss``'s options; returns ``clip_high`` (default ``clip_low``)."""
    if weighting not in AWM_WEIGHTINGS:
        raise ValueError(f"weighting={weighting!r} is not one of {AWM_WEIGHTINGS}")
    clip_high = check_clip(clip_low, clip_high)
    if weighting == "ghuber" and not ghuber_power > 0:
        raise ValueError(f"ghuber_power must be > 0, got {ghuber_power}")
    check_adv_clip(adv_clip)
    if adv_max is not None and (adv_clip is None or not adv_max > 0):
        raise ValueError(f"adv_max must be > 0 and needs adv_clip (it rescales by adv_max / adv_clip), got "
                         f"adv_max={adv_max}, adv_clip={adv_clip}")
    return clip_high


def _weighted_log_prob(err: torch.Tensor, s: torch.Tensor, weighting: str, ghuber_power: float) -> torch.Tensor:
    """AWM's likelihood proxy ``w(err, sigma)`` ``[N]`` (module docstring), from the per-sample error ``[N]``."""
    if weighting == "uniform":
        return -err
    if weighting == "t":
        return -err * s
    if weighting == "t**2":
        return -err * s**2
    if weighting == "huber":
        return -(torch.sqrt(err + _AWM_HUBER_EPS) - math.sqrt(_AWM_HUBER_EPS)) * s
    return -((err + _AWM_HUBER_EPS) ** ghuber_power - _AWM_HUBER_EPS**ghuber_power) * s / ghuber_power
