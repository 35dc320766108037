"""CLIP score: text-image agreement of a CLIP model, in one of three published forms.

    cosine      r = cos(f_I(x), f_T(p))                 in [-1, 1]
    clipscore   r = 2.5 * max(cos(f_I(x), f_T(p)), 0)
    flow_grpo   r = s * cos(f_I(x), f_T(p)) / 30

Notation as in :mod:`flowforge.rewards.scorers.clip_common` (``s = logit_scale.exp()``).

Source: Radford et al., "Learning Transferable Visual Models From Natural Language Supervision" (CLIP), 2021;
Hessel et al., "CLIPScore", EMNLP 2021 (``2.5 * max(cos, 0)``); flow_grpo's ``flow_grpo/clip_scorer.py``
(``logits_per_image.diagonal() / 30`` = ``s * cos / 30``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from flowforge.rewards.base import check_inputs
from flowforge.rewards.scorers.clip_common import TransformersClip

CLIPSCORE_WEIGHT = 2.5
"""Hessel et al. 2021's ``w`` in ``CLIPScore = w * max(cos, 0)``."""

FLOW_GRPO_CLIP_DIVISOR = 30.0
"""flow_grpo's ``clip_scorer.py`` divisor of ``logits_per_image``."""

CLIP_SCORE_FORMULAS = ("cosine", "clipscore", "flow_grpo")


class ClipScore(TransformersClip):
    """Text-image agreement of a CLIP model (e.g. ``openai/clip-vit-large-patch14``).

    ``formula``: ``"cosine"`` (default) ``cos(image, prompt)`` in [-1, 1]; ``"clipscore"`` Hessel et al. 2021's
    ``2.5 * max(cos, 0)``; ``"flow_grpo"`` flow_grpo's ``clip_scorer.py`` value ``logit_scale.exp() * cos / 30``.
    Other options as :class:`~flowforge.rewards.scorers.pickscore.PickScore` (``processor_path`` defaults to
    ``model_path``, which for the openai checkpoints holds the processor files too).

    Raises:
        ValueError: a missing path, a bad option (the message lists the allowed formulas), a model that does not load.
    """

    name = "clip_score"

    def __init__(self, model_path: str | os.PathLike | None = None, processor_path: str | os.PathLike | None = None,
                 *, formula: str = "cosine", device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
                 batch_size: int = 32) -> None:
        if formula not in CLIP_SCORE_FORMULAS:
            raise ValueError(f"formula must be one of {list(CLIP_SCORE_FORMULAS)}, got {formula!r}")
        self.formula = formula
        super().__init__(model_path, processor_path, device=device, dtype=dtype, batch_size=batch_size,
                         model_hint="a transformers CLIPModel such as openai/clip-vit-large-patch14")

    @torch.no_grad()
    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """``media [B, 3, H, W]`` in [0, 1] -> ``[B]`` float32 score on ``media``'s device."""
        if check_inputs(media, prompts, metadata) == 0:
            return torch.empty(0, dtype=torch.float32, device=media.device)
        cosine = self.cosine(media, prompts)
        if self.formula == "clipscore":
            scores = CLIPSCORE_WEIGHT * cosine.clamp(min=0.0)
        elif self.formula == "flow_grpo":
            scores = self.model.logit_scale.float().exp() * cosine / FLOW_GRPO_CLIP_DIVISOR
        else:
            scores = cosine
        return scores.to(media.device)
