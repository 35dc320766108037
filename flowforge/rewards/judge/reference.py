"""Reference and condition media for a judge request, read from files a prompt's metadata names, under a pixel
budget checked from each file's header before anything is decoded."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from flowforge.rewards.judge import protocol as P

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def load_reference(path: Path, max_pixels: int = P.MAX_DECODE_PIXELS) -> Tensor:
    """A reference or condition as media: an image file -> ``[3, H, W]``; a directory of image files ->
    ``[3, F, H, W]`` (frames in file-name order). Values float32 in [0, 1]. Each file's size is read from its header
    first (:func:`P.header_pixels`) and a file over ``max_pixels`` is refused before it is decoded (a 140 KB PNG can
    hold 12000^2 pixels: 1.6 GiB as float32).

    Raises:
        ValueError: the path does not exist, is not an image, is an image over ``max_pixels``, or is a directory
            without images.
    """
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    def read(p: Path) -> Tensor:
        try:
            pixels = P.header_pixels(p)
            if pixels > max_pixels:
                raise ValueError(f"reference {str(p)!r} decodes to {pixels} pixels, over the budget of {max_pixels} "
                                 "pixels per image; downscale it")
            with Image.open(p) as im:
                array = np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
            raise ValueError(f"reference {str(p)!r} is not a readable image: {exc}") from None
        return torch.from_numpy(array).permute(2, 0, 1).contiguous()

    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise ValueError(f"reference directory {str(path)!r} holds no images ({', '.join(IMAGE_SUFFIXES)})")
        return torch.stack([read(p) for p in files], dim=1)
    if not path.is_file():
        raise ValueError(f"reference {str(path)!r} does not exist")
    return read(path)
