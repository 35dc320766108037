"""FlowGRPO: PPO-style clipped surrogate over per-step log-probs, and the transition KL regularizer.

Equations (per element of ``[B, S]``)::

    ratio         = exp(logp - logp_old)
    L             = mean( max( -A * ratio, -A * clamp(ratio, 1 - eps_lo, 1 + eps_hi) ) )
    approx_kl     = 0.5 * mean((logp - logp_old)^2)
    clip_fraction = mean( (ratio - 1 > eps_hi) | (1 - ratio > eps_lo) )   (= mean(|ratio - 1| > eps) symmetric)

    transition_mean_kl = mean_el( (mean - mean_ref)^2 ) / (2 std^2)      per sample ``[B]``
                       = KL(N(mean, std^2) || N(mean_ref, std^2)) per element, std the TRANSITION std

Notation
    =============  =================================================================================
    ``B``, ``S``   samples; trained steps per sample
    ``logp``       log-prob of a stored step under the live policy, ``[B, S]`` or ``[B]``, mean over elements
    ``logp_old``   the same under the sampling (old) policy, a constant
    ``A``          advantages ``[B]`` (broadcast over ``S``) or ``[B, S]``
    ``eps_lo/hi``  ``clip_low`` / ``clip_high`` (PPO ratio band ``[1 - eps_lo, 1 + eps_hi]``)
    ``mean``       transition mean ``[B, *latent]`` (``sde.Transition.mean``); ``std`` its std ``[B]``
    ``mean_el``    mean over all non-batch elements
    =============  =================================================================================

Source: Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via Online RL" (arXiv 2505.05470); reference
implementation yifan123/flow_grpo ``scripts/train_sd3.py`` (policy loss, ``approx_kl``, ``clipfrac``, KL loss); PPO
(Schulman et al. 2017); asymmetric clip as DAPO (Yu et al. 2025).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ..common import compute_dtype, per_sample
from ._common import (
    Metrics,
    check_clip,
    check_ratio_inputs,
    gaussian_mean_kl,
    ppo_clip,
    prepared_advantages,
    ratio_metrics,
)

__all__ = ["grpo_clip_loss", "transition_mean_kl"]


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
    """KL between two Gaussian transitions of equal std, per element, mean over elements: ``[B]``.

    ``KL(N(mean, std^2) || N(mean_ref, std^2)) = (mean - mean_ref)^2 / (2 std^2)``, averaged over elements.
    ``std`` is the per-step TRANSITION std (``Transition.std``, flow_grpo's returned ``std_dev_t * sqrt(-dt)``), not
    the SDE diffusion coefficient.

    Args: ``mean`` ``[B, *latent]`` (graph), ``mean_ref`` same shape (detached here), ``std`` ``[B]`` / 0-d / float.
    Returns: ``[B]``.
    Raises: ValueError on shape mismatch or ``std <= 0`` anywhere.
    Source: flow_grpo ``scripts/train_sd3.py`` KL loss.
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
