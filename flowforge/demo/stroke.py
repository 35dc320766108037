"""An independent eval judge for the digits pipeline demo: how wide the pen strokes are, in pixels.

The demo's teacher (:class:`flowforge.orchestrate.demo.FineStrokeScorer`) prefers a fine pen and measures it by the
share of inked pixels. This judge measures the same construct another way, with none of the teacher's code or
features (no classifier, no ink share): on the image binarised at 0.5, a stroke of width ``w`` and length ``L``
covers ``A ~ w L`` pixels and has ``P ~ 2 L`` boundary pixels (ink pixels with a background 4-neighbour, the image
border counting as background), so ``w ~ 2 A / P``. A one-pixel line gives 2 (every pixel is boundary), a solid
disc of radius ``r`` about ``r``. Lower is a finer pen. The pipeline never trains on it; it is an ``eval.scorers``
entry (``flowforge.demo.stroke:StrokeWidth``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["StrokeWidth", "stroke_width"]


def stroke_width(gray: Tensor, threshold: float = 0.5) -> Tensor:
    """``[B, 1, H, W]`` grey in [0, 1] -> ``[B]`` float32: ``2 A / P`` (module docstring); 0 for an image with no
    pixel above ``threshold``.

    Raises:
        ValueError: ``gray`` is not ``[B, 1, H, W]``.
    """
    if gray.dim() != 4 or gray.shape[1] != 1:
        raise ValueError(f"stroke_width expects [B, 1, H, W] grey images, got {tuple(gray.shape)}")
    ink = (gray > threshold).float()
    # a pixel is interior when all four neighbours are ink (zero padding: the border is background)
    padded = F.pad(ink, (1, 1, 1, 1))
    neighbours = (padded[..., :-2, 1:-1] * padded[..., 2:, 1:-1] * padded[..., 1:-1, :-2] * padded[..., 1:-1, 2:])
    area = ink.sum(dim=(1, 2, 3))
    boundary = (ink * (1.0 - neighbours)).sum(dim=(1, 2, 3))
    return torch.where(boundary > 0, 2.0 * area / boundary.clamp_min(1.0), torch.zeros_like(area))


class StrokeWidth:
    """Eval scorer: ``[B, 3, H, W]`` (or ``[B, 1, H, W]``) in [0, 1] -> ``[B]`` float32 stroke widths in pixels of
    the 32 x 32 grey image (:func:`stroke_width`); prompts and metadata are not read.

    Raises (``__call__``):
        ValueError: bad shapes (:func:`flowforge.rewards.base.check_inputs`).
    """

    name = "stroke_width"
    needs_group: ClassVar[bool] = False

    @torch.no_grad()
    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        from flowforge.demo.classifiers import to_gray32
        from flowforge.rewards.base import check_inputs

        check_inputs(media, prompts, metadata)
        return stroke_width(to_gray32(media.detach().cpu())).to(media.device)
