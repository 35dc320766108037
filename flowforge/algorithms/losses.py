"""Policy losses and KL terms for flow-matching RL: GRPO (+ Guard), DiffusionNFT, AWM, DGPO, Diffusion-DPO, CRD.

What
    ``grpo_clip_loss`` (FlowGRPO / DanceGRPO PPO-style clipped surrogate over per-step log-probs), ``nft_loss``
    (DiffusionNFT's forward-process contrastive loss, no likelihoods needed), and the per-sample KL regularizers
    ``velocity_mse_kl`` / ``transition_mean_kl``. Every loss returns ``(loss, metrics)``; metrics are detached tensors.
    Further objectives (appended below the originals): ``awm_loss`` (Advantage Weighted Matching), ``dgpo_loss``
    (Direct Group Preference Optimization), ``grpo_guard_loss`` (GRPO-Guard regulated clipping),
    ``diffusion_dpo_loss`` + ``best_worst_pairs`` (online Diffusion-DPO), ``crd_loss`` + ``cfg_velocity`` (Centered
    Reward Distillation).

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

    Forward-process objectives share ``err(v) = mean_el((v - (noise - x0))^2)`` (per-sample flow-matching error at
    ``x_sigma = (1 - sigma) x0 + sigma noise``; ``target = noise - x0``).

    AWM (PPO clip on a flow-matching likelihood proxy; ``w`` the weighting, default "ghuber")::

        logp    = w(err(v), sigma)             uniform: -err     t: -sigma err     t**2: -sigma^2 err
                                               huber: -sigma (sqrt(err + 1e-10) - 1e-5)
                                               ghuber: -sigma ((err + 1e-10)^p - 1e-10^p) / p
        ratio   = exp(logp - sg(logp_old))     (logp_old from v_old on the SAME x_sigma, sigma)
        L       = mean( max(-A ratio, -A clamp(ratio, 1 - eps_lo, 1 + eps_hi)) )

    DGPO (per group g of n_g samples sharing noise and sigma; d_i = err(v_i), d_ref_i = err(v_ref_i))::

        s_g     = beta / n_g * sum_{i in g} A_i (d_i - d_ref_i)          = -(R(G+) - R(G-))
        paper:      L = mean_g( -log sigmoid(-s_g) )
        reference:  L = mean_i( sg(sigmoid(s_g(i))) * A_i * d_i )         same gradient / beta (groups of equal n)
        optional clip (v_old): d_i -> sg(d_i) where A_i > 0 and exp(d_old_i - d_i) > 1 + eps,
                               or A_i <= 0 and exp(d_old_i - d_i) < 1 - eps

    GRPO-Guard (``s`` the transition std, ``mu`` / ``mu_old`` the transition means of the stored step)::

        b       = mean_el((mu - sg(mu_old))^2) / (2 s^2)
        ratio   = exp( (logp - logp_old + b) * s )          RatioNorm; = exp(mean_el((mu - mu_old) eps)) for
                                                             x_next = mu_old + s eps: centred, no 1/s blow-up
        L       = mean( max(-A ratio, -A clamp(ratio, 1 - eps_lo, 1 + eps_hi)) / (-dt) )   step_weight "inv_dt"

    Diffusion-DPO (pairs (w, l) sharing noise and sigma; beta absorbs the paper's T * omega(lambda))::

        z       = -beta / 2 * ((err_w - err_ref_w) - (err_l - err_ref_l))
        L       = mean( -log sigmoid(z) )

    CRD (``p`` centring weights within a group: uniform, or softmax(+-a / tau) for the two directions)::

        r_i     = -( err(v_i) / sg(mae_i) - err(v_old_i) / sg(mae_old_i) )      mae = mean_el|v - target| >= 1e-5
        a_i     = clamp(clamp(A_i, -c, c) / c / 2 + 1/2, 0, 1)
        Rc_i    = a_i - sum_{j in g} p_j a_j,   Rt_i = r_i - sg(sum_{j in g} p_j r_j)
        L_pol   = c / beta * mean_i( (beta Rt_i - Rc_i)^2 )                    ("bce": BCE(logit beta Rt, sigmoid Rc))
        L_kl    = kl_beta * mean_i( (m + a_i (1 - m)) * mean_el((v_i - v_teacher_i)^2) ),  m = 1e-4 / kl_beta
        v_teacher = v_u + w (v_c - v_u)     (reference policy, classifier-free guided, ``cfg_velocity``)

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
    ``beta``       in ``dgpo_loss`` / ``diffusion_dpo_loss`` / ``crd_loss``: the preference / reward temperature
    ``sg``         stop-gradient (``.detach()``); ``mean_el`` mean over all non-batch elements
    ``v_ref``      frozen reference (pretrained) policy velocity; ``v_teacher`` its CFG-guided velocity
    ``g``, ``n_g`` group (same prompt, shared noise and sigma for DGPO) and its size in the batch
    ``mu``, ``s``  transition mean ``[B, (S,) *latent]`` and transition std ``[B(, S)]`` (``sde.Transition``)
    ``dt``         ``sigma_next - sigma < 0`` of the stored step
    ``eps_lo/hi``  ``clip_low`` / ``clip_high`` (PPO ratio band ``[1 - eps_lo, 1 + eps_hi]``)
    =============  =================================================================================

Dtypes: computed in float32 whatever the input dtype; float64 inputs are computed in float64.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple, Union

import torch

from .advantages import GroupIds, _group_index

__all__ = [
    "grpo_clip_loss",
    "nft_loss",
    "velocity_mse_kl",
    "transition_mean_kl",
    "NFT_MODES",
    "awm_loss",
    "AWM_WEIGHTINGS",
    "dgpo_loss",
    "DGPO_MODES",
    "grpo_guard_loss",
    "GUARD_STEP_WEIGHTS",
    "diffusion_dpo_loss",
    "best_worst_pairs",
    "crd_loss",
    "CRD_LOSS_TYPES",
    "cfg_velocity",
]

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


def _check_clip(clip_low: float, clip_high: Optional[float]) -> float:
    clip_high = clip_low if clip_high is None else clip_high
    if not (clip_low > 0 and clip_high > 0):
        raise ValueError(f"clip_low and clip_high must be > 0, got {clip_low}, {clip_high}")
    return clip_high


def _check_ratio_inputs(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                        adv_clip: Optional[float]) -> None:
    """Shapes shared by the ratio losses: log-probs ``[B]`` or ``[B, S]``, advantages ``[B]`` or alike."""
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


def _prepared_advantages(advantages: torch.Tensor, adv_clip: Optional[float], dtype, ndim: int) -> torch.Tensor:
    """Detached advantages in ``dtype``, clamped to ``±adv_clip`` if given, broadcast to ``ndim`` dims."""
    adv = advantages.detach().to(dtype)
    if adv_clip is not None:
        adv = adv.clamp(-adv_clip, adv_clip)
    return adv[:, None] if adv.ndim < ndim else adv


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
    clip_high = _check_clip(clip_low, clip_high)
    _check_ratio_inputs(log_prob, old_log_prob, advantages, adv_clip)
    dtype = _dtype(log_prob, old_log_prob, advantages)
    lp = log_prob.to(dtype)
    old = old_log_prob.detach().to(dtype)
    adv = _prepared_advantages(advantages, adv_clip, dtype, lp.ndim)
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


# ---------------------------------------------------------------------------------------------------------------
# Forward-process and preference objectives: AWM, DGPO, GRPO-Guard, Diffusion-DPO, CRD.
# ---------------------------------------------------------------------------------------------------------------

AWM_WEIGHTINGS = ("uniform", "t", "t**2", "huber", "ghuber")
DGPO_MODES = ("reference", "paper")
GUARD_STEP_WEIGHTS = ("inv_dt", "none")
CRD_LOSS_TYPES = ("mse", "bce")

# The AWM reference adds this inside the (generalized) Huber root so d/d err stays finite at err == 0.
_AWM_HUBER_EPS = 1e-10


def _check_velocity_like(ref_name: str, ref: torch.Tensor, **others: Optional[torch.Tensor]) -> None:
    if ref.ndim < 2:
        raise ValueError(f"{ref_name} must be [B, *latent] (at least 2-d), got {tuple(ref.shape)}")
    for name, t in others.items():
        if t is not None and t.shape != ref.shape:
            raise ValueError(f"{name} must have the shape of {ref_name} {tuple(ref.shape)}, got {tuple(t.shape)}")


def _check_per_sample(name: str, t: torch.Tensor, batch: int) -> None:
    if not isinstance(t, torch.Tensor) or t.shape != (batch,):
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a tensor of shape [B]=[{batch}], got {shape}")


def _fm_error(v: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample flow-matching error ``mean_el((v - target)^2)``: ``[B]``."""
    return _el_mean((v - target) ** 2)


