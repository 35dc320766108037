"""Pieces shared by the losses, each defined once: input checks, advantage preparation, the PPO clip and its ratio
metrics, element means, the equal-std Gaussian KL of a transition, prompt-group sums.

Conventions (all losses): computed in float32 whatever the input dtype, float64 inputs stay float64
(``compute_dtype``); "mean over elements" is the mean over every non-batch (and non-step) dimension; metrics are
detached 0-d tensors unless a docstring says otherwise.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch

from ..common import GroupIds, group_index, per_sample

Metrics = Dict[str, torch.Tensor]


def el_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean over all non-batch dims: ``[B, ...] -> [B]`` (a ``[B]`` tensor is returned as is)."""
    return t.mean(dim=tuple(range(1, t.ndim))) if t.ndim > 1 else t


def fm_error(v: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample flow-matching error ``mean_el((v - target)^2)``: ``[B]``."""
    return el_mean((v - target) ** 2)


def check_clip(clip_low: float, clip_high: Optional[float]) -> float:
    """Validate the PPO band ``[1 - clip_low, 1 + clip_high]``; returns ``clip_high`` (default ``clip_low``)."""
    clip_high = clip_low if clip_high is None else clip_high
    if not (clip_low > 0 and clip_high > 0):
        raise ValueError(f"clip_low and clip_high must be > 0, got {clip_low}, {clip_high}")
    return clip_high


def check_adv_clip(adv_clip: Optional[float]) -> None:
    if adv_clip is not None and not adv_clip > 0:
        raise ValueError(f"adv_clip must be > 0 or None, got {adv_clip}")


def check_ratio_inputs(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                       adv_clip: Optional[float]) -> None:
    """Shapes shared by the ratio losses: log-probs ``[B]`` or ``[B, S]``, advantages ``[B]`` or alike."""
    check_adv_clip(adv_clip)
    if log_prob.shape != old_log_prob.shape or log_prob.ndim not in (1, 2):
        raise ValueError(
            f"log_prob and old_log_prob must share a [B] or [B, S] shape, got {tuple(log_prob.shape)} and "
            f"{tuple(old_log_prob.shape)}"
        )
    if advantages.shape != log_prob.shape and advantages.shape != log_prob.shape[:1]:
        raise ValueError(
            f"advantages must be [B]={list(log_prob.shape[:1])} or {list(log_prob.shape)}, got {list(advantages.shape)}"
        )


def check_step_means(mean: torch.Tensor, old_mean: torch.Tensor, log_prob: torch.Tensor) -> None:
    """Transition means ``[B, *latent]`` (for ``[B]`` log-probs) or ``[B, S, *latent]`` (for ``[B, S]``)."""
    if mean.shape != old_mean.shape or mean.ndim <= log_prob.ndim or mean.shape[: log_prob.ndim] != log_prob.shape:
        raise ValueError(
            f"mean and old_mean must share a [{', '.join(['B', 'S'][: log_prob.ndim])}, *latent] shape led by "
            f"log_prob's {list(log_prob.shape)}, got {list(mean.shape)} and {list(old_mean.shape)}"
        )


def check_velocity_like(ref_name: str, ref: torch.Tensor, **others: Optional[torch.Tensor]) -> None:
    """``ref`` is ``[B, *latent]`` and every non-None tensor in ``others`` has its shape."""
    if ref.ndim < 2:
        raise ValueError(f"{ref_name} must be [B, *latent] (at least 2-d), got {tuple(ref.shape)}")
    for name, t in others.items():
        if t is not None and t.shape != ref.shape:
            raise ValueError(f"{name} must have the shape of {ref_name} {tuple(ref.shape)}, got {tuple(t.shape)}")


def check_per_sample(name: str, t: torch.Tensor, batch: int) -> None:
    if not isinstance(t, torch.Tensor) or t.shape != (batch,):
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a tensor of shape [B]=[{batch}], got {shape}")


def step_stat(value: Union[float, torch.Tensor], name: str, log_prob: torch.Tensor,
              dtype: torch.dtype) -> torch.Tensor:
    """A float / 0-d / ``log_prob``-shaped per-step quantity (``std``, ``dt``) as a tensor of ``log_prob``'s shape."""
    return per_sample(value, name, log_prob.shape, dtype, log_prob.device, shape_label="of log_prob")


def positive_step_std(std: Union[float, torch.Tensor], log_prob: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The transition std per stored step, shape of ``log_prob``; raises ValueError unless ``> 0`` everywhere."""
    s = step_stat(std, "std", log_prob, dtype)
    if bool((s <= 0).any()):
        raise ValueError("std must be > 0 (a degenerate step has no Gaussian log-prob to normalize)")
    return s


def gaussian_mean_kl(mean: torch.Tensor, old_mean: torch.Tensor, std: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``KL(N(mean, std^2) || N(old_mean, std^2))`` per element, mean over elements: ``mean_el((mean - old)^2) /
    (2 std^2)``.

    ``std`` (``[B]`` or ``[B, S]``) gives the leading dims kept; ``old_mean`` is detached. The KL of two Gaussians of
    equal std is symmetric, so this is also ``KL(old || new)``.
    """
    sq = (mean.to(dtype) - old_mean.detach().to(dtype)) ** 2
    return sq.mean(dim=tuple(range(std.ndim, sq.ndim))) / (2 * std**2)


def prepared_advantages(advantages: torch.Tensor, adv_clip: Optional[float], dtype: torch.dtype,
                        ndim: int) -> torch.Tensor:
    """Detached advantages in ``dtype``, clamped to ``±adv_clip`` if given, broadcast to ``ndim`` dims."""
    adv = advantages.detach().to(dtype)
    if adv_clip is not None:
        adv = adv.clamp(-adv_clip, adv_clip)
    return adv[:, None] if adv.ndim < ndim else adv


def ppo_clip(ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    """Elementwise PPO surrogate ``max(-A ratio, -A clamp(ratio, 1 - lo, 1 + hi))`` (not reduced)."""
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high))


def ratio_metrics(ratio: torch.Tensor, log_ratio: torch.Tensor, clip_low: Optional[float] = None,
                  clip_high: Optional[float] = None) -> Metrics:
    """``ratio_mean``, ``ratio_std`` (population), ``ratio_min``, ``ratio_max``, ``clip_fraction`` (only with a clip
    band: fraction outside ``[1 - clip_low, 1 + clip_high]``), ``approx_kl`` (``0.5 mean log_ratio^2``); detached."""
    r = ratio.detach()
    metrics = {"ratio_mean": r.mean(), "ratio_std": r.std(unbiased=False), "ratio_min": r.min(), "ratio_max": r.max()}
    if clip_low is not None:
        metrics["clip_fraction"] = ((r - 1.0 > clip_high) | (1.0 - r > clip_low)).to(r.dtype).mean()
    metrics["approx_kl"] = 0.5 * (log_ratio.detach() ** 2).mean()
    return metrics


def group_ids_to_index(group_ids: GroupIds, batch: int, device: torch.device) -> Tuple[torch.Tensor, int]:
    """``(inverse [B] int64, number of groups)`` (see ``common.group_index``)."""
    inv, num_groups, _ = group_index(group_ids, batch, device)
    return inv, num_groups


def group_sum(values: torch.Tensor, inv: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per-group sums ``[G]`` of ``values`` ``[B]``."""
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add(0, inv, values)
