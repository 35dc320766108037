"""Anchor losses on real data: keep a post-trained world model a model of the world.

RL on a generated reward can drift a world model away from the game it models (it learns to please the reward
rather than to predict). The anchors add supervised terms on a stream of **real** clips to every optimizer step::

    L = L_RL + lambda_fm * L_FM_real + lambda_trans * L_trans_real [+ lambda_ref * L_ref_real]

==================  ===================================================================================================
term                definition (per real clip, then the mean over the clips)
==================  ===================================================================================================
``L_FM_real``       flow-matching MSE ``mean_el((v(x_sigma, sigma) - (noise - x0))^2)`` over the *generated* elements
                    only (the condition slot, latent frame 0, is excluded: it is pinned to the clean first frame).
                    ``sigma`` is drawn per clip by the caller's own sampler, separate from the rollout's ``T``-step
                    sampling schedule: the world-model anchor draws it as the SFT did
                    (:func:`~flowforge.algorithms.schedules.sample_sigmas`, logit-normal); :func:`training_sigmas`
                    / :func:`draw_training_sigmas` draw from a discrete ``N``-sigma training schedule instead
``L_trans_real``    cross-entropy of the transition predictor's logits ``[B, f - 1, M, K]`` against the frozen
                    tokenizer's codes ``[B, f - 1, M]`` of the real clip's adjacent frames
``L_ref_real``      velocity MSE to the immutable reference (SFT) policy at the same ``x_sigma`` (default weight 0)
==================  ===================================================================================================

Sources: flow matching, Lipman et al. 2023 ("Flow Matching for Generative Modeling"), Esser et al. 2024 (SD3's
uniform-timestep training schedule of 1000 sigmas); the discrete transition labels follow the latent-action tokenizer
of Genie (Bruce et al., ICML 2024); the velocity-MSE reference penalty is DiffusionNFT's KL surrogate (Zheng et al.
2025). All computed in float32 (float64 stays float64); metrics are detached 0-d tensors.
"""

from __future__ import annotations

from typing import Mapping, Optional, Tuple

import torch

from ..schedules import flow_match_sigmas
from ._common import Metrics, el_mean

__all__ = ["training_sigmas", "draw_training_sigmas", "noised", "row_weights", "anchor_fm_loss", "transition_ce_loss",
           "combine_anchor_terms"]


def training_sigmas(num_train_timesteps: int = 1000, shift: float = 1.0) -> torch.Tensor:
    """The anchor's training schedule: ``[N]`` float32 sigmas, descending from 1 to ``shift(1 / N)`` (the
    static-shift schedule of :func:`~flowforge.algorithms.schedules.flow_match_sigmas` with ``N`` steps, without
    its terminal 0: a training sigma is never exactly 0).

    Raises:
        ValueError: as :func:`~flowforge.algorithms.schedules.flow_match_sigmas` (``N < 1``, ``shift <= 0``).
    """
    return flow_match_sigmas(num_train_timesteps, shift)[:-1]


def draw_training_sigmas(schedule: torch.Tensor, batch: int, generator: torch.Generator) -> torch.Tensor:
    """``[batch]`` sigmas, each ``schedule[j]`` with ``j`` uniform in ``[0, N)`` drawn from ``generator`` (CPU)."""
    index = torch.randint(0, schedule.shape[0], (batch,), generator=generator)
    return schedule[index]


