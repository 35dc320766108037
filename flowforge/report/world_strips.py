"""World-model eval strips: each shown eval clip frame by frame -- the generated frame, the action commanded at that
frame, and the real frame of the recorded clip -- so a reader sees whether the generated paddle follows the command.

Writing (the trainer's eval, beside :func:`flowforge.report.grids.save_eval_grid`): :func:`real_clips` reads the
real future of each shown prompt row (``metadata["real_clip"]``, the strip the realism scorers compare against,
:func:`flowforge.rewards.scorers.world_eval.load_real_clip`); :func:`write_real_strips` tiles each into
``samples/step_<n>_real_<i>.png`` (the grid's scale and padding, one row of ``F`` frames) and returns the sidecar
entry of its cell::

    "real": {"image": "step_000010_real_0.png", "frames": [[l, t, r, b], ...]}   # one box per frame, in order

Reading (``report.html``): :func:`strip_html` renders a cell labelled per frame (``cell["frames"]``, the adapter's
:meth:`~flowforge.models.world_model.adapter.WorldModelAdapter.frame_labels`) as one column per frame::

    frame f           <- header ("frame 0 (given)": frame 0 is the real first frame the model was given)
    generated frame   <- cropped from the grid, enlarged (nearest neighbour) to >= FRAME_MIN_WIDTH px
    ← LEFT            <- the commanded action, an arrow and its name (ACTION_GLYPHS)
    real frame        <- from the real strip, same enlargement; absent when the eval row has no real clip

Every column carries ``data-frame`` and ``data-action`` attributes and every image an ``alt`` naming its frame and
action, so the labels can be read back from the page. Missing or unreadable real strips leave the column without
its real frame (never an error).
"""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image
from torch import Tensor

from flowforge.report.grids import GRID_PADDING, GRID_SCALE, grid_boxes, save_grid
from flowforge.report.page import esc
from flowforge.report.plots import img_tag
from flowforge.rewards.scorers.world_eval import load_real_clip

log = logging.getLogger(__name__)

FRAME_MIN_WIDTH = 128
"""A video frame in the report is upscaled (nearest neighbour, an integer factor) to at least this many pixels wide:
a 32 px world-model frame shows its 1-2 px paddle only when enlarged."""

ACTION_GLYPHS = {"LEFT": "\u2190", "RIGHT": "\u2192", "NOOP": "\u00b7", "FIRE": "\u2191"}
"""The arrow written before each commanded action (FIRE launches the ball: up); other labels get none."""


def crop_png(image: Image.Image, box: Sequence[int], min_width: int = 0) -> bytes:
    """The ``box`` (left, top, right, bottom) of ``image`` as PNG bytes, upscaled by the smallest integer factor that
    makes it ``min_width`` wide (nearest neighbour: pixels stay sharp squares)."""
    crop = image.crop(tuple(box))
    factor = max(1, math.ceil(min_width / max(crop.width, 1)))
    if factor > 1:
        crop = crop.resize((crop.width * factor, crop.height * factor), resample=Image.Resampling.NEAREST)
    buffer = io.BytesIO()
    crop.save(buffer, format="PNG")
    return buffer.getvalue()


# --------------------------------------------------------------------------------------------------------------------
# writing


def real_clips(metadata: Sequence[dict[str, Any]], frames: int) -> list[Tensor | None] | None:
    """The real clip ``[F, H, W]`` float32 in [0, 1] of each eval row (``metadata["real_clip"]``), None for a row
    without one or whose strip cannot be read (a warning names it); None when no row has one."""
    out: list[Tensor | None] = []
    for meta in metadata:
        try:
            out.append(load_real_clip(meta, frames) if isinstance(meta, dict) else None)
        except (OSError, ValueError) as exc:  # a report aid: a bad strip must not stop the eval
            log.warning("eval strip: real clip of %s not shown: %s", meta.get("sample_id", "?"), exc)
            out.append(None)
    return out if any(c is not None for c in out) else None


def write_real_strips(grid_path: Path, clips: Sequence[Tensor | None]) -> list[dict[str, Any] | None]:
    """Write each clip as ``<grid stem>_real_<i>.png`` beside the grid and return each cell's sidecar entry
    (``{"real": {"image", "frames"}}``, module docstring; None where the clip is None).

    Args:
        grid_path: the eval grid (``samples/step_<n>.png``).
        clips: per shown cell, ``[F, H, W]`` (grey) or ``[C, F, H, W]`` (C 1 or 3) float in [0, 1], or None.

    Raises:
        ValueError: a clip of another rank (and as :func:`~flowforge.report.grids.save_grid`).
    """
    out: list[dict[str, Any] | None] = []
    for i, clip in enumerate(clips):
        if clip is None:
            out.append(None)
            continue
        if clip.dim() == 3:
            clip = clip[None]
        if clip.dim() != 4:
            raise ValueError(f"a real clip must be [F, H, W] or [C, F, H, W], got shape {tuple(clip.shape)}")
        f, h, w = clip.shape[1:]
        path = Path(grid_path).with_name(f"{Path(grid_path).stem}_real_{i}.png")
        save_grid(clip.transpose(0, 1), path, nrow=f, scale=GRID_SCALE, padding=GRID_PADDING)
        out.append({"real": {"image": path.name,
                             "frames": grid_boxes(f, h, w, nrow=f, scale=GRID_SCALE, padding=GRID_PADDING)}})
    return out


# --------------------------------------------------------------------------------------------------------------------
# reading


def read_real_frames(grid_path: Path, cell: dict[str, Any]) -> list[bytes] | None:
    """The enlarged PNG of each real frame of ``cell`` (its ``real`` entry), or None when it has none, it is
    malformed, its file is missing or unreadable, or its frame count differs from the cell's (never raises)."""
    real = cell.get("real")
    try:
        name, boxes = real["image"], real["frames"]
        if not isinstance(name, str) or "/" in name or "\\" in name or len(boxes) != len(cell["frames"]):
            return None
        with Image.open(Path(grid_path).with_name(name)) as strip:
            strip.load()
            return [crop_png(strip, box, FRAME_MIN_WIDTH) for box in boxes]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def strip_html(grid: Image.Image, grid_path: Path, step: int, cell: dict[str, Any], scores: str) -> str:
    """A video cell labelled per frame (``cell["frames"]``) as one column per frame -- header, generated frame,
    commanded action, real frame when the cell has one (module docstring) -- then ``scores``."""
    real = read_real_frames(grid_path, cell)
    columns = []
    for f, frame in enumerate(cell["frames"]):
        label = frame["label"]
        glyph = ACTION_GLYPHS.get(label.upper(), "")
        head = "frame 0 (given)" if f == 0 else f"frame {f}"
        parts = [f'<div class="frame" data-frame="{f}" data-action="{esc(label)}">',
                 f'<div class="fhead">{esc(head)}</div>',
                 img_tag(crop_png(grid, frame["box"], FRAME_MIN_WIDTH),
                         f"step {step}: frame {f} generated, commanded {label}", "frame"),
                 f'<div class="act"><span class="arrow">{esc(glyph)}</span> {esc(label)}</div>']
        if real is not None:
            parts.append(img_tag(real[f], f"step {step}: frame {f} real, recorded {label}", "frame real"))
        columns.append("".join(parts) + "</div>")
    rows = "generated · commanded action" + (" · real" if real is not None else " (no real clip in this eval row)")
    return (f'<div class="cell video"><div class="rows">{esc(rows)}</div>'
            f'<div class="strip">{"".join(columns)}</div><div class="cap">{esc(scores)}</div></div>')