def _group_ids_to_index(group_ids: GroupIds, batch: int, device: torch.device) -> Tuple[torch.Tensor, int]:
    inv, num_groups, _ = _group_index(group_ids, batch, device)
    return inv, num_groups


def _group_sum(values: torch.Tensor, inv: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add(0, inv, values)


def _ppo_clip(ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    """Elementwise PPO surrogate ``max(-A ratio, -A clamp(ratio, 1 - lo, 1 + hi))`` (not reduced)."""
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high))


def _ratio_metrics(ratio: torch.Tensor, log_ratio: torch.Tensor, clip_low: float, clip_high: float) -> Metrics:
    r = ratio.detach()
    return {
        "ratio_mean": r.mean(),
        "ratio_std": r.std(unbiased=False),
        "ratio_min": r.min(),
        "ratio_max": r.max(),
        "clip_fraction": ((r - 1.0 > clip_high) | (1.0 - r > clip_low)).to(r.dtype).mean(),
        "approx_kl": 0.5 * (log_ratio.detach() ** 2).mean(),
    }


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
    """Advantage Weighted Matching: PPO-clipped surrogate on the flow-matching likelihood proxy (no KL term).

    For each (sample, training sigma) row ``i``: ``logp_i = w(err(v_live_i), sigma_i)`` with ``err`` the per-sample
    flow-matching error (mean over elements) against ``target = noise - x0``; ``logp_old_i`` the same with
    ``v_old`` (the sampling / old policy at the same ``x_sigma``, ``sigma``); then the PPO clip of
    ``exp(logp - logp_old)`` times the advantage (equations in the module docstring). With ``weighting="uniform"``
    the ratio is ``exp(-(err_live - err_old))``; "t" / "t**2" scale the exponent by ``sigma`` / ``sigma^2``;
    "huber" / "ghuber" replace ``err`` by a robust root of it (times ``sigma``), which caps the pull of outliers.

    Rows are independent: pass several training sigmas per sample by stacking them along the batch dimension
    (``N = B * T`` rows, the advantage repeated per row). The loss is the mean over rows (the reference's
    ``loss_type="exp_first"``; its ``"sum_first"`` variant, which averages ``logp`` over the T sigmas of a sample
    before the ratio, is not implemented).

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
    Source: Xue et al. 2025, "Advantage Weighted Matching: Aligning RL with Pretraining in Diffusion Models"
        (arXiv 2509.25050); reference code scxue/advantage_weighted_matching
        ``advantage_weighted_matching/scripts/train_sd3_awm.py`` (``compute_log_prob_awm``: weightings and the
        1e-10 / 1e-5 constants; the training loop: ``exp_first`` ratio, clip, ``adv_clip_max`` /
        ``advantage_max``), configs ``config/dgx_awm.py``; cross-checked with X-GenGroup/Flow-Factory
        ``trainers/rl/awm.py``. The reference computes ``logp`` in float64; here it follows the package rule (fp32,
        float64 inputs stay float64).
    """
    if weighting not in AWM_WEIGHTINGS:
        raise ValueError(f"weighting={weighting!r} is not one of {AWM_WEIGHTINGS}")
    clip_high = _check_clip(clip_low, clip_high)
    if weighting == "ghuber" and not ghuber_power > 0:
        raise ValueError(f"ghuber_power must be > 0, got {ghuber_power}")
    if adv_clip is not None and not adv_clip > 0:
        raise ValueError(f"adv_clip must be > 0 or None, got {adv_clip}")
    if adv_max is not None and (adv_clip is None or not adv_max > 0):
        raise ValueError(f"adv_max must be > 0 and needs adv_clip (it rescales by adv_max / adv_clip), got "
                         f"adv_max={adv_max}, adv_clip={adv_clip}")
    _check_velocity_like("v_live", v_live, v_old=v_old, x0=x0, noise=noise)
    n = v_live.shape[0]
    _check_per_sample("advantages", advantages, n)
    dtype = _dtype(v_live, v_old, x0, noise, advantages)
    s = _per_sample(sigma, "sigma", n, dtype, v_live.device)
    if bool(((s < 0) | (s > 1)).any()):
        raise ValueError("sigma must lie in [0, 1] (flow-matching sigma, not a 0-1000 timestep)")
    target = noise.to(dtype) - x0.to(dtype)
    adv = advantages.detach().to(dtype)
    if adv_clip is not None:
        adv = adv.clamp(-adv_clip, adv_clip)
        if adv_max is not None:
            adv = adv * (adv_max / adv_clip)

    def weighted_logp(err: torch.Tensor) -> torch.Tensor:
        if weighting == "uniform":
            return -err
        if weighting == "t":
            return -err * s
        if weighting == "t**2":
            return -err * s**2
        if weighting == "huber":
            return -(torch.sqrt(err + _AWM_HUBER_EPS) - math.sqrt(_AWM_HUBER_EPS)) * s
        return -((err + _AWM_HUBER_EPS) ** ghuber_power - _AWM_HUBER_EPS**ghuber_power) * s / ghuber_power

    err_live = _fm_error(v_live.to(dtype), target)
    err_old = _fm_error(v_old.detach().to(dtype), target)
    log_ratio = weighted_logp(err_live) - weighted_logp(err_old)
    ratio = torch.exp(log_ratio)
    loss = _ppo_clip(ratio, adv, clip_low, clip_high).mean()
    metrics = _ratio_metrics(ratio, log_ratio, clip_low, clip_high)
    metrics["fm_error"] = err_live.detach().mean()
    metrics["fm_error_old"] = err_old.mean()
    return loss, metrics


