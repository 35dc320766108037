"""GRPO-Guard: FlowGRPO's clipped surrogate with a normalized ratio (RatioNorm) and per-step gradient reweighting.

With Gaussian steps the per-step log-ratio of one stored sample ``x_next = mu_old + s eps`` is ``mean_el((mu -
mu_old) eps) / s - mean_el((mu - mu_old)^2) / (2 s^2)``: its mean is negative (the ratio is left-shifted, so
positive-advantage samples rarely reach ``1 + eps_hi``) and its spread ``~ |mu - mu_old| / s`` differs across steps.
RatioNorm adds back the bias term ``b`` and scales by ``s``, which centres the log-ratio at 0 with a step-consistent
scale; ``step_weight="inv_dt"`` then divides each step's surrogate by ``-dt`` to equalize gradients across noise
levels.

Equations::

    b       = mean_el((mu - sg(mu_old))^2) / (2 s^2)          (the transition KL, see ``transition_mean_kl``)
    ratio   = exp( (logp - logp_old + b) * s )                = exp(mean_el((mu - mu_old) eps)) for
                                                                x_next = mu_old + s eps: centred, no 1/s blow-up
    L       = mean( max(-A ratio, -A clamp(ratio, 1 - eps_lo, 1 + eps_hi)) / (-dt) )   step_weight "inv_dt"

First update (``log_prob == old_log_prob``, ``mean == old_mean``): ratio 1 and the value is ``-mean(A / -dt)``
(``-mean(A)`` with ``step_weight="none"``, equal to ``grpo_clip_loss``). The gradient is NOT grpo_clip_loss's: the
gradient through ``log_prob`` is ``s / (-dt)`` (or ``s``) times it and the bias term contributes none (it is
quadratic in ``mu - mu_old``). So the update direction per step is FlowGRPO's, rescaled per step.

It needs the Gaussian log-prob (mean over elements) of the same transition whose ``mean`` / ``std`` are passed: kinds
"sde" / "dance" (or "cps" with ``cps_log_prob="gaussian"``); with flow_grpo's unnormalized CPS log-prob the bias
identity does not hold.

Notation
    =============  =================================================================================
    ``logp``       live log-prob of a stored step ``[B]`` or ``[B, S]``, mean over elements; ``logp_old`` old's
    ``mu``         transition mean ``[B, (S,) *latent]``; ``mu_old`` the sampling policy's, a constant
    ``s``          transition std ``[B(, S)]`` (``sde.Transition.std``); ``dt = sigma_next - sigma < 0``
    ``A``          advantages; ``eps_lo/hi`` ``clip_low`` / ``clip_high``
    ``sg``         stop-gradient; ``mean_el`` mean over all latent elements
    =============  =================================================================================

Source: Wang et al. 2025, "GRPO-Guard: Mitigating Implicit Over-Optimization in Flow Matching via Regulated Clipping"
(arXiv 2510.22319; no official code found). Ratio formula: X-GenGroup/Flow-Factory ``trainers/rl/grpo.py``
(``GRPOGuardTrainer._guard_ratio``: ``exp(delta_logp * s + mse / (2 s))``) and the verl-omni GRPO-Guard page
(``docs/algo/grpo_guard.md``: ``exp((delta_logp + b) s)``, identical); the ``1 / (-dt)`` step reweighting follows
verl-omni (``GRPOGuardLoss``) and the paper's "1/dt gradient reweighting"; Flow-Factory's trainer omits it
(``step_weight="none"``).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ..common import compute_dtype
from ._common import (
    Metrics,
    check_clip,
    check_ratio_inputs,
    check_step_means,
    gaussian_mean_kl,
    positive_step_std,
    ppo_clip,
    prepared_advantages,
    ratio_metrics,
    step_stat,
)

__all__ = ["grpo_guard_loss", "GUARD_STEP_WEIGHTS"]

GUARD_STEP_WEIGHTS = ("inv_dt", "none")


def grpo_guard_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: Optional[float] = None,
    *,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std: Union[float, torch.Tensor],
    dt: Optional[Union[float, torch.Tensor]] = None,
    step_weight: str = "inv_dt",
    adv_clip: Optional[float] = None,
) -> Tuple[torch.Tensor, Metrics]:
    """GRPO-Guard clipped surrogate with RatioNorm and per-step reweighting (equations in the module docstring).

    Args:
        log_prob: ``[B]`` or ``[B, S]`` live log-probs of the stored steps (graph). old_log_prob: same shape
            (sampling policy, detached here).
        advantages: ``[B]`` (broadcast over ``S``) or the shape of ``log_prob`` (detached here).
        clip_low: ``eps_lo > 0``; clip_high: ``eps_hi > 0``, default ``clip_low``.
        mean: ``[B, *latent]`` (for ``[B]`` log-probs) or ``[B, S, *latent]``: live transition mean (graph).
        old_mean: same shape, the sampling policy's transition mean of the same step (detached here; store it in the
            rollout or recompute it with the old weights).
        std: the transition std ``s = std_dev_t * sqrt(-dt)`` (``Transition.std``, flow_grpo ``std_dev_t *
            sqrt(-dt)``), float / 0-d / the shape of ``log_prob``; ``> 0``.
        dt: ``sigma_next - sigma < 0``, float / 0-d / the shape of ``log_prob``; required for "inv_dt".
        step_weight: one of ``GUARD_STEP_WEIGHTS``: "inv_dt" (default; divide each step's surrogate by ``-dt``) or
            "none" (RatioNorm only).
        adv_clip: if given, advantages are clamped to ``[-adv_clip, adv_clip]``.
    Returns:
        ``loss`` 0-d (mean over samples and steps) and ``metrics``: ``ratio_mean``, ``ratio_std``, ``ratio_min``,
        ``ratio_max``, ``clip_fraction``, ``approx_kl`` (of the normalized log-ratio), ``raw_ratio_mean``
        (``mean exp(logp - logp_old)``, the un-normalized FlowGRPO ratio), ``mean_shift`` (``mean b``) — 0-d,
        detached.
    Raises:
        ValueError: unknown ``step_weight``; non-positive clip values / ``adv_clip``; ``std <= 0``; ``dt`` missing
            for "inv_dt" or ``dt >= 0``; shape mismatches.
    Source: Wang et al. 2025 (arXiv 2510.22319); Flow-Factory ``GRPOGuardTrainer._guard_ratio``; verl-omni
        ``GRPOGuardLoss`` (details in the module docstring).
    """
    if step_weight not in GUARD_STEP_WEIGHTS:
        raise ValueError(f"step_weight={step_weight!r} is not one of {GUARD_STEP_WEIGHTS}")
    clip_high = check_clip(clip_low, clip_high)
    check_ratio_inputs(log_prob, old_log_prob, advantages, adv_clip)
    check_step_means(mean, old_mean, log_prob)
    if step_weight == "inv_dt" and dt is None:
        raise ValueError("dt is required for step_weight='inv_dt' (pass sigma_next - sigma of each stored step)")
    dtype = compute_dtype(log_prob, old_log_prob, advantages, mean, old_mean)
    s = positive_step_std(std, log_prob, dtype)
    lp = log_prob.to(dtype)
    old = old_log_prob.detach().to(dtype)
    adv = prepared_advantages(advantages, adv_clip, dtype, lp.ndim)
    shift = gaussian_mean_kl(mean, old_mean, s, dtype)
    log_ratio = (lp - old + shift) * s
    ratio = torch.exp(log_ratio)
    per = ppo_clip(ratio, adv, clip_low, clip_high)
    if step_weight == "inv_dt":
        d = step_stat(dt, "dt", log_prob, dtype)
        if bool((d >= 0).any()):
            raise ValueError("dt must be < 0 (dt = sigma_next - sigma of a denoising step)")
        per = per / (-d)
    loss = per.mean()
    metrics = ratio_metrics(ratio, log_ratio, clip_low, clip_high)
    metrics["raw_ratio_mean"] = torch.exp(lp.detach() - old).mean()
    metrics["mean_shift"] = shift.detach().mean()
    return loss, metrics
