"""Group-relative advantages, multi-component reward combination, and DiffusionNFT's optimality reward.

What
    ``group_advantages`` turns per-sample rewards into advantages relative to the other samples of the same prompt
    (the group). ``group_stats`` reports per-group statistics and degenerate (all-tied) groups.
    ``combine_components`` mixes several reward components. ``clip_advantages`` and ``nft_optimality`` are the two
    post-transforms the losses use.

Why
    GRPO-style methods need no value network: the group mean is the baseline. Dividing by a std makes the update scale
    independent of the reward scale; the ``eps`` keeps a tied (or nearly tied) group finite.

Equations (``g(i)`` = group of sample ``i``; population statistics, i.e. divide by ``n``, not ``n - 1``)::

    mean_g  = mean_{j in g} r_j
    std_g   = sqrt(mean_{j in g} (r_j - mean_g)^2)                  std_mode "group"
    std_B   = sqrt(mean_j (r_j - mean_B)^2)  over the whole batch   std_mode "batch" (flow_grpo ``global_std``)
    A_i     = (r_i - mean_g(i)) / (max(std, std_floor) + eps)       std_mode "group" / "batch"
    A_i     = r_i - mean_g(i)                                       std_mode "none"
    nft r_i = clip(clamp(A_i, -c, c) / c / 2 + 0.5, 0, 1)           DiffusionNFT optimality probability

``eps`` is an additive epsilon (flow_grpo's ``+ 1e-4``), ``std_floor`` a floor; with ``std_floor = 0`` the formula is
exactly flow_grpo's. A group of one sample, or a group whose rewards tie, gets advantage 0 (numerator 0). A group whose
rewards differ by far less than ``eps`` (e.g. ``[0.3, 0.3, 0.3 + 1e-9]``) gets tiny, bounded advantages: ``eps``
dominates the denominator, which is what keeps them bounded by ``|r - mean| / eps``.

Notation
    ==============  ================================================================
    ``B``           samples in the batch = prompts x group size
    ``G``           number of distinct groups
    ``r``           rewards ``[B]``, higher is better
    ``group_ids``   ``[B]`` int64 tensor, or a sequence of hashables (e.g. prompt strings)
    ``A``           advantages ``[B]``
    ``c``           ``adv_clip`` (DiffusionNFT ``adv_clip_max``)
    ==============  ================================================================

Dtypes: float32 (float64 inputs stay float64). No python loop over groups or elements in the math (scatter /
index_add); mapping non-tensor ``group_ids`` to integers is the only per-element python step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Tuple

import torch

from .common import GroupIds, group_index

__all__ = [
    "group_advantages",
    "group_stats",
    "GroupStats",
    "combine_components",
    "clip_advantages",
    "nft_optimality",
    "nft_absolute_optimality",
    "group_guard",
    "STD_MODES",
    "COMBINE_MODES",
]

STD_MODES = ("group", "batch", "none")
COMBINE_MODES = ("weighted_sum", "per_component")

def _as_float(rewards: torch.Tensor, name: str = "rewards") -> torch.Tensor:
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape [B], got {type(rewards).__name__}")
    if rewards.ndim != 1:
        raise ValueError(f"{name} must have shape [B], got {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        raise ValueError(f"{name} must be a float tensor, got {rewards.dtype}")
    return rewards.to(torch.float64 if rewards.dtype == torch.float64 else torch.float32)


def _scatter_mean(values: torch.Tensor, inv: torch.Tensor, num_groups: int, counts: torch.Tensor) -> torch.Tensor:
    sums = torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, inv, values)
    return sums / counts


def _raise_if_nonfinite(r: torch.Tensor, inv: torch.Tensor, labels: Tuple[Any, ...], what: str) -> None:
    bad = ~torch.isfinite(r)
    if bool(bad.any()):
        groups = sorted(set(inv[bad].tolist()))
        names = [labels[g] for g in groups]
        raise ValueError(f"{what} has NaN/inf rewards in group id(s) {names}; rewards must be finite")


def group_advantages(
    rewards: torch.Tensor,
    group_ids: GroupIds,
    *,
    std_mode: str = "group",
    eps: float = 1e-4,
    std_floor: float = 0.0,
) -> torch.Tensor:
    """Group-relative advantages ``(r - mean_group) / (max(std, std_floor) + eps)``.

    Args:
        rewards: ``[B]`` float (fp32; float64 stays float64).
        group_ids: ``[B]`` int64 tensor or a sequence of ``B`` hashables (prompt strings, ...).
        std_mode: "group" (std of the sample's group) | "batch" (std of the whole batch, flow_grpo ``global_std``)
            | "none" (no division: ``A = r - mean_group``; ``eps`` and ``std_floor`` unused).
        eps: additive epsilon in the denominator (``>= 0``); 1e-4 as flow_grpo.
        std_floor: floor on the std before ``eps`` is added (``>= 0``); 0 reproduces flow_grpo.
    Returns:
        ``[B]`` advantages, dtype of the (upcast) rewards. Groups of size one and tied groups give exactly 0.
    Raises:
        ValueError: non-finite reward (names the group ids), bad ``std_mode`` (lists allowed), shape mismatch,
            negative ``eps`` / ``std_floor``, ``eps == std_floor == 0`` with a std mode (division by a zero std).
    Source: flow_grpo ``stat_tracking.PerPromptStatTracker.update`` (type "grpo"); GRPO (DeepSeekMath, Shao et al.
        2024) group normalization.
    """
    if std_mode not in STD_MODES:
        raise ValueError(f"std_mode={std_mode!r} is not one of {STD_MODES}")
    if not (eps >= 0 and std_floor >= 0):
        raise ValueError(f"eps and std_floor must be >= 0, got eps={eps}, std_floor={std_floor}")
    if std_mode != "none" and eps == 0 and std_floor == 0:
        raise ValueError("eps and std_floor are both 0: a tied group would divide 0 by 0; set eps > 0 or std_floor > 0")
    r = _as_float(rewards)
    inv, num_groups, labels = group_index(group_ids, r.shape[0], r.device)
    _raise_if_nonfinite(r, inv, labels, "rewards")
    counts = torch.bincount(inv, minlength=num_groups).to(r.dtype)
    mean_g = _scatter_mean(r, inv, num_groups, counts)
    centered = r - mean_g[inv]
    if std_mode == "none":
        return centered
    if std_mode == "group":
        std = torch.sqrt(_scatter_mean(centered**2, inv, num_groups, counts))[inv]
    else:
        std = r.std(unbiased=False).expand_as(r)
    return centered / (torch.clamp(std, min=std_floor) + eps)


@dataclass(frozen=True)
class GroupStats:
    """Per-group reward statistics (all tensors detached, on the rewards' device)."""

    labels: Tuple[Any, ...]  # G original group ids, in the order of the tensors below
    size: torch.Tensor  # [G] int64 samples per group
    mean: torch.Tensor  # [G] group mean reward
    std: torch.Tensor  # [G] population std
    max: torch.Tensor  # [G] best reward of the group
    min: torch.Tensor  # [G] worst reward of the group
    degenerate: torch.Tensor  # [G] bool, all rewards of the group equal (incl. groups of one): zero advantage
    degenerate_fraction: torch.Tensor  # [] float, fraction of groups that are degenerate


def group_stats(rewards: torch.Tensor, group_ids: GroupIds) -> GroupStats:
    """Per-group statistics and the degenerate-group report (a group whose rewards all tie gives no signal).

    Args / errors as ``group_advantages`` (non-finite rewards raise, naming the group ids).
    Returns: ``GroupStats`` (``[G]`` tensors, detached).
    """
    r = _as_float(rewards).detach()
    inv, num_groups, labels = group_index(group_ids, r.shape[0], r.device)
    _raise_if_nonfinite(r, inv, labels, "rewards")
    size = torch.bincount(inv, minlength=num_groups)
    counts = size.to(r.dtype)
    mean_g = _scatter_mean(r, inv, num_groups, counts)
    std_g = torch.sqrt(_scatter_mean((r - mean_g[inv]) ** 2, inv, num_groups, counts))
    hi = torch.full((num_groups,), -math.inf, dtype=r.dtype, device=r.device).scatter_reduce_(0, inv, r, "amax")
    lo = torch.full((num_groups,), math.inf, dtype=r.dtype, device=r.device).scatter_reduce_(0, inv, r, "amin")
    degenerate = hi == lo
    return GroupStats(
        labels=labels,
        size=size,
        mean=mean_g,
        std=std_g,
        max=hi,
        min=lo,
        degenerate=degenerate,
        degenerate_fraction=degenerate.to(r.dtype).mean(),
    )


def combine_components(
    rewards: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    group_ids: GroupIds,
    *,
    mode: str = "weighted_sum",
    renormalize: bool = False,
    **group_kwargs: Any,
) -> torch.Tensor:
    """Advantages from several reward components.

    mode "weighted_sum": ``A = group_advantages(sum_k w_k r_k)`` (the usual composite reward).
    mode "per_component" (GDPO-style decoupled normalization): ``A = sum_k w_k group_advantages(r_k)``, so a
    component with a large spread cannot drown the others. With ``renormalize=True`` the sum is then normalized over the
    whole batch, ``(A - mean(A)) / (std(A) + eps)`` (as the GDPO paper does); the default False keeps
    ``per_component`` with one unit-weight component identical to ``weighted_sum``.

    Components present in ``rewards`` but absent from ``weights`` (or with weight 0) are ignored; they may hold NaN
    ("not applicable"). A NaN / inf in a component with nonzero weight raises.

    Args:
        rewards: name -> ``[B]`` float tensor. weights: name -> float. group_ids: as ``group_advantages``.
        group_kwargs: ``std_mode``, ``eps``, ``std_floor`` forwarded to ``group_advantages``.
    Returns:
        ``[B]`` advantages.
    Raises:
        ValueError: unknown ``mode`` (allowed listed), a weight naming a missing component (available listed), no
            nonzero weight, shape mismatch, non-finite value in a weighted component (names component and groups).
    Source: weighted sum: flow_grpo multi-reward ``reward_fn`` + ``PerPromptStatTracker``; per-component: GDPO
        (Group reward-Decoupled normalization Policy Optimization, NVIDIA 2025).
    """
    if mode not in COMBINE_MODES:
        raise ValueError(f"mode={mode!r} is not one of {COMBINE_MODES}")
    unknown = sorted(set(weights) - set(rewards))
    if unknown:
        raise ValueError(f"weights name components {unknown} not in rewards; available: {sorted(rewards)}")
    active = [(k, float(w)) for k, w in weights.items() if w != 0]
    if not active:
        raise ValueError(f"no component has a nonzero weight: weights={dict(weights)}")
    comps = {k: _as_float(rewards[k], f"rewards[{k!r}]") for k, _ in active}
    batch = next(iter(comps.values())).shape[0]
    for k, v in comps.items():
        if v.shape[0] != batch:
            raise ValueError(f"component {k!r} has {v.shape[0]} rewards, expected {batch}")
    inv, _, labels = group_index(group_ids, batch, next(iter(comps.values())).device)
    for k, v in comps.items():
        _raise_if_nonfinite(v, inv, labels, f"component {k!r} (weight {dict(active)[k]})")
    if mode == "weighted_sum":
        total = sum(w * comps[k] for k, w in active)
        return group_advantages(total, group_ids, **group_kwargs)
    adv = sum(w * group_advantages(comps[k], group_ids, **group_kwargs) for k, w in active)
    if renormalize:
        eps = group_kwargs.get("eps", 1e-4)
        adv = (adv - adv.mean()) / (adv.std(unbiased=False) + eps)
    return adv


def clip_advantages(advantages: torch.Tensor, clip: float) -> torch.Tensor:
    """``clamp(A, -clip, clip)`` (flow_grpo ``adv_clip_max``). Raises ValueError unless ``clip > 0``."""
    if not clip > 0:
        raise ValueError(f"clip must be > 0, got {clip!r}")
    return advantages.clamp(-clip, clip)


def nft_optimality(advantages: torch.Tensor, adv_clip: float) -> torch.Tensor:
    """DiffusionNFT optimality probability ``r = clip(clamp(A, -c, c) / c / 2 + 0.5, 0, 1)`` in [0, 1].

    Args: advantages ``[B]`` (any shape), ``adv_clip`` = ``c > 0``.
    Returns: same shape, fp32 (float64 stays float64). A = 0 maps to 0.5, A >= c to 1, A <= -c to 0.
    Raises: ValueError unless ``adv_clip > 0``.
    Source: NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py``; DiffusionNFT paper (Zheng et al. 2025), r in [0, 1].
    """
    if not adv_clip > 0:
        raise ValueError(f"adv_clip must be > 0, got {adv_clip!r}")
    a = advantages.to(torch.float64 if advantages.dtype == torch.float64 else torch.float32)
    return torch.clamp(a.clamp(-adv_clip, adv_clip) / adv_clip / 2.0 + 0.5, 0.0, 1.0)


def nft_absolute_optimality(
    scores: torch.Tensor,
    group_ids: GroupIds,
    *,
    adv_clip: float,
    std_floor: float = 0.0,
    std_scope: str = "group",
) -> torch.Tensor:
    """DiffusionNFT's absolute-score reward transform ``r = 0.5 + 0.5 * clip((S - mean_g) / Z, -1, 1)``.

    ``Z = adv_clip * max(std, std_floor)`` with ``std`` the population std of the sample's group
    (``std_scope="group"``) or of the whole scored batch (``"batch"``). Unlike :func:`nft_optimality` of clipped
    advantages there is no additive epsilon: a floor sets the smallest spread that counts as signal. Where
    ``Z == 0`` (a tied group with ``std_floor == 0``) the numerator is 0 too and ``r = 0.5`` (no preference).

    Args:
        scores: ``[B]`` rewards S. group_ids: as :func:`group_advantages`.
        adv_clip: ``c > 0``. std_floor: ``>= 0``. std_scope: "group" | "batch".
    Returns:
        ``[B]`` in [0, 1], dtype of the (upcast) scores.
    Raises:
        ValueError: bad ``adv_clip`` / ``std_floor`` / ``std_scope``; non-finite scores (naming the groups).
    Source: DiffusionNFT (Zheng et al. 2025) optimality probability; the absolute variant replaces the advantage's
        epsilon by a std floor so near-tied groups do not get saturated r (flowforge's variant, as the issue states).
    """
    if not adv_clip > 0:
        raise ValueError(f"adv_clip must be > 0, got {adv_clip!r}")
    if not std_floor >= 0:
        raise ValueError(f"std_floor must be >= 0, got {std_floor!r}")
    if std_scope not in ("group", "batch"):
        raise ValueError(f"std_scope={std_scope!r} is not one of ('group', 'batch')")
    s = _as_float(scores)
    inv, num_groups, labels = group_index(group_ids, s.shape[0], s.device)
    _raise_if_nonfinite(s, inv, labels, "scores")
    counts = torch.bincount(inv, minlength=num_groups).to(s.dtype)
    centered = s - _scatter_mean(s, inv, num_groups, counts)[inv]
    if std_scope == "group":
        std = torch.sqrt(_scatter_mean(centered**2, inv, num_groups, counts))[inv]
    else:
        std = s.std(unbiased=False).expand_as(s)
    z = adv_clip * torch.clamp(std, min=std_floor)
    ratio = torch.where(z > 0, centered / torch.where(z > 0, z, torch.ones_like(z)), torch.zeros_like(z))
    return 0.5 + 0.5 * ratio.clamp(-1.0, 1.0)


def group_guard(
    scores: torch.Tensor,
    group_ids: GroupIds,
    *,
    min_spread: float = 0.0,
    min_best: float | None = None,
) -> torch.Tensor:
    """Which samples to keep when whole uninformative groups are skipped (nothing is re-drawn).

    A group is skipped when all its scores tie, when its spread ``max - min`` is below ``min_spread``, or when its
    best score is below ``min_best`` (if given).

    Args:
        scores: ``[B]``. group_ids: as :func:`group_advantages`. min_spread: ``>= 0``.
    Returns:
        ``[B]`` bool, True = keep (the sample's group passed every test).
    Raises:
        ValueError: negative ``min_spread``; non-finite scores (naming the groups).
    Source: flowforge (a DiffusionNFT training option: the data is kept, the skip is counted in metrics).
    """
    if not min_spread >= 0:
        raise ValueError(f"min_spread must be >= 0, got {min_spread!r}")
    stats = group_stats(scores, group_ids)
    inv, _, _ = group_index(group_ids, stats.size.sum().item(), stats.mean.device)
    keep = ~stats.degenerate & (stats.max - stats.min >= min_spread)
    if min_best is not None:
        keep &= stats.max >= min_best
    return keep[inv]