def dgpo_loss(
    v_live: torch.Tensor,
    v_ref: torch.Tensor,
    target: torch.Tensor,
    group_ids: GroupIds,
    advantages: torch.Tensor,
    *,
    beta: float,
    v_old: Optional[torch.Tensor] = None,
    clip_range: Optional[float] = None,
    adv_clip: Optional[float] = None,
    mode: str = "reference",
) -> Tuple[torch.Tensor, Metrics]:
    """Direct Group Preference Optimization: a DPO objective between the positive and negative halves of a group.

    Within a group ``g`` (one prompt's candidates, all noised with the SAME noise at the SAME sigma) the implicit
    reward of sample ``i`` is ``-beta (d_i - d_ref_i)`` (``d = err(v)``, mean over elements). The positive set is
    ``{A_i > 0}``, the negative set ``{A_i < 0}``, each member weighted by ``|A_i| / n_g``; then
    ``R(G+) - R(G-) = -beta / n_g * sum_i A_i (d_i - d_ref_i) = -s_g`` and the group loss is
    ``-log sigmoid(R(G+) - R(G-)) = softplus(s_g)``.

    ``mode="reference"`` (default) is the official code's gradient-equivalent surrogate
    ``mean_i(sg(sigmoid(s_g(i))) A_i d_i)``: it keeps the sigmoid weight constant per group and backpropagates
    through the live error only. With all groups of the same size its gradient is exactly ``1 / beta`` times that
    of ``mode="paper"`` (``mean_g softplus(s_g)``), so the two differ only by a learning-rate factor; the official
    configs (beta 10–5000) are tuned for "reference". Its VALUE is not the NLL: read ``metrics["dpo_loss"]`` for that.

    Optional PPO-style clip against an old policy (official ``clip_dsm``): a sample whose error ratio
    ``exp(d_old - d)`` has left ``(1 - clip_range, ...)`` for ``A <= 0`` or ``(..., 1 + clip_range)`` for ``A > 0``
    contributes its value but no gradient. ``metrics["clip_mask"]`` returns that mask so a KL term can be clipped the
    same way (official ``clip_kl``).

    Args:
        v_live: ``[B, *latent]`` live velocity at ``x_sigma`` (graph). v_ref: same shape, the DGPO reference
            (frozen pretrained, or a fast EMA: official ``use_ema_ref``), detached here.
        target: ``[B, *latent]`` ``noise - x0``; the noise must be shared by every member of a group (and sigma the
            same), otherwise the error differences compare different regression problems.
        group_ids: ``[B]`` int64 tensor or sequence of hashables (prompt ids). Whole groups must be in the call.
        advantages: ``[B]`` group-relative advantages (detached here); the official code relies on them summing to
            ~0 within a group.
        beta: ``> 0`` (official ``beta_dpo``: 100 with a frozen reference, 2000 with an EMA reference).
        v_old: ``[B, *latent]`` old-policy velocity for the clip (detached); needs ``clip_range``.
        clip_range: ``eps > 0`` (official 1e-3 with CFG rollouts, 1e-5 CFG-free); needs ``v_old``.
        adv_clip: if given, advantages are clamped to ``[-adv_clip, adv_clip]`` (official ``adv_clip_max``, 5).
        mode: one of ``DGPO_MODES``.
    Returns:
        ``loss`` 0-d and ``metrics``: ``dpo_loss`` (``mean_g softplus(s_g)``, the paper's NLL), ``preference_margin``
        (``mean_g (R(G+) - R(G-))``), ``preference_accuracy`` (fraction of groups with a positive margin),
        ``group_weight_mean`` (``mean_g sigmoid(s_g)``), ``fm_error``, ``fm_error_ref``, ``clip_fraction`` — 0-d;
        ``clip_mask`` ``[B]`` (1.0 where clipped; all 0 without a clip) — all detached.
    Raises:
        ValueError: unknown ``mode``; ``beta <= 0``; ``clip_range`` / ``v_old`` given alone or ``clip_range <= 0``;
            ``adv_clip <= 0``; shape mismatches or malformed ``group_ids``.
    Source: Luo, Hu, Tang, "Reinforcing Diffusion Models by Direct Group Preference Optimization" (ICLR 2026,
        arXiv 2510.08425); official code Luo-Yihong/DGPO ``scripts/train_sd3_dgpo.py``
        (``compute_group_dgpo_loss_allreduce``, the ``clip_dsm`` branch of the training loop; per-group shared noise
        ``generate_shared_noise_for_groups``; timesteps shared by the whole batch), configs ``config/dgpo*.py``;
        cross-checked with X-GenGroup/Flow-Factory ``trainers/rl/dgpo.py``. The official code divides by the
        configured group size; here ``n_g`` is each group's count in the batch (equal when groups are complete).
    """
    if mode not in DGPO_MODES:
        raise ValueError(f"mode={mode!r} is not one of {DGPO_MODES}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if (v_old is None) != (clip_range is None):
        raise ValueError("v_old and clip_range go together: pass both to clip against the old policy, or neither")
    if clip_range is not None and not clip_range > 0:
        raise ValueError(f"clip_range must be > 0 or None, got {clip_range}")
    if adv_clip is not None and not adv_clip > 0:
        raise ValueError(f"adv_clip must be > 0 or None, got {adv_clip}")
    _check_velocity_like("v_live", v_live, v_ref=v_ref, target=target, v_old=v_old)
    b = v_live.shape[0]
    _check_per_sample("advantages", advantages, b)
    inv, num_groups = _group_ids_to_index(group_ids, b, v_live.device)
    dtype = _dtype(v_live, v_ref, target, advantages)
    tgt = target.to(dtype)
    adv = advantages.detach().to(dtype)
    if adv_clip is not None:
        adv = adv.clamp(-adv_clip, adv_clip)
    d = _fm_error(v_live.to(dtype), tgt)
    d_ref = _fm_error(v_ref.detach().to(dtype), tgt)
    clip_mask = torch.zeros(b, dtype=torch.bool, device=v_live.device)
    if v_old is not None:
        d_old = _fm_error(v_old.detach().to(dtype), tgt)
        ratio = torch.exp(d_old - d.detach())
        clip_mask = torch.where(adv > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
        d = torch.where(clip_mask, d.detach(), d)
    counts = _group_sum(torch.ones(b, dtype=dtype, device=v_live.device), inv, num_groups)
    s_detached = beta * _group_sum(adv * (d.detach() - d_ref), inv, num_groups) / counts  # [G]
    if mode == "reference":
        weight = torch.sigmoid(s_detached)[inv]
        loss = (weight * adv * d).mean()
    else:
        s_graph = beta * _group_sum(adv * (d - d_ref), inv, num_groups) / counts
        loss = torch.nn.functional.softplus(s_graph).mean()
    margin = -s_detached
    metrics = {
        "dpo_loss": torch.nn.functional.softplus(s_detached).mean(),
        "preference_margin": margin.mean(),
        "preference_accuracy": (margin > 0).to(dtype).mean(),
        "group_weight_mean": torch.sigmoid(s_detached).mean(),
        "fm_error": d.detach().mean(),
        "fm_error_ref": d_ref.mean(),
        "clip_fraction": clip_mask.to(dtype).mean(),
        "clip_mask": clip_mask.to(dtype),
    }
    return loss, metrics


def _step_stat(value: Union[float, torch.Tensor], name: str, shape: torch.Size, dtype, device) -> torch.Tensor:
    t = torch.as_tensor(value, device=device).to(dtype)
    if t.ndim == 0:
        return t.expand(shape)
    if t.shape != shape:
        raise ValueError(f"{name} must be a float, a 0-d tensor or the shape of log_prob {list(shape)}, got "
                         f"{list(t.shape)}")
    return t


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
    """GRPO-Guard: FlowGRPO's clipped surrogate with a normalized ratio (RatioNorm) and per-step gradient reweighting.

    With Gaussian steps the per-step log-ratio of one stored sample ``x_next = mu_old + s eps`` is
    ``mean_el((mu - mu_old) eps) / s - mean_el((mu - mu_old)^2) / (2 s^2)``: its mean is negative (the ratio is
    left-shifted, so positive-advantage samples rarely reach ``1 + eps_hi``) and its spread ``~ |mu - mu_old| / s``
    differs across steps. RatioNorm adds back the bias term ``b = mean_el((mu - mu_old)^2) / (2 s^2)`` and scales by
    ``s``: ``log ratio = (logp - logp_old + b) s = mean_el((mu - mu_old) eps)``, centred at 0 with a step-consistent
    scale. ``step_weight="inv_dt"`` then divides each step's surrogate by ``-dt`` to equalize gradients across
    noise levels.

    First update (``log_prob == old_log_prob``, ``mean == old_mean``): ratio 1 and the value is ``-mean(A / -dt)``
    (``-mean(A)`` with ``step_weight="none"``, equal to ``grpo_clip_loss``). The gradient is NOT grpo_clip_loss's:
    the gradient through ``log_prob`` is ``s / (-dt)`` (or ``s``) times it and the bias term contributes none (it is
    quadratic in ``mu - mu_old``). So the update direction per step is FlowGRPO's, rescaled per step.

    Requires the Gaussian log-prob (mean over elements) of the same transition whose ``mean`` / ``std`` are passed:
    kinds "sde" / "dance" (or "cps" with ``cps_log_prob="gaussian"``); with flow_grpo's unnormalized CPS log-prob the
    bias identity does not hold.

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
    Source: Wang et al. 2025, "GRPO-Guard: Mitigating Implicit Over-Optimization in Flow Matching via Regulated
        Clipping" (arXiv 2510.22319; no official code found). Ratio formula: X-GenGroup/Flow-Factory
        ``trainers/rl/grpo.py`` (``GRPOGuardTrainer._guard_ratio``: ``exp(delta_logp * s + mse / (2 s))``) and the
        verl-omni GRPO-Guard page (``docs/algo/grpo_guard.md``: ``exp((delta_logp + b) s)``, identical); the
        ``1 / (-dt)`` step reweighting follows verl-omni (``GRPOGuardLoss``) and the paper's "1/dt gradient
        reweighting"; Flow-Factory's trainer omits it (``step_weight="none"``).
    """
    if step_weight not in GUARD_STEP_WEIGHTS:
        raise ValueError(f"step_weight={step_weight!r} is not one of {GUARD_STEP_WEIGHTS}")
    clip_high = _check_clip(clip_low, clip_high)
    _check_ratio_inputs(log_prob, old_log_prob, advantages, adv_clip)
    if mean.shape != old_mean.shape or mean.ndim <= log_prob.ndim or mean.shape[: log_prob.ndim] != log_prob.shape:
        raise ValueError(
            f"mean and old_mean must share a [{', '.join(['B', 'S'][: log_prob.ndim])}, *latent] shape led by "
            f"log_prob's {list(log_prob.shape)}, got {list(mean.shape)} and {list(old_mean.shape)}"
        )
    if step_weight == "inv_dt" and dt is None:
        raise ValueError("dt is required for step_weight='inv_dt' (pass sigma_next - sigma of each stored step)")
    dtype = _dtype(log_prob, old_log_prob, advantages, mean, old_mean)
    dev = log_prob.device
    s = _step_stat(std, "std", log_prob.shape, dtype, dev)
    if bool((s <= 0).any()):
        raise ValueError("std must be > 0 (a degenerate step has no Gaussian log-prob to normalize)")
    lp = log_prob.to(dtype)
    old = old_log_prob.detach().to(dtype)
    adv = _prepared_advantages(advantages, adv_clip, dtype, lp.ndim)
    sq = (mean.to(dtype) - old_mean.detach().to(dtype)) ** 2
    shift = sq.mean(dim=tuple(range(lp.ndim, sq.ndim))) / (2 * s**2)
    log_ratio = (lp - old + shift) * s
    ratio = torch.exp(log_ratio)
    per = _ppo_clip(ratio, adv, clip_low, clip_high)
    if step_weight == "inv_dt":
        d = _step_stat(dt, "dt", log_prob.shape, dtype, dev)
        if bool((d >= 0).any()):
            raise ValueError("dt must be < 0 (dt = sigma_next - sigma of a denoising step)")
        per = per / (-d)
    loss = per.mean()
    metrics = _ratio_metrics(ratio, log_ratio, clip_low, clip_high)
    metrics["raw_ratio_mean"] = torch.exp(lp.detach() - old).mean()
    metrics["mean_shift"] = shift.detach().mean()
    return loss, metrics


def diffusion_dpo_loss(
    err_live_w: torch.Tensor,
    err_live_l: torch.Tensor,
    err_ref_w: torch.Tensor,
    err_ref_l: torch.Tensor,
    *,
    beta: float,
) -> Tuple[torch.Tensor, Metrics]:
    """Diffusion-DPO loss on per-sample flow-matching errors of chosen (w) / rejected (l) pairs.

    ``z = -beta / 2 * ((err_live_w - err_ref_w) - (err_live_l - err_ref_l))``, ``loss = mean(-log sigmoid(z))``. The
    paper's ``-beta T omega(lambda_t)`` weight is folded into ``beta`` as in the reference code (constant weighting,
    errors averaged over elements), so ``beta`` is large (reference default 5000 for SD1.5 / SDXL eps-prediction;
    Flow-Factory uses 2000 for flow-matching velocity errors). The implicit reward of a sample is
    ``-beta / 2 * (err_live - err_ref)``.

    Args:
        err_live_w, err_live_l: ``[P]`` live-policy errors ``mean_el((v - (noise - x0))^2)`` of the chosen / rejected
            member of each pair (graph). Both members of a pair must be noised with the SAME noise at the SAME sigma.
        err_ref_w, err_ref_l: ``[P]`` the same errors under the frozen reference policy (detached here).
        beta: ``> 0``.
    Returns:
        ``loss`` 0-d, ``metrics``: ``implicit_accuracy`` (fraction with ``z > 0``), ``reward_margin`` (mean ``z``),
        ``reward_chosen`` / ``reward_rejected`` (mean implicit rewards), ``fm_error`` (mean live error over both
        members), ``fm_error_ref`` — 0-d, detached.
    Raises:
        ValueError: ``beta <= 0``; inputs not four tensors of one ``[P]`` shape.
    Source: Wallace et al. 2023, "Diffusion Model Alignment Using Direct Preference Optimization" (arXiv
        2311.12908), eq. 14; reference code SalesforceAIResearch/DiffusionDPO ``train.py`` (``scale_term = -0.5 *
        beta_dpo``, ``inside_term = scale_term * (model_diff - ref_diff)``, ``implicit_acc``); flow-matching online
        variant as X-GenGroup/Flow-Factory ``trainers/rl/dpo.py``.
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    names = ("err_live_w", "err_live_l", "err_ref_w", "err_ref_l")
    tensors = (err_live_w, err_live_l, err_ref_w, err_ref_l)
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor) or t.ndim != 1 or t.shape != err_live_w.shape:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a [P] tensor like err_live_w {tuple(err_live_w.shape)}, got {shape}")
    dtype = _dtype(*tensors)
    lw, ll = err_live_w.to(dtype), err_live_l.to(dtype)
    rw, rl = err_ref_w.detach().to(dtype), err_ref_l.detach().to(dtype)
    reward_w = -0.5 * beta * (lw - rw)
    reward_l = -0.5 * beta * (ll - rl)
    z = reward_w - reward_l
    loss = -torch.nn.functional.logsigmoid(z).mean()
    zd = z.detach()
    metrics = {
        "implicit_accuracy": (zd > 0).to(dtype).mean(),
        "reward_margin": zd.mean(),
        "reward_chosen": reward_w.detach().mean(),
        "reward_rejected": reward_l.detach().mean(),
        "fm_error": 0.5 * (lw.detach().mean() + ll.detach().mean()),
        "fm_error_ref": 0.5 * (rw.mean() + rl.mean()),
    }
    return loss, metrics


def best_worst_pairs(rewards: torch.Tensor, group_ids: GroupIds) -> Tuple[torch.Tensor, torch.Tensor]:
    """One (chosen, rejected) pair per group: its highest- vs lowest-scored sample.

    Ties are broken by the lowest batch index. A group whose scores all tie (including a group of one) yields no
    pair. Advantages work as well as rewards (same order within a group).

    Args:
        rewards: ``[B]`` float scores (or advantages), finite.
        group_ids: ``[B]`` int64 tensor or sequence of hashables (prompt ids).
    Returns:
        ``(chosen_idx, rejected_idx)``: ``[P]`` int64 batch indices, ``P <=`` number of groups, in order of each
        group's first appearance (integer-tensor ids: ascending id).
    Raises:
        ValueError: ``rewards`` not a ``[B]`` float tensor or not finite; malformed ``group_ids``.
    Source: online DPO pair formation as X-GenGroup/Flow-Factory ``trainers/rl/dpo.py`` (best vs worst of a prompt
        group, after advantages).
    """
    if not isinstance(rewards, torch.Tensor) or rewards.ndim != 1 or not rewards.is_floating_point():
        raise ValueError(f"rewards must be a [B] float tensor, got {rewards!r:.80}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite (drop or impute NaN / inf scores before forming pairs)")
    b = rewards.shape[0]
    inv, num_groups = _group_ids_to_index(group_ids, b, rewards.device)
    r = rewards.detach()
    top = torch.full((num_groups,), -math.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, inv, r, "amax")
    bottom = torch.full((num_groups,), math.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, inv, r, "amin")
    idx = torch.arange(b, device=r.device)
    none = torch.full((num_groups,), b, dtype=torch.int64, device=r.device)
    chosen = none.scatter_reduce(0, inv, torch.where(r == top[inv], idx, b), "amin")
    rejected = none.scatter_reduce(0, inv, torch.where(r == bottom[inv], idx, b), "amin")
    keep = top > bottom
    return chosen[keep], rejected[keep]


def cfg_velocity(v_uncond: torch.Tensor, v_cond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Classifier-free guided velocity ``v_u + w (v_c - v_u)`` (``w = 1`` gives ``v_c``).

    Args: ``v_uncond``, ``v_cond`` ``[B, *latent]`` (same shape), ``guidance_scale`` ``w`` (float).
    Returns: ``[B, *latent]`` in the compute dtype (fp32; float64 stays float64).
    Raises: ValueError on shape mismatch.
    Source: Ho & Salimans 2022, "Classifier-Free Diffusion Guidance"; the CFG teacher of CRD's KL term.
    """
    _check_velocity_like("v_cond", v_cond, v_uncond=v_uncond)
    dtype = _dtype(v_uncond, v_cond)
    vu = v_uncond.to(dtype)
    return vu + guidance_scale * (v_cond.to(dtype) - vu)


def crd_loss(
    v_live: torch.Tensor,
    v_old: torch.Tensor,
    target: torch.Tensor,
    group_ids: GroupIds,
    advantages: torch.Tensor,
    *,
    beta: float = 1.0,
    adv_clip: float = 5.0,
    loss_type: str = "mse",
    adaptive: bool = True,
    weight_temp: Optional[float] = None,
    v_teacher: Optional[torch.Tensor] = None,
    kl_beta: float = 0.0,
    reward_adaptive_kl: bool = True,
) -> Tuple[torch.Tensor, Metrics]:
    """Centered Reward Distillation: fit the model's implicit reward, centred within each group, to the external one.

    The implicit reward of sample ``i`` is the drop of its (adaptively normalized) flow-matching error from the old
    snapshot to the live policy, ``r_i = -(err(v_i) / sg(mae_i) - err(v_old_i) / sg(mae_old_i))``. Both ``r`` and the
    external reward ``a = nft_optimality(A, c)`` in [0, 1] are centred within the prompt group (the unknown
    prompt-dependent normalizer cancels), and ``beta * (r - r_bar)`` is regressed onto ``a - a_bar`` (squared error,
    or a BCE with soft labels ``sigmoid(a - a_bar)``), scaled by ``c / beta``. ``weight_temp > 0`` centres twice,
    with ``softmax(+a / tau)`` and ``softmax(-a / tau)`` weights within the group, and averages the two losses.

    With ``v_teacher`` and ``kl_beta > 0`` it adds CRD's KL anchor to the CFG-guided reference (the "distillation"
    toward the teacher, ``cfg_velocity``), reward-adaptive by default: weight ``m + a (1 - m)``, ``m = 1e-4 /
    kl_beta``, so low-reward samples are barely anchored.

    At ``v_live == v_old`` every ``r`` is 0, so the loss is ``c / beta * mean (a - a_bar)^2`` (plus KL) and the
    gradient lowers the error of above-group-mean samples and raises that of below-mean ones.

    Args:
        v_live: ``[B, *latent]`` live velocity at ``x_sigma`` (graph).
        v_old: same shape, the "old" snapshot's velocity on the same input (detached here). CRD keeps this snapshot as
            a slow blend of the live weights (``old_model_decay``); rollouts come from a separate "sampling" snapshot.
        target: ``[B, *latent]`` ``noise - x0`` for the rollout's final latent ``x0``.
        group_ids: ``[B]`` prompt ids (int64 tensor or hashables); whole groups must be in the call. Passing one id for
            the whole batch reproduces Flow-Factory's batch-wide centring.
        advantages: ``[B]`` group-relative advantages (detached here).
        beta: ``> 0`` (``crd_beta``, default 1). adv_clip: ``c > 0`` (default 5).
        loss_type: one of ``CRD_LOSS_TYPES`` (default "mse").
        adaptive: divide each error by its detached mean absolute deviation (``adaptive_logp``, default True).
        weight_temp: None (uniform centring, the recommended default) or ``tau > 0`` (dual-direction softmax).
        v_teacher: ``[B, *latent]`` CFG-guided reference velocity (detached here); needed when ``kl_beta > 0``.
        kl_beta: ``>= 0`` (Flow-Factory default 0.1 with ``kl_cfg`` 4.5). reward_adaptive_kl: see above.
    Returns:
        ``loss`` 0-d (policy + KL) and ``metrics``: ``policy_loss``, ``kl_loss``, ``kl_div`` (mean
        ``velocity_mse_kl`` to the teacher, 0 without one), ``implicit_reward_mean``, ``fm_error``, ``fm_error_old``
        — 0-d, detached.
    Raises:
        ValueError: unknown ``loss_type``; ``beta`` / ``adv_clip`` / ``weight_temp`` not > 0; ``kl_beta < 0``;
            ``kl_beta > 0`` without ``v_teacher``; shape mismatches or malformed ``group_ids``.
    Source: "Diffusion Reinforcement Learning via Centered Reward Distillation" (arXiv 2603.14128); implementation
        X-GenGroup/Flow-Factory ``trainers/rl/crd.py`` (``_implicit_reward``, ``_compute_crd_loss``, ``_kl_loss``,
        the ``adv_clip / beta`` scaling), which states it follows the original CRD code (not found in the index).
        Flow-Factory centres over the whole gathered batch; here centring is within ``group_ids`` groups (the
        paper's "within-prompt centering"). Its ``weight_temp == 0`` hard-selection mode is not implemented.
    """
    if loss_type not in CRD_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not one of {CRD_LOSS_TYPES}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not adv_clip > 0:
        raise ValueError(f"adv_clip must be > 0, got {adv_clip}")
    if weight_temp is not None and not weight_temp > 0:
        raise ValueError(f"weight_temp must be > 0 or None (uniform centring), got {weight_temp}")
    if not kl_beta >= 0:
        raise ValueError(f"kl_beta must be >= 0, got {kl_beta}")
    if kl_beta > 0 and v_teacher is None:
        raise ValueError("kl_beta > 0 needs v_teacher (the CFG-guided reference velocity, see cfg_velocity)")
    _check_velocity_like("v_live", v_live, v_old=v_old, target=target, v_teacher=v_teacher)
    b = v_live.shape[0]
    _check_per_sample("advantages", advantages, b)
    inv, num_groups = _group_ids_to_index(group_ids, b, v_live.device)
    dtype = _dtype(v_live, v_old, target, advantages)
    tgt = target.to(dtype)
    v = v_live.to(dtype)
    vo = v_old.detach().to(dtype)
    err, err_old = _fm_error(v, tgt), _fm_error(vo, tgt)
    if adaptive:
        scale = _el_mean((v.detach() - tgt).abs()).clamp(min=1e-5)
        scale_old = _el_mean((vo - tgt).abs()).clamp(min=1e-5)
        r = -(err / scale - err_old / scale_old)
    else:
        r = -(err - err_old)
    a = (advantages.detach().to(dtype).clamp(-adv_clip, adv_clip) / adv_clip / 2 + 0.5).clamp(0.0, 1.0)

    def centred_loss(p: torch.Tensor) -> torch.Tensor:
        a_bar = _group_sum(p * a, inv, num_groups)[inv]
        r_bar = _group_sum(p * r.detach(), inv, num_groups)[inv]
        rc, rtc = a - a_bar, r - r_bar
        if loss_type == "mse":
            return ((beta * rtc - rc) ** 2).mean()
        return torch.nn.functional.binary_cross_entropy_with_logits(beta * rtc, torch.sigmoid(rc))

    def group_softmax(logits: torch.Tensor) -> torch.Tensor:
        top = torch.full((num_groups,), -math.inf, dtype=dtype, device=v.device).scatter_reduce(0, inv, logits, "amax")
        e = torch.exp(logits - top[inv])
        return e / _group_sum(e, inv, num_groups)[inv]

    if weight_temp is None:
        counts = _group_sum(torch.ones(b, dtype=dtype, device=v.device), inv, num_groups)
        raw = centred_loss(1.0 / counts[inv])
    else:
        raw = 0.5 * centred_loss(group_softmax(a / weight_temp)) + 0.5 * centred_loss(group_softmax(-a / weight_temp))
    policy_loss = raw * adv_clip / beta
    zero = torch.zeros((), dtype=dtype, device=v.device)
    kl_div, kl_loss = zero, zero
    if v_teacher is not None:
        kl = velocity_mse_kl(v, v_teacher.to(dtype))
        kl_div = kl.detach().mean()
        if kl_beta > 0:
            if reward_adaptive_kl:
                m = 1e-4 / kl_beta
                kl_loss = kl_beta * ((m + a * (1 - m)) * kl).mean()
            else:
                kl_loss = kl_beta * kl.mean()
    loss = policy_loss + kl_loss
    metrics = {
        "policy_loss": policy_loss.detach(),
        "kl_loss": kl_loss.detach(),
        "kl_div": kl_div,
        "implicit_reward_mean": r.detach().mean(),
        "fm_error": err.detach().mean(),
        "fm_error_old": err_old.mean(),
    }
    return loss, metrics
