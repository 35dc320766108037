"""FlowGRPO: PPO-style clipped surrogate over per-step log-probs, and the transition KL regularizer.

Equations (per element of ``[B, S]``)::

    ratio         = exp(logp - logp_old)
    L             = mean( max( -A * ratio, -A * clamp(ratio, 1 - eps_lo, 1 + eps_hi) ) )
    approx_kl     = 0.5 * mean((logp - logp_old)^2)
    clip_fraction = mean( (ratio - 1 > eps_hi) | (1 - ratio > eps_lo) )   (= mean(|ratio - 1| > eps) symmetric)

    transition_mean_kl = mean_el( (mean - mean_ref)^2 ) / (2 s^2)        per sample ``[B]``
                       = KL(N(mean, s^2) || N(mean_ref, s^2)) per element when s is the TRANSITION std
    flow_grpo_kl       = mean_el( (mean - mean_ref)^2 ) / (2 std_dev_t^2)  per sample ``[B]``, flow_grpo's kl_loss
                       = (-dt) * KL per element for kind "sde" (std_dev_t = g, transition std = g sqrt(-dt))

flow_grpo's ``beta`` multiplies ``flow_grpo_kl``: for its default "sde" sampler it divides by the squared SDE
diffusion coefficient ``g^2`` (its ``std_dev_t``), not by the transition variance ``g^2 (-dt)``, so it is ``-dt``
(0.009-0.27 on the trained steps of 10-40-step, shift-3 schedules) times the KL of the two transitions.

Notation
    =============  =================================================================================
    ``B``, ``S``   samples; trained steps per sample
    ``logp``       log-prob of a stored step under the live policy, ``[B, S]`` or ``[B]``, mean over elements
    ``logp_old``   the same under the sampling (old) policy, a constant
    ``A``          advantages ``[B]`` (broadcast over ``S``) or ``[B, S]``
    ``eps_lo/hi``  ``clip_low`` / ``clip_high`` (PPO ratio band ``[1 - eps_lo, 1 + eps_hi]``)
    ``mean``       transition mean ``[B, *latent]`` (``sde.Transition.mean``); ``s`` a per-sample std ``[B]``
    ``std_dev_t``  what the reference step returns as ``std_dev_t`` (``sde.reference_std_dev_t``): the SDE
                   coefficient ``g = eta sqrt(sigma / (1 - sigma))`` for "sde", the transition std for "cps"
    ``dt``         ``sigma_next - sigma < 0``
    ``mean_el``    mean over all non-batch elements
    =============  =================================================================================

Source: Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via Online RL" (arXiv 2505.05470); reference
implementation yifan123/flow_grpo ``scripts/train_sd3.py`` (policy loss, ``approx_kl``, ``clipfrac``; KL loss
``((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t ** 2)`` with
``std_dev_t`` as returned by ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``); PPO (Schulman et al. 2017);
asymmetric clip as DAPO (Yu et al. 2025).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ..common import compute_dtype, per_sample
from ..sde import Sigma, reference_std_dev_t
from ._common import (
    Metrics,
    check_clip,
    check_ratio_inputs,
    gaussian_mean_kl,
    ppo_clip,
    prepared_advantages,
    ratio_metrics,
)

__all__ = ["grpo_clip_loss", "transition_mean_kl", "flow_grpo_kl"]


def grpo_clip_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: Optional[float] = None,
    *,
    adv_clip: Optional[float] = None,
) -> Tuple[torch.Tensor, Metrics]:
    """PPO-style clipped surrogate over per-step log-probs (FlowGRPO).

    Args:
        log_prob: ``[B, S]`` or ``[B]`` live-policy log-probs (mean over elements), carries the graph.
        old_log_prob: same shape, sampling-policy log-probs (detached here).
        advantages: ``[B]`` (broadcast over ``S``) or the shape of ``log_prob`` (detached here).
        clip_low: ``eps_lo > 0``, ratio floor ``1 - eps_lo``. clip_high: ``eps_hi > 0``, default ``clip_low``.
        adv_clip: if given, advantages are first clamped to ``[-adv_clip, adv_clip]`` (flow_grpo ``adv_clip_max``).
    Returns:
        ``loss`` 0-d (mean over samples and steps), ``metrics``: ``ratio_mean``, ``ratio_std`` (population),
        ``ratio_min``, ``ratio_max``, ``clip_fraction``, ``approx_kl`` — 0-d detached tensors.
    Raises:
        ValueError: non-positive clip values / adv_clip, shape mismatch.
    Source: flow_grpo ``scripts/train_sd3.py`` (policy loss, ``approx_kl``, ``clipfrac``); PPO (Schulman et al.
        2017); asymmetric clip as DAPO (Yu et al. 2025).
    """
    clip_high = check_clip(clip_low, clip_high)
    check_ratio_inputs(log_prob, old_log_prob, advantages, adv_clip)
    dtype = compute_dtype(log_prob, old_log_prob, advantages)
    lp = log_prob.to(dtype)
    old = old_log_prob.detach().to(dtype)
    adv = prepared_advantages(advantages, adv_clip, dtype, lp.ndim)
    diff = lp - old
    ratio = torch.exp(diff)
    loss = ppo_clip(ratio, adv, clip_low, clip_high).mean()
    return loss, ratio_metrics(ratio, diff, clip_low, clip_high)


def transition_mean_kl(
    mean: torch.Tensor, mean_ref: torch.Tensor, std: Union[float, torch.Tensor]
) -> torch.Tensor:
    """Equal-std Gaussian mean KL, per sample: ``mean_el((mean - mean_ref)^2) / (2 std^2)``, ``[B]``.

    With ``std = Transition.std`` (the per-step TRANSITION std, ``g * sqrt(-dt)`` for kind "sde") this is the exact
    ``KL(N(mean, std^2) || N(mean_ref, std^2))`` per element, mean over elements. flow_grpo's KL loss (what its
    ``beta`` weighs) is NOT that for kind "sde": it divides by ``g^2`` (its ``std_dev_t``), see :func:`flow_grpo_kl`.
    The element mean is taken before the division, as flow_grpo does.

    Args: ``mean`` ``[B, *latent]`` (graph), ``mean_ref`` same shape (detached here), ``std`` ``[B]`` / 0-d / float.
    Returns: ``[B]``, float32 (float64 if an input is float64).
    Raises: ValueError on shape mismatch or ``std <= 0`` anywhere.
    Source: the closed-form KL of two Gaussians of equal covariance; reduction as flow_grpo ``scripts/train_sd3.py``.
    """
    if mean.shape != mean_ref.shape or mean.ndim < 2:
        raise ValueError(
            f"mean and mean_ref must share a [B, *latent] shape, got {tuple(mean.shape)}, {tuple(mean_ref.shape)}"
        )
    dtype = compute_dtype(mean, mean_ref)
    s = per_sample(std, "std", (mean.shape[0],), dtype, mean.device)
    if bool((s <= 0).any()):
        raise ValueError("std must be > 0 (a degenerate step has no transition KL)")
    return gaussian_mean_kl(mean, mean_ref, s, dtype)


def flow_grpo_kl(
    mean: torch.Tensor,
    mean_ref: torch.Tensor,
    sigma: Sigma,
    sigma_next: Sigma,
    noise_level: float,
    *,
    kind: str = "sde",
    sigma_max: Optional[Sigma] = None,
) -> torch.Tensor:
    """flow_grpo's KL loss per sample, ``mean_el((mean - mean_ref)^2) / (2 std_dev_t^2)``: ``[B]`` (``beta``'s term).

    ``std_dev_t`` is what the reference step of ``kind`` returns (``sde.reference_std_dev_t``):
    for "sde" the SDE diffusion coefficient ``g = eta * sqrt(sigma / (1 - sigma'))``, so the value is ``-dt`` times
    the transition KL (:func:`transition_mean_kl` with ``Transition.std``); for "cps" and "dance" it is the transition
    std, so the two agree. Bit for bit the same operations as flow_grpo (``g`` as in ``transition``, the element mean
    before the division); the batch mean flow_grpo takes next (``torch.mean(kl_loss)``) is the caller's ``.mean()``.

    Args:
        mean: ``[B, *latent]`` live transition mean (``Transition.mean``, carries the graph).
        mean_ref: same shape, the reference policy's transition mean of the same step (detached here).
        sigma, sigma_next: the step's noise levels, ``[B]`` / 0-d / float (``sigmas[i]``, ``sigmas[i + 1]``).
        noise_level: ``eta`` of the rollout sampler. kind: the transition kind, "sde" | "cps" | "dance".
        sigma_max: the schedule's ``sigmas[1]`` (used by "sde" at ``sigma == 1``; default ``sigma_next``).
    Returns:
        ``[B]``, float32 (float64 if an input is float64).
    Raises:
        ValueError: shape mismatch; kind "ode" or unknown; ``std_dev_t <= 0`` (``eta == 0``, or "cps" at the last
            step).
    Source: flow_grpo ``scripts/train_sd3.py`` (``kl_loss = ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(dim=
        (1, 2, 3), keepdim=True) / (2 * std_dev_t ** 2)``) with ``std_dev_t`` from ``sde_step_with_logprob``.
    """
    if mean.shape != mean_ref.shape or mean.ndim < 2:
        raise ValueError(
            f"mean and mean_ref must share a [B, *latent] shape, got {tuple(mean.shape)}, {tuple(mean_ref.shape)}"
        )
    dtype = compute_dtype(mean, mean_ref)
    b, dev = mean.shape[0], mean.device
    s = per_sample(sigma, "sigma", (b,), dtype, dev)
    sn = per_sample(sigma_next, "sigma_next", (b,), dtype, dev)
    std_dev_t = reference_std_dev_t(kind, s, sn, noise_level, sigma_max=sigma_max)
    if bool((std_dev_t <= 0).any()):
        raise ValueError(f"std_dev_t must be > 0 (noise_level {noise_level}, kind {kind!r}): no KL at a noiseless step")
    return gaussian_mean_kl(mean, mean_ref, std_dev_t, dtype)
