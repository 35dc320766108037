"""PickScore: the Pick-a-Pic preference model, a CLIP-H fine-tuned on human picks between generated images.

    r = s * cos(f_I(x), f_T(p))            (/ 26 with ``normalize=True``)

Notation as in :mod:`flowforge.rewards.scorers.clip_common` (``s = logit_scale.exp()``, about 100).

Source: Kirstain et al., "Pick-a-Pic: An Open Dataset of User Preferences for Text-to-Image Generation", NeurIPS
2023, arXiv:2305.01569; model card of ``yuvalkirstain/PickScore_v1`` (``model.logit_scale.exp() * text_embs @
image_embs.T`` on L2-normalised embeddings, processor ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``). flow_grpo's
``flow_grpo/pickscore_scorer.py`` (Liu et al., "Flow-GRPO", arXiv:2505.05470) divides that by 26 ("norm to 0-1");
``normalize=True`` reproduces it. The default is the paper's raw score, the value reported in the PickScore /
Flow-GRPO tables (about 18..24 for real images).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from flowforge.rewards.base import check_inputs
from flowforge.rewards.scorers.clip_common import TransformersClip

PICKSCORE_NORMALIZER = 26.0
"""flow_grpo's divisor that maps raw PickScore (about 18..24) to roughly [0, 1]."""


def _check_flag(value: bool, option: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{option} must be True or False, got {value!r}")
    return value


class PickScore(TransformersClip):
    """PickScore (Kirstain et al. 2023): ``logit_scale.exp() * cos(image, prompt)`` of the Pick-a-Pic CLIP-H.

    Args:
        model_path: local directory of ``yuvalkirstain/PickScore_v1`` (a transformers ``CLIPModel``).
        processor_path: local directory of the tokenizer + image processor, i.e. of
            ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` (PickScore's processor); defaults to ``model_path``.
        normalize: divide by 26 as flow_grpo's ``pickscore_scorer.py`` does (about [0, 1] instead of ~18..24).
        device: ``"cpu"`` or a CUDA device where the model lives; media is moved there, scores come back.
        dtype: model dtype (``"float32"``, ``"bfloat16"``, ``"float16"``); the cosine is always float32.
        batch_size: images (and distinct prompts) per forward, >= 1.

    Raises:
        ValueError: a missing path, a bad option, or a model / processor that does not load or does not match.
    """

    name = "pickscore"

    def __init__(self, model_path: str | os.PathLike | None = None, processor_path: str | os.PathLike | None = None,
                 *, normalize: bool = False, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
                 batch_size: int = 32) -> None:
        self.normalize = _check_flag(normalize, "normalize")
        super().__init__(model_path, processor_path, device=device, dtype=dtype, batch_size=batch_size,
                         model_hint="yuvalkirstain/PickScore_v1 (processor: laion/CLIP-ViT-H-14-laion2B-s32B-b79K)")

    @torch.no_grad()
    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """``media [B, 3, H, W]`` in [0, 1] -> ``[B]`` float32 PickScore on ``media``'s device."""
        if check_inputs(media, prompts, metadata) == 0:
            return torch.empty(0, dtype=torch.float32, device=media.device)
        scores = self.model.logit_scale.float().exp() * self.cosine(media, prompts)
        if self.normalize:
            scores = scores / PICKSCORE_NORMALIZER
        return scores.to(media.device)
