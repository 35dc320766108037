"""JPEG (in)compressibility rewards, the classic CPU-only rewards of DDPO.

Black, Janner, Du, Kostrikov, Levine, "Training Diffusion Models with Reinforcement Learning" (DDPO), ICLR 2024,
arXiv:2305.13301, §6.1: the image is encoded as JPEG at quality 95 and its size in kilobytes (``bytes / 1000``) is the
signal. Compressibility rewards a small file (``r = -size_kb``), incompressibility a large one (``r = +size_kb``).
Here each image is quantised to 8-bit RGB (``round(255 * clamp(x, 0, 1))``) and encoded with Pillow; grey or
RGB content is encoded as an RGB JPEG either way, so scores of different scorers and runs are comparable.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from flowforge.media import to_uint8
from flowforge.rewards.base import check_inputs, check_media

JPEG_QUALITY = 95


def _check_quality(quality: int) -> int:
    if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 95:
        raise ValueError(f"quality must be an int in 1..95, got {quality!r}")
    return quality


def jpeg_size_kb(media: Tensor, *, quality: int = JPEG_QUALITY) -> Tensor:
    """JPEG-encoded size of each image in kilobytes (1 kB = 1000 bytes).

    Args:
        media: ``[B, 3, H, W]`` float in [0, 1] (values outside are clamped), any device.
        quality: Pillow JPEG quality, 1..95 (DDPO uses 95).

    Returns:
        ``[B]`` float32 on ``media``'s device.

    Raises:
        ValueError: bad ``media`` shape / dtype, or ``quality`` outside 1..95.
    """
    _check_quality(quality)
    check_media(media)
    pixels = to_uint8(media).cpu().permute(0, 2, 3, 1)
    sizes = []
    for image in pixels.numpy():
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(image), mode="RGB").save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32, device=media.device)


class _JpegSize:
    """Shared body of the two JPEG rewards: ``sign * size_kb`` of the quality-``quality`` JPEG."""

    name: ClassVar[str]
    sign: ClassVar[float]
    needs_group: ClassVar[bool] = False

    def __init__(self, quality: int = JPEG_QUALITY) -> None:
        self.quality = _check_quality(quality)

    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """``media [B, 3, H, W]`` in [0, 1] -> ``[B]`` float32 (``sign`` x kilobytes)."""
        check_inputs(media, prompts, metadata)
        return self.sign * jpeg_size_kb(media, quality=self.quality)


class JpegCompressibility(_JpegSize):
    """DDPO's compressibility reward: ``-size_kb`` of the quality-95 JPEG (higher = smaller file)."""

    name = "jpeg_compressibility"
    sign = -1.0


class JpegIncompressibility(_JpegSize):
    """DDPO's incompressibility reward: ``+size_kb`` of the quality-95 JPEG (higher = larger file)."""

    name = "jpeg_incompressibility"
    sign = 1.0
