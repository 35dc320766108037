"""Policy losses and KL terms for flow-matching RL: GRPO clipped surrogate, DiffusionNFT, KL regularizers.

What
    ``grpo_clip_loss`` (FlowGRPO / DanceGRPO PPO-style clipped surrogate over per-step log-probs), ``nft_loss``
    (DiffusionNFT's forward-process contrastive loss, no likelihoods needed), and the per-sample KL regularizers
    ``velocity_mse_kl`` / ``transition_mean_kl``. Every loss returns ``(loss, metrics)``; metrics are detached tensors.

Why
    These are the single source of the loss math; objectives only gather the tensors and call these.

Equations
    GRPO clip (per element of ``[B, S]``; ``eps_lo`` / ``eps_hi`` the clip range)::

        ratio   = exp(logp - logp_old)
        L       = mean( max( -A * ratio, -A * clamp(ratio, 1 - eps_lo, 1 + eps_hi) ) )
        approx_kl     = 0.5 * mean((logp - logp_old)^2)
        clip_fraction = mean( (ratio - 1 > eps_hi) | (1 - ratio > eps_lo) )   (= mean(|ratio - 1| > eps) symmetric)

    DiffusionNFT (reference mode; ``sg`` = stop-gradient; sums / means over non-batch elements)::

        v+      = beta * v + (1 - beta) * sg(v_old)          implicit positive policy
        v-      = (1 + beta) * sg(v_old) - beta * v          implicit negative policy
        x0±     = x_sigma - sigma * v±
        L±_i    = mean_el( (x0± - x0)^2 ) / sg( max(mean_el |x0± - x0|, 1e-5) )     per sample, adaptive weight
        L       = mean_i( c * (r_i L+_i + (1 - r_i) L-_i) / beta )

    DiffusionNFT paper objective (``mode="paper_velocity_mse"``; ``v_target = noise - x0 = (x_sigma - x0) / sigma``)::

        L       = mean_i( r_i mean_el((v+ - v_target)^2) + (1 - r_i) mean_el((v- - v_target)^2) )

    KL terms (per sample ``[B]``)::

        velocity_mse_kl     = mean_el( (v - v_ref)^2 )
        transition_mean_kl  = mean_el( (mean - mean_ref)^2 ) / (2 std^2)   = KL(N(mean, std^2) || N(mean_ref, std^2))
                                                                             per element, std the TRANSITION std

Notation
    =============  =================================================================================
    ``B``          samples; ``S`` trained steps per sample
    ``logp``       log-prob of a stored step under the live policy, ``[B, S]`` or ``[B]``, mean over elements
    ``A``          advantages ``[B]`` (broadcast over ``S``) or ``[B, S]``
    ``v``          live-policy velocity ``[B, *latent]`` (``noise - x0`` convention)
    ``v_old``      old / sampling-policy velocity, treated as a constant
    ``sigma``      noise level ``[B]`` in [0, 1]; ``x_sigma = (1 - sigma) x0 + sigma noise``
    ``r``          DiffusionNFT optimality probability ``[B]`` in [0, 1] (``advantages.nft_optimality``)
    ``beta``       DiffusionNFT mixing coefficient (not a KL weight), ``> 0``
    ``c``          ``adv_clip`` (DiffusionNFT ``adv_clip_max``)
    =============  =================================================================================

Dtypes: computed in float32 whatever the input dtype; float64 inputs are computed in float64.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch

__all__ = ["grpo_clip_loss", "nft_loss", "velocity_mse_kl", "transition_mean_kl", "NFT_MODES"]

NFT_MODES = ("reference", "paper_velocity_mse")

Metrics = Dict[str, torch.Tensor]


def _dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _per_sample(value: Union[float, torch.Tensor], name: str, batch: int, dtype, device) -> torch.Tensor:
    t = torch.as_tensor(value, device=device).to(dtype)
    if t.ndim == 0:
        return t.expand(batch)
    if t.shape != (batch,):
        raise ValueError(f"{name} must be a float, a 0-d tensor or shape [B]=[{batch}], got {tuple(t.shape)}")
    return t


def _el_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean over all non-batch dims: ``[B, ...] -> [B]``."""
    return t.mean(dim=tuple(range(1, t.ndim))) if t.ndim > 1 else t


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
    clip_high = clip_low if clip_high is None else clip_high
    if not (clip_low > 0 and clip_high > 0):
        raise ValueError(f"clip_low and clip_high must be > 0, got {clip_low}, {clip_high}")
    if adv_clip is not None and not adv_clip > 0:
        raise ValueError(f"adv_clip must be > 0 or None, got {adv_clip}")
    if log_prob.shape != old_log_prob.shape or log_prob.ndim not in (1, 2):
        raise ValueError(
            f"log_prob and old_log_prob must share a [B] or [B, S] shape, got {tuple(log_prob.shape)} and "
            f"{tuple(old_log_prob.shape)}"
        )
    if advantages.shape != log_prob.shape and advantages.shape != log_prob.shape[:1]:
        raise ValueError(
            f"advantages must be [B]={list(log_prob.shape[:1])} or {list(log_prob.shape)}, got {list(advantages.shape)}"
        )
    dtype = _dtype(log_prob, old_log_prob, advantages)
    lp = log_prob.to(dtype)
    old = old_log_prob.detach().to(dtype)
    adv = advantages.detach().to(dtype)
    if adv_clip is not None:
        adv = adv.clamp(-adv_clip, adv_clip)
    if adv.ndim < lp.ndim:
        adv = adv[:, None]
    diff = lp - old
    ratio = torch.exp(diff)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped).mean()
    r = ratio.detach()
    metrics = {
        "ratio_mean": r.mean(),
        "ratio_std": r.std(unbiased=False),
        "ratio_min": r.min(),
        "ratio_max": r.max(),
        "clip_fraction": ((r - 1.0 > clip_high) | (1.0 - r > clip_low)).to(dtype).mean(),
        "approx_kl": 0.5 * (diff.detach() ** 2).mean(),
    }
    return loss, metrics


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
    dtype = _dtype(v_live, v_old, x_sigma, x0, r)
    b, nd, dev = shape[0], len(shape), v_live.device
    if r.shape != (b,):
        raise ValueError(f"r must have shape [B]=[{b}], got {tuple(r.shape)}")
    rr = r.detach().to(dtype)
    if bool(((rr < 0) | (rr > 1)).any()):
        raise ValueError("r must lie in [0, 1] (use advantages.nft_optimality)")
    s = _per_sample(sigma, "sigma", b, dtype, dev).reshape(b, *([1] * (nd - 1)))
    v = v_live.to(dtype)
    vo = v_old.detach().to(dtype)
    xs, x0f = x_sigma.to(dtype), x0.to(dtype)
    v_pos = beta * v + (1.0 - beta) * vo
    v_neg = (1.0 + beta) * vo - beta * v

    if mode == "reference":

        def branch(vel: torch.Tensor) -> torch.Tensor:
            err = (xs - s * vel) - x0f
            weight = _el_mean(err.detach().abs()).clamp(min=1e-5)
            return _el_mean(err**2) / weight

        pos, neg = branch(v_pos), branch(v_neg)
        loss = (adv_clip * (rr * pos + (1.0 - rr) * neg) / beta).mean()
    else:
        if bool((s == 0).any()):
            raise ValueError("mode='paper_velocity_mse' needs sigma > 0 (v_target = (x_sigma - x0) / sigma)")
        target = (xs - x0f) / s
        pos = _el_mean((v_pos - target) ** 2)
        neg = _el_mean((v_neg - target) ** 2)
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
    dtype = _dtype(v, v_ref)
    return _el_mean((v.to(dtype) - v_ref.detach().to(dtype)) ** 2)


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
    dtype = _dtype(mean, mean_ref)
    s = _per_sample(std, "std", mean.shape[0], dtype, mean.device)
    if bool((s <= 0).any()):
        raise ValueError("std must be > 0 (a degenerate step has no transition KL)")
    sq = _el_mean((mean.to(dtype) - mean_ref.detach().to(dtype)) ** 2)
    return sq / (2 * s**2)
