"""Online Diffusion-DPO: DPO on per-sample flow-matching errors of (chosen, rejected) pairs from a prompt group.

Equations (pairs (w, l) share noise and sigma; ``err = mean_el((v - (noise - x0))^2)``; beta absorbs the paper's
``T * omega(lambda)``)::

    z       = -beta / 2 * ((err_w - err_ref_w) - (err_l - err_ref_l))
    L       = mean( -log sigmoid(z) )
    reward  = -beta / 2 * (err - err_ref)             implicit reward of one sample

Pairs: one per prompt group, its highest- vs lowest-scored sample (``best_worst_pairs``).

Notation
    =============  =================================================================================
    ``w``, ``l``   the chosen (winner) and rejected (loser) member of a pair; ``P`` pairs
    ``err_ref``    the same error under the frozen reference policy, a constant
    ``beta``       preference temperature, ``> 0`` (large: it absorbs the paper's weighting)
    ``mean_el``    mean over all non-batch elements
    =============  =================================================================================

Source: Wallace et al. 2023, "Diffusion Model Alignment Using Direct Preference Optimization" (arXiv 2311.12908),
eq. 14; reference implementation SalesforceAIResearch/DiffusionDPO ``train.py``; flow-matching online variant and
pair formation as X-GenGroup/Flow-Factory ``trainers/rl/dpo.py``.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

from ..common import GroupIds, compute_dtype
from ._common import Metrics, group_ids_to_index

__all__ = ["diffusion_dpo_loss", "best_worst_pairs"]


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
    dtype = compute_dtype(*tensors)
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
    inv, num_groups = group_ids_to_index(group_ids, b, rewards.device)
    r = rewards.detach()
    top = torch.full((num_groups,), -math.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, inv, r, "amax")
    bottom = torch.full((num_groups,), math.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, inv, r, "amin")
    idx = torch.arange(b, device=r.device)
    none = torch.full((num_groups,), b, dtype=torch.int64, device=r.device)
    chosen = none.scatter_reduce(0, inv, torch.where(r == top[inv], idx, b), "amin")
    rejected = none.scatter_reduce(0, inv, torch.where(r == bottom[inv], idx, b), "amin")
    keep = top > bottom
    return chosen[keep], rejected[keep]
