"""Differentiable rewards: scorers whose score carries a gradient to the media, and their weighted sum.

A scorer declares ``differentiable = True`` (a class attribute; a bring-your-own scoring function as a function
attribute, ``f.differentiable = True``) when its ``__call__`` is a differentiable function of ``media`` -- no
``argmax``, thresholds, PIL / JPEG round-trips or ``torch.no_grad`` on the way -- so that, called with grad enabled on
media that require grad, ``score.sum().backward()`` reaches the media. Reward-gradient objectives
(``train.algorithm: draft``, :mod:`flowforge.objectives.draft`) need every weighted component to be one; preflight
refuses them otherwise (:func:`non_differentiable`).

:class:`DifferentiableReward` is the seam such an objective gets from the trainer: ``reward_fn(images, prompts,
metadata) -> [B]`` float32, the ``reward.weights``-weighted sum of those components, with gradient.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from flowforge.rewards.base import check_media_batch, takes_video


def is_differentiable(scorer: Any) -> bool:
    """Whether ``scorer`` (an instance, a class or a factory) declares ``differentiable = True``."""
    return getattr(scorer, "differentiable", False) is True


def declares_differentiable(name: str) -> bool:
    """Whether the reward component ``name`` (a built-in name or an import path ``pkg.module:Factory``) declares
    itself differentiable, read from its class / factory without building it (preflight); False for a name that
    does not resolve (preflight names that problem on its own)."""
    from flowforge.rewards.byo import is_import_spec, load_factory
    from flowforge.rewards.registry import SCORERS

    if is_import_spec(name):
        try:
            return is_differentiable(load_factory(name))
        except ValueError:
            return False
    return name in SCORERS and is_differentiable(SCORERS[name])


def non_differentiable(weights: Mapping[str, float]) -> list[str]:
    """The components of ``weights`` with a non-zero weight that do not declare themselves differentiable."""
    return [n for n, w in weights.items() if w != 0 and not declares_differentiable(n)]


class DifferentiableReward:
    """``reward_fn(media, prompts, metadata) -> [B]`` float32: ``sum_k w_k * scorer_k(media, prompts, metadata)``
    over the components with a non-zero weight, computed with gradient to ``media``.

    Images ``[B, 3, H, W]`` in [0, 1]; videos ``[B, 3, F, H, W]`` go whole to scorers that take video and frame by
    frame (the scores averaged per video) to the others, as in :class:`~flowforge.rewards.processor.RewardProcessor`.
    A NaN score ("not applicable") has no gradient to give: it is an error here.

    Args:
        scorers: component name -> scorer (e.g. the reward processor's ``scorers``).
        weights: component name -> weight (``reward.weights``).

    Raises:
        ValueError: a weighted component missing from ``scorers`` or not declaring ``differentiable = True``
            (every such name is listed); on a call, bad media / prompts / metadata, or a NaN score.
    """

    def __init__(self, scorers: Mapping[str, Any], weights: Mapping[str, float]) -> None:
        missing = sorted(n for n in weights if n not in scorers)
        if missing:
            raise ValueError(f"reward.weights names {missing}, which are not among the scorers {sorted(scorers)}")
        self.parts = [(n, scorers[n], float(w)) for n, w in weights.items() if w != 0]
        wrong = [n for n, s, _ in self.parts if not is_differentiable(s)]
        if wrong or not self.parts:
            raise ValueError(f"reward.weights: {wrong or 'no component with a non-zero weight'} cannot give a "
                             "reward gradient; weight only scorers that declare differentiable = True")

    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        b = check_media_batch(media, prompts, metadata)
        total = torch.zeros(b, dtype=torch.float32, device=media.device)
        for name, scorer, weight in self.parts:
            if media.ndim == 5 and not takes_video(scorer):
                f = media.shape[2]
                frames = media.transpose(1, 2).reshape(b * f, *media.shape[1:2], *media.shape[3:])
                score = scorer(frames, [p for p in prompts for _ in range(f)],
                               [m for m in metadata for _ in range(f)]).float().reshape(b, f).mean(1)
            else:
                score = scorer(media, prompts, metadata).float()
            if torch.isnan(score).any():
                raise ValueError(f"reward component {name!r} returned NaN on {int(torch.isnan(score).sum())} of {b} "
                                 "samples: a reward gradient needs a score for every sample")
            total = total + weight * score
        return total