def noised(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``x_sigma = (1 - sigma) x0 + sigma noise`` for ``x0, noise [B, ...]`` and ``sigma [B]``."""
    s = sigma.to(x0.dtype).reshape(-1, *([1] * (x0.ndim - 1)))
    return (1.0 - s) * x0 + s * noise


def _dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def row_weights(height: int, rows: int, weight: float) -> torch.Tensor:
    """Per-row loss weights ``[height]`` float32: ``weight`` on the last ``rows`` rows, 1 elsewhere, divided by
    their mean (so the loss keeps its scale). A per-pixel weight leaves each pixel's regression target, and so the
    flow-matching minimiser ``E[noise - x0 | x_sigma]``, unchanged; it only moves the finite model's effort towards
    the weighted rows (the world SFT's paddle rows: ~0.4 % of a Breakout frame's pixels carry the action).

    Raises:
        ValueError: ``rows`` not in ``[0, height]`` or ``weight <= 0``.
    """
    if not 0 <= rows <= height or weight <= 0:
        raise ValueError(f"need 0 <= rows <= height={height} and weight > 0, got rows={rows}, weight={weight}")
    w = torch.ones(height, dtype=torch.float32)
    if rows:
        w[height - rows:] = float(weight)
    return w / w.mean()


def anchor_fm_loss(v: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor,
                   weight: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Metrics]:
    """Flow-matching MSE of real clips over the generated elements.

    Args:
        v: ``[B, *generated]`` predicted velocity (``noise - x0`` convention) on the generated elements only (the
            caller slices the condition slot off, e.g. ``[B, C, F - 1, H, W]`` for a world model).
        x0: ``[B, *generated]`` clean real latents. noise: ``[B, *generated]`` the noise ``x_sigma`` was made with.
        weight: optional per-element weights broadcastable to ``v`` (e.g. :func:`row_weights` viewed as
            ``[1, 1, 1, H, 1]``); None weighs every element 1.

    Returns:
        ``(loss, metrics)``: the mean over clips of ``mean_el(weight * (v - (noise - x0))^2)`` (0-d); metrics
        ``fm_loss_max`` (the worst clip's error).

    Raises:
        ValueError: shapes differ, no batch dimension, or ``weight`` does not broadcast to ``v``.
    """
    if v.shape != x0.shape or v.shape != noise.shape or v.ndim < 2:
        raise ValueError(f"v, x0 and noise must share a [B, ...] shape, got {tuple(v.shape)}, {tuple(x0.shape)}, "
                         f"{tuple(noise.shape)}")
    dt = _dtype(v)
    err = (v.to(dt) - (noise.to(dt) - x0.to(dt))) ** 2
    if weight is not None:
        try:
            fits = torch.broadcast_shapes(weight.shape, v.shape) == v.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"weight {tuple(weight.shape)} does not broadcast to {tuple(v.shape)}")
        err = err * weight.to(device=err.device, dtype=dt)
    per_clip = el_mean(err)
    return per_clip.mean(), {"fm_loss_max": per_clip.detach().max()}


def transition_ce_loss(logits: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, Metrics]:
    """Cross-entropy of transition-code logits against the tokenizer's labels.

    Args:
        logits: ``[B, T, M, K]`` (``T = f - 1`` transitions, ``M`` state tokens, ``K`` codes).
        labels: ``[B, T, M]`` int64 in ``[0, K)``.

    Returns:
        ``(loss, metrics)``: the mean cross-entropy over every (clip, transition, token), in nats; metrics
        ``trans_accuracy`` (fraction of argmax == label).

    Raises:
        ValueError: shapes that do not fit; labels outside ``[0, K)``.
    """
    if logits.ndim != 4 or labels.shape != logits.shape[:3]:
        raise ValueError(f"logits must be [B, T, M, K] and labels [B, T, M], got {tuple(logits.shape)} and "
                         f"{tuple(labels.shape)}")
    k = logits.shape[-1]
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= k):
        raise ValueError(f"labels must lie in [0, {k}), got [{int(labels.min())}, {int(labels.max())}]")
    flat = logits.to(_dtype(logits)).reshape(-1, k)
    loss = torch.nn.functional.cross_entropy(flat, labels.reshape(-1).long())
    accuracy = (flat.detach().argmax(-1) == labels.reshape(-1)).float().mean()
    return loss, {"trans_accuracy": accuracy}


def combine_anchor_terms(terms: Mapping[str, Optional[torch.Tensor]],
                         weights: Mapping[str, float]) -> Tuple[torch.Tensor, Metrics]:
    """``sum_k weights[k] * terms[k]`` over the terms that are present (not ``None``) with a weight > 0.

    Args:
        terms: name -> 0-d loss, or ``None`` for a term that is not computed (weight 0, or no gradient path to any
            trained parameter).
        weights: name -> weight ``>= 0`` (every key of ``terms`` needs one).

    Returns:
        ``(loss, metrics)``: the weighted sum (0-d, 0 when nothing is present) and ``<name>`` = each present term's
        detached value.

    Raises:
        ValueError: a term without a weight, or a negative weight.
    """
    missing = sorted(set(terms) - set(weights))
    if missing or any(w < 0 for w in weights.values()):
        raise ValueError(f"every anchor term needs a weight >= 0; missing {missing}, weights {dict(weights)}")
    present = {k: t for k, t in terms.items() if t is not None and weights[k] > 0}
    if not present:
        return torch.zeros(()), {}
    loss = sum(weights[k] * t for k, t in present.items())
    return loss, {k: t.detach() for k, t in present.items()}
