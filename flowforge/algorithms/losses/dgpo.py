"""Direct Group Preference Optimization (DGPO): a DPO objective between the positive and negative halves of a group.

Within a group ``g`` (one prompt's candidates, all noised with the SAME noise at the SAME sigma) the implicit reward
of sample ``i`` is ``-beta (d_i - d_ref_i)`` (``d = err(v)``, mean over elements). The positive set is ``{A_i > 0}``,
the negative set ``{A_i < 0}``, each member weighted by ``|A_i| / n_g``; then ``R(G+) - R(G-) = -beta / n_g * sum_i
A_i (d_i - d_ref_i) = -s_g`` and the group loss is ``-log sigmoid(R(G+) - R(G-)) = softplus(s_g)``.

Equations (``d_i = err(v_i)``, ``d_ref_i = err(v_ref_i)``, ``err(v) = mean_el((v - (noise - x0))^2)``)::

    s_g     = beta / n_g * sum_{i in g} A_i (d_i - d_ref_i)          = -(R(G+) - R(G-))
    paper:      L = mean_g( -log sigmoid(-s_g) )                     = mean_g softplus(s_g)
    reference:  L = mean_i( sg(sigmoid(s_g(i))) * A_i * d_i )         same gradient / beta (groups of equal n)
    optional clip (v_old): d_i -> sg(d_i) where A_i > 0 and exp(d_old_i - d_i) > 1 + eps,
                           or A_i <= 0 and exp(d_old_i - d_i) < 1 - eps

``mode="reference"`` (default) is the official code's gradient-equivalent surrogate: it keeps the sigmoid weight
constant per group and backpropagates through the live error only. With all groups of the same size its gradient is
exactly ``1 / beta`` times that of ``mode="paper"``, so the two differ only by a learning-rate factor; the official
configs (beta 10–5000) are tuned for "reference". Its VALUE is not the NLL: read ``metrics["dpo_loss"]`` for that.
The optional clip against an old policy (official ``clip_dsm``) keeps a clipped sample's value but not its gradient;
``metrics["clip_mask"]`` returns the mask so a KL term can be clipped the same way (official ``clip_kl``).

Notation
    =============  =================================================================================
    ``g``, ``n_g`` group (same prompt, shared noise and sigma) and its count in the batch
    ``A``          group-relative advantages ``[B]``; ``beta`` the preference temperature
    ``v_ref``      DGPO reference velocity (frozen pretrained or a fast EMA); ``v_old`` the old policy's
    ``sg``         stop-gradient; ``mean_el`` mean over all non-batch elements; ``eps`` ``clip_range``
    =============  =================================================================================

Source: Luo, Hu, Tang, "Reinforcing Diffusion Models by Direct Group Preference Optimization" (ICLR 2026, arXiv
2510.08425); official implementation Luo-Yihong/DGPO ``scripts/train_sd3_dgpo.py``
(``compute_group_dgpo_loss_allreduce``, the ``clip_dsm`` branch of the training loop; per-group shared noise
``generate_shared_noise_for_groups``; timesteps shared by the whole batch), configs ``config/dgpo*.py``;
cross-checked with X-GenGroup/Flow-Factory ``trainers/rl/dgpo.py``. The official code divides by the configured group
size; here ``n_g`` is each group's count in the batch (equal when groups are complete).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..common import GroupIds, compute_dtype
from ._common import (
    Metrics,
    check_adv_clip,
    check_per_sample,
    check_velocity_like,
    fm_error,
    group_ids_to_index,
    group_sum,
    prepared_advantages,
)

__all__ = ["dgpo_loss", "DGPO_MODES"]

DGPO_MODES = ("reference", "paper")


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
    """Direct Group Preference Optimization (equations and modes in the module docstring).

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
    Source: Luo, Hu, Tang 2025 (arXiv 2510.08425); Luo-Yihong/DGPO ``scripts/train_sd3_dgpo.py``.
    """
    _check_dgpo_args(mode, beta, v_old, clip_range, adv_clip)
    check_velocity_like("v_live", v_live, v_ref=v_ref, target=target, v_old=v_old)
    b = v_live.shape[0]
    check_per_sample("advantages", advantages, b)
    inv, num_groups = group_ids_to_index(group_ids, b, v_live.device)
    dtype = compute_dtype(v_live, v_ref, target, advantages)
    tgt = target.to(dtype)
    adv = prepared_advantages(advantages, adv_clip, dtype, 1)
    d = fm_error(v_live.to(dtype), tgt)
    d_ref = fm_error(v_ref.detach().to(dtype), tgt)
    clip_mask = torch.zeros(b, dtype=torch.bool, device=v_live.device)
    if v_old is not None:
        d_old = fm_error(v_old.detach().to(dtype), tgt)
        ratio = torch.exp(d_old - d.detach())
        clip_mask = torch.where(adv > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
        d = torch.where(clip_mask, d.detach(), d)
    counts = group_sum(torch.ones(b, dtype=dtype, device=v_live.device), inv, num_groups)
    s_detached = beta * group_sum(adv * (d.detach() - d_ref), inv, num_groups) / counts  # [G]
    if mode == "reference":
        weight = torch.sigmoid(s_detached)[inv]
        loss = (weight * adv * d).mean()
    else:
        s_graph = beta * group_sum(adv * (d - d_ref), inv, num_groups) / counts
        loss = torch.nn.functional.softplus(s_graph).mean()
    return loss, _dgpo_metrics(s_detached, d, d_ref, clip_mask)


def _check_dgpo_args(mode: str, beta: float, v_old: Optional[torch.Tensor], clip_range: Optional[float],
                     adv_clip: Optional[float]) -> None:
    if mode not in DGPO_MODES:
        raise ValueError(f"mode={mode!r} is not one of {DGPO_MODES}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if (v_old is None) != (clip_range is None):
        raise ValueError("v_old and clip_range go together: pass both to clip against the old policy, or neither")
    if clip_range is not None and not clip_range > 0:
        raise ValueError(f"clip_range must be > 0 or None, got {clip_range}")
    check_adv_clip(adv_clip)


def _dgpo_metrics(s_detached: torch.Tensor, d: torch.Tensor, d_ref: torch.Tensor, clip_mask: torch.Tensor) -> Metrics:
    """``dgpo_loss``'s metrics from the per-group ``s_g`` ``[G]``, the errors ``[B]`` and the clip mask ``[B]``."""
    dtype = d.dtype
    margin = -s_detached
    return {
        "dpo_loss": torch.nn.functional.softplus(s_detached).mean(),
        "preference_margin": margin.mean(),
        "preference_accuracy": (margin > 0).to(dtype).mean(),
        "group_weight_mean": torch.sigmoid(s_detached).mean(),
        "fm_error": d.detach().mean(),
        "fm_error_ref": d_ref.mean(),
        "clip_fraction": clip_mask.to(dtype).mean(),
        "clip_mask": clip_mask.to(dtype),
    }
