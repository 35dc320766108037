"""An independent eval judge for the digits pipeline demo: how wide the pen strokes are, in pixels.

The demo's teacher (:class:`flowforge.orchestrate.demo.FineStrokeScorer`) prefers a fine pen and measures it by the
share of pixels above half the image's peak. This judge measures the same construct another way, with none of the
teacher's code or features (no classifier, no ink share, no peak): the image is binarised at its Otsu threshold
(the grey level that best separates two classes of pixels), and a stroke of width ``w`` and length ``L`` covers
``A ~ w L`` pixels and has ``P ~ 2 L`` boundary pixels (ink pixels with a background 4-neighbour, the image border
counting as background), so ``w ~ 2 A / P``. A one-pixel line gives 2 (every pixel is boundary), a solid disc of
radius ``r`` about ``r``. **Lower is a finer pen** (unlike a reward: do not make it a run's headline or guard
judge). An image without contrast (fewer than two grey levels) has no strokes: NaN. The pipeline never trains on it;
it is an ``eval.scorers`` entry (``flowforge.demo.stroke:StrokeWidth``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["StrokeWidth", "otsu_threshold", "stroke_width"]


def otsu_threshold(gray: Tensor, bins: int = 64) -> Tensor:
    """``[B, 1, H, W]`` grey in [0, 1] -> ``[B]`` thresholds: per image, the bin edge maximising the between-class
    variance of a ``bins``-bin histogram (Otsu 1979); NaN for an image whose pixels all fall in one bin."""
    flat = gray.flatten(1).clamp(0.0, 1.0)
    idx = (flat * bins).long().clamp_max(bins - 1)  # [B, N]
    hist = torch.zeros(flat.shape[0], bins).scatter_add_(1, idx, torch.ones_like(flat))
    p = hist / flat.shape[1]
    centres = (torch.arange(bins, dtype=torch.float32) + 0.5) / bins
    w0 = p.cumsum(1)[:, :-1]  # [B, bins - 1]: class 0 = bins 0..t
    m0 = (p * centres).cumsum(1)[:, :-1]
    total = (p * centres).sum(1, keepdim=True)
    between = (total * w0 - m0) ** 2 / (w0 * (1 - w0)).clamp_min(1e-12)
    between = torch.where((w0 > 0) & (w0 < 1), between, torch.full_like(between, -1.0))
    best = between.argmax(1)
    edges = (best + 1).float() / bins
    return torch.where(between.max(1).values > 0, edges, torch.full_like(edges, float("nan")))


def stroke_width(gray: Tensor) -> Tensor:
    """``[B, 1, H, W]`` grey in [0, 1] -> ``[B]`` float32: ``2 A / P`` (module docstring) on the image binarised at
    its :func:`otsu_threshold`; NaN for an image without contrast.

    Raises:
        ValueError: ``gray`` is not ``[B, 1, H, W]``.
    """
    if gray.dim() != 4 or gray.shape[1] != 1:
        raise ValueError(f"stroke_width expects [B, 1, H, W] grey images, got {tuple(gray.shape)}")
    gray = gray.float()
    threshold = otsu_threshold(gray)  # [B]
    ink = (gray >= threshold.nan_to_num(2.0)[:, None, None, None]).float()
    # a pixel is interior when all four neighbours are ink (zero padding: the border is background)
    padded = F.pad(ink, (1, 1, 1, 1))
    neighbours = padded[..., :-2, 1:-1] * padded[..., 2:, 1:-1] * padded[..., 1:-1, :-2] * padded[..., 1:-1, 2:]
    area = ink.sum(dim=(1, 2, 3))
    boundary = (ink * (1.0 - neighbours)).sum(dim=(1, 2, 3))
    return torch.where(boundary > 0, 2.0 * area / boundary.clamp_min(1.0), torch.full_like(area, float("nan")))


class StrokeWidth:
    """Eval scorer: ``[B, 3, H, W]`` (or ``[B, 1, H, W]``) in [0, 1] -> ``[B]`` float32 stroke widths in pixels of
    the 32 x 32 grey image (:func:`stroke_width`; NaN without contrast); prompts and metadata are not read.

    Raises (``__call__``):
        ValueError: bad shapes, or prompts / metadata not one per image.
    """

    name = "stroke_width"
    needs_group: ClassVar[bool] = False

    @torch.no_grad()
    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        from flowforge.demo.classifiers import to_gray32

        gray = to_gray32(media.detach().cpu())  # checks the image tensor
        if len(prompts) != len(gray) or len(metadata) != len(gray):
            raise ValueError(f"StrokeWidth: {len(gray)} images but {len(prompts)} prompts and {len(metadata)} "
                             "metadata rows; expected one of each per image")
        return stroke_width(gray).to(media.device)
