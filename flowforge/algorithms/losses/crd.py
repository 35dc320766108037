"""Centered Reward Distillation (CRD): fit the model's implicit reward, centred within each group, to the external one.

The implicit reward of sample ``i`` is the drop of its (adaptively normalized) flow-matching error from the old
snapshot to the live policy. Both it and the external reward ``a = nft_optimality(A, c)`` in [0, 1] are centred within
the prompt group (the unknown prompt-dependent normalizer cancels), and ``beta * (r - r_bar)`` is regressed onto ``a -
a_bar`` (squared error, or a BCE with soft labels ``sigmoid(a - a_bar)``), scaled by ``c / beta``. ``weight_temp > 0``
centres twice, with ``softmax(+a / tau)`` and ``softmax(-a / tau)`` weights within the group, and averages the two
losses. With a CFG-guided teacher (``cfg_velocity`` of the reference policy) and ``kl_beta > 0`` it adds CRD's
reward-adaptive KL anchor, so low-reward samples are barely anchored.

Equations (``p`` centring weights within a group: uniform, or softmax(+-a / tau) for the two directions)::

    r_i     = -( err(v_i) / sg(mae_i) - err(v_old_i) / sg(mae_old_i) )      mae = mean_el|v - target| >= 1e-5
    a_i     = clamp(clamp(A_i, -c, c) / c / 2 + 1/2, 0, 1)
    Rc_i    = a_i - sum_{j in g} p_j a_j,   Rt_i = r_i - sg(sum_{j in g} p_j r_j)
    L_pol   = c / beta * mean_i( (beta Rt_i - Rc_i)^2 )                    ("bce": BCE(logit beta Rt, sigmoid Rc))
    L_kl    = kl_beta * mean_i( (m + a_i (1 - m)) * mean_el((v_i - v_teacher_i)^2) ),  m = 1e-4 / kl_beta
    v_teacher = v_u + w (v_c - v_u)     (reference policy, classifier-free guided, ``cfg_velocity``)

At ``v_live == v_old`` every ``r`` is 0, so the loss is ``c / beta * mean (a - a_bar)^2`` (plus KL) and the gradient
lowers the error of above-group-mean samples and raises that of below-mean ones.

Notation
    =============  =================================================================================
    ``err(v)``     per-sample flow-matching error ``mean_el((v - target)^2)``, ``target = noise - x0``
    ``v_old``      the "old" snapshot's velocity (a slow blend of the live weights), a constant
    ``A``, ``c``   group-relative advantages ``[B]``; ``adv_clip``
    ``beta``       reward temperature ``crd_beta``; ``tau`` ``weight_temp``; ``w`` the CFG scale
    ``sg``         stop-gradient; ``mean_el`` mean over all non-batch elements
    =============  =================================================================================

Source: "Diffusion Reinforcement Learning via Centered Reward Distillation" (arXiv 2603.14128); implementation
X-GenGroup/Flow-Factory ``trainers/rl/crd.py`` (``_implicit_reward``, ``_compute_crd_loss``, ``_kl_loss``, the
``adv_clip / beta`` scaling), which states it follows the original CRD code (not found in the index). Flow-Factory
centres over the whole gathered batch; here centring is within ``group_ids`` groups (the paper's "within-prompt
centering"). Its ``weight_temp == 0`` hard-selection mode is not implemented. CFG: Ho & Salimans 2022,
"Classifier-Free Diffusion Guidance".
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch

from ..common import GroupIds, compute_dtype
from ._common import (
    Metrics,
    check_per_sample,
    check_velocity_like,
    el_mean,
    fm_error,
    group_ids_to_index,
    group_sum,
    prepared_advantages,
)
from .nft import velocity_mse_kl

__all__ = ["crd_loss", "cfg_velocity", "CRD_LOSS_TYPES"]

CRD_LOSS_TYPES = ("mse", "bce")


def cfg_velocity(v_uncond: torch.Tensor, v_cond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Classifier-free guided velocity ``v_u + w (v_c - v_u)`` (``w = 1`` gives ``v_c``).

    Args: ``v_uncond``, ``v_cond`` ``[B, *latent]`` (same shape), ``guidance_scale`` ``w`` (float).
    Returns: ``[B, *latent]`` in the compute dtype (fp32; float64 stays float64).
    Raises: ValueError on shape mismatch.
    Source: Ho & Salimans 2022, "Classifier-Free Diffusion Guidance"; the CFG teacher of CRD's KL term.
    """
    check_velocity_like("v_cond", v_cond, v_uncond=v_uncond)
    dtype = compute_dtype(v_uncond, v_cond)
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
    """Centered Reward Distillation loss, policy term + optional KL anchor (equations in the module docstring).

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
        kl_beta: ``>= 0`` (Flow-Factory default 0.1 with ``kl_cfg`` 4.5). reward_adaptive_kl: KL weight ``m + a (1 -
            m)`` (default) instead of 1.
    Returns:
        ``loss`` 0-d (policy + KL) and ``metrics``: ``policy_loss``, ``kl_loss``, ``kl_div`` (mean
        ``velocity_mse_kl`` to the teacher, 0 without one), ``implicit_reward_mean``, ``fm_error``, ``fm_error_old``
        — 0-d, detached.
    Raises:
        ValueError: unknown ``loss_type``; ``beta`` / ``adv_clip`` / ``weight_temp`` not > 0; ``kl_beta < 0``;
            ``kl_beta > 0`` without ``v_teacher``; shape mismatches or malformed ``group_ids``.
    Source: arXiv 2603.14128; X-GenGroup/Flow-Factory ``trainers/rl/crd.py`` (details in the module docstring).
    """
    _check_crd_args(loss_type, beta, adv_clip, weight_temp, kl_beta, v_teacher)
    check_velocity_like("v_live", v_live, v_old=v_old, target=target, v_teacher=v_teacher)
    b = v_live.shape[0]
    check_per_sample("advantages", advantages, b)
    inv, num_groups = group_ids_to_index(group_ids, b, v_live.device)
    dtype = compute_dtype(v_live, v_old, target, advantages)
    tgt = target.to(dtype)
    v = v_live.to(dtype)
    r, err, err_old = _implicit_reward(v, v_old.detach().to(dtype), tgt, adaptive)
    a = (prepared_advantages(advantages, adv_clip, dtype, 1) / adv_clip / 2 + 0.5).clamp(0.0, 1.0)
    centred_loss = functools.partial(_centred_loss, a=a, r=r, inv=inv, num_groups=num_groups, beta=beta,
                                     loss_type=loss_type)
    if weight_temp is None:
        counts = group_sum(torch.ones(b, dtype=dtype, device=v.device), inv, num_groups)
        raw = centred_loss(1.0 / counts[inv])
    else:
        up, down = (_group_softmax(logits, inv, num_groups) for logits in (a / weight_temp, -a / weight_temp))
        raw = 0.5 * centred_loss(up) + 0.5 * centred_loss(down)
    policy_loss = raw * adv_clip / beta
    kl_div, kl_loss = _kl_anchor(v, v_teacher, a, kl_beta, reward_adaptive_kl)
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


