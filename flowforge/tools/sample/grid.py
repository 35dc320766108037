"""PNG output of ``flowforge sample``: one file per image and a grid with each image's prompt written under it.

Images are quantised as ``round(255 * clamp(x, 0, 1))`` (the eval grids' rule,
:func:`flowforge.train.metrics.save_grid`). A video is written as a film strip: its frames side by side in one row.
Every tile is upscaled by an integer factor with nearest-neighbour resampling until its shorter side is at least
``min_side`` pixels, so a 32x32 sample stays legible under its label. Rendering uses Pillow's built-in font only, so
the same images give the same PNG bytes on every machine with the same Pillow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageFont

from flowforge.runtime.durable import atomic_write

_FONT_SIZE, _LINES, _PAD = 12, 3, 4


def to_pil(media: torch.Tensor) -> Image.Image:
    """``[3, H, W]`` image (``[3, F, H, W]`` video: frames side by side) float in [0, 1] -> RGB ``PIL.Image``.

    Raises:
        ValueError: not 3 or 4 dims, or not 3 channels (1-channel images are shown grey).
    """
    x = media.detach().float().cpu()
    if x.dim() == 4:  # [3, F, H, W] -> [3, H, F * W]
        x = x.permute(0, 2, 1, 3).flatten(2)
    if x.dim() != 3 or x.shape[0] not in (1, 3):
        raise ValueError(f"expected an image [3, H, W] or a video [3, F, H, W], got shape {list(media.shape)}")
    x = x.expand(3, *x.shape[1:])
    pixels = (x.clamp(0.0, 1.0) * 255.0).round().to(torch.uint8).permute(1, 2, 0).contiguous().numpy()
    return Image.fromarray(pixels, mode="RGB")


def save_png(image: Image.Image, path: Path) -> Path:
    """Write ``image`` to ``path`` atomically (parents created); returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: image.save(tmp, format="PNG"))
    return path


def _wrap(draw: ImageDraw.ImageDraw, text: str, font, width: int) -> list[str]:
    """``text`` broken into at most ``_LINES`` lines that fit ``width`` pixels (the last one cut with "…")."""
    lines: list[str] = []
    for word in text.split():
        trial = f"{lines[-1]} {word}" if lines else word
        if lines and draw.textlength(trial, font=font) <= width:
            lines[-1] = trial
        else:
            lines.append(word)
    if len(lines) > _LINES:
        lines = lines[:_LINES]
        lines[-1] += " …"
    for i, line in enumerate(lines):
        while len(line) > 1 and draw.textlength(line, font=font) > width:
            line = line[:-2] + "…"
        lines[i] = line
    return lines


def labelled_grid(tiles: Sequence[Image.Image], labels: Sequence[str], *, ncol: int,
                  min_side: int = 128) -> Image.Image:
    """Tiles in rows of ``ncol`` on white, each with its label (wrapped, up to 3 lines) underneath.

    Args:
        tiles: the images, all of one size.
        labels: one label per tile.
        ncol: tiles per row, >= 1.
        min_side: tiles are upscaled by the smallest integer factor that makes their shorter side at least this.

    Raises:
        ValueError: no tiles, ``labels`` of another length, tiles of different sizes, ``ncol < 1``.
    """
    if not tiles or len(labels) != len(tiles) or ncol < 1:
        raise ValueError(f"need >= 1 tiles, as many labels and ncol >= 1; got {len(tiles)} tiles, {len(labels)} "
                         f"labels, ncol={ncol}")
    if len({t.size for t in tiles}) != 1:
        raise ValueError(f"tiles must share one size, got {sorted({t.size for t in tiles})}")
    w, h = tiles[0].size
    scale = max(1, math.ceil(min_side / min(w, h)))
    tw, th = w * scale, h * scale
    font = ImageFont.load_default(size=_FONT_SIZE)
    line_h = _FONT_SIZE + 3
    cell_w, cell_h = tw + 2 * _PAD, th + 2 * _PAD + _LINES * line_h
    cols, rows = min(ncol, len(tiles)), math.ceil(len(tiles) / ncol)
    grid = Image.new("RGB", (cols * cell_w, rows * cell_h), "white")
    draw = ImageDraw.Draw(grid)
    for k, (tile, label) in enumerate(zip(tiles, labels)):
        r, c = divmod(k, ncol)
        left, top = c * cell_w + _PAD, r * cell_h + _PAD
        grid.paste(tile.resize((tw, th), resample=Image.Resampling.NEAREST), (left, top))
        for i, line in enumerate(_wrap(draw, label, font, tw)):
            draw.text((left, top + th + 2 + i * line_h), line, fill="black", font=font)
    return grid