def _check_crd_args(loss_type: str, beta: float, adv_clip: float, weight_temp: Optional[float], kl_beta: float,
                    v_teacher: Optional[torch.Tensor]) -> None:
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


def _implicit_reward(v: torch.Tensor, vo: torch.Tensor, tgt: torch.Tensor,
                     adaptive: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(r, err, err_old)`` ``[B]`` each: the implicit reward (graph through ``v``) and the two errors."""
    err, err_old = fm_error(v, tgt), fm_error(vo, tgt)
    if adaptive:
        scale = el_mean((v.detach() - tgt).abs()).clamp(min=1e-5)
        scale_old = el_mean((vo - tgt).abs()).clamp(min=1e-5)
        return -(err / scale - err_old / scale_old), err, err_old
    return -(err - err_old), err, err_old


def _centred_loss(p: torch.Tensor, a: torch.Tensor, r: torch.Tensor, inv: torch.Tensor, num_groups: int, beta: float,
                  loss_type: str) -> torch.Tensor:
    """The unscaled policy loss with centring weights ``p`` ``[B]`` (each group's weights sum to 1): 0-d."""
    a_bar = group_sum(p * a, inv, num_groups)[inv]
    r_bar = group_sum(p * r.detach(), inv, num_groups)[inv]
    rc, rtc = a - a_bar, r - r_bar
    if loss_type == "mse":
        return ((beta * rtc - rc) ** 2).mean()
    return torch.nn.functional.binary_cross_entropy_with_logits(beta * rtc, torch.sigmoid(rc))


def _group_softmax(logits: torch.Tensor, inv: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Softmax of ``logits`` ``[B]`` within each group (max-subtracted for stability): ``[B]``."""
    top = torch.full((num_groups,), -math.inf, dtype=logits.dtype, device=logits.device).scatter_reduce(
        0, inv, logits, "amax")
    e = torch.exp(logits - top[inv])
    return e / group_sum(e, inv, num_groups)[inv]


def _kl_anchor(v: torch.Tensor, v_teacher: Optional[torch.Tensor], a: torch.Tensor, kl_beta: float,
               reward_adaptive_kl: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(kl_div, kl_loss)`` 0-d: mean velocity KL to the teacher (detached) and its weighted loss (0 without)."""
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    if v_teacher is None:
        return zero, zero
    kl = velocity_mse_kl(v, v_teacher.to(v.dtype))
    kl_div = kl.detach().mean()
    if not kl_beta > 0:
        return kl_div, zero
    if reward_adaptive_kl:
        m = 1e-4 / kl_beta
        return kl_div, kl_beta * ((m + a * (1 - m)) * kl).mean()
    return kl_div, kl_beta * kl.mean()
