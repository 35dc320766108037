"""Eval sample grids with their captions: the grid PNG and a JSON sidecar naming each cell's prompt and scores.

The eval stage tiles the first sample of every held-out prompt into ``samples/step_<n>.png``
(:func:`save_grid`); :func:`save_eval_grid` also writes ``samples/step_<n>.json``::

    {"step": 10, "image": "step_000010.png",
     "cells": [{"prompt": "a handwritten seven", "scores": {"digit_eval": 1.0, ...}, "box": [l, t, r, b]}, ...]}

``box`` is the cell's pixel rectangle in the PNG (left, top, right exclusive, bottom exclusive), so readers (the
report, trackers) crop cells without knowing the grid geometry. A video's cell is its whole row of frames; when its
prompt is one word per frame (a world model's action sequence, ``"LEFT NOOP RIGHT ..."``: exactly ``F``
whitespace-separated words) the cell also lists its frames in order, ``"frames": [{"box": [l, t, r, b], "label":
"LEFT"}, ...]``, so the report writes each frame's action under that frame. Non-finite scores are written as
``null``. :func:`read_grid_cells` reads a sidecar back and tolerates its absence
(grids written before sidecars existed).

The sidecar also keeps every eval sample's score, not only the shown first sample of each prompt, so the report
can give the eval mean its standard error (:func:`read_eval_scores`)::

    "eval_scores": {"samples_per_prompt": K, "scores": {"digit_eval": [N*K floats or null], ...}}

prompt-major: prompt ``i``'s samples are entries ``i*K .. i*K+K-1``, prompts in the order of ``cells``. The
within-prompt diversity of each prompt's ``K`` samples is kept too, for the diversity curve's standard error
(:func:`read_eval_diversity`)::

    "eval_diversity": [N floats or null]

An audio-video model's eval sample also has its sound: cell ``i``'s waveform is written beside the grid as
``step_<n>_audio_<i>.wav`` (16-bit PCM, :func:`write_wav`) and named in the cell as ``"audio": "<file name>"``; the
report plays it in an ``<audio>`` element.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from flowforge.media import AudioBatch, video_frames
from flowforge.runtime.durable import atomic_write

GRID_NROW, GRID_SCALE, GRID_PADDING = 10, 2, 2
"""Images per row, nearest-neighbour upscaling and padding (source pixels) of the eval grids."""


def save_grid(images: Tensor, path: Path, *, nrow: int, scale: int = 1, padding: int = 2) -> Path:
    """Tile images into one PNG grid, written atomically (temporary file in the same folder, then rename).

    Images fill rows left to right, ``nrow`` images per row (torchvision's ``make_grid`` convention), with
    ``padding`` mid-grey pixels between and around tiles. Pixels are quantised as ``round(255 * clamp(x, 0, 1))``
    (the same quantisation as the JPEG reward), then the whole grid is upscaled by ``scale`` with nearest-neighbour
    resampling (Pillow), so the padding scales with it. Output size:
    ``width = scale * (cols * (W + padding) + padding)``, ``height = scale * (rows * (H + padding) + padding)``,
    ``cols = min(nrow, B)``, ``rows = ceil(B / nrow)``.

    Args:
        images: ``[B, 3, H, W]`` (or ``[B, 1, H, W]`` grey) float in [0, 1], any device.
        path: the PNG to write; parent folders are created.
        nrow: images per row, >= 1.
        scale: integer nearest-neighbour upscaling factor, >= 1.
        padding: grid lines in source pixels, >= 0.

    Returns:
        ``path``.

    Raises:
        ValueError: wrong shape / dtype, an empty batch, non-finite pixels, or ``nrow`` / ``scale`` / ``padding`` out
            of range.
    """
    for name, value, low in (("nrow", nrow, 1), ("scale", scale, 1), ("padding", padding, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if images.dim() != 4 or images.shape[1] not in (1, 3) or images.shape[0] == 0:
        raise ValueError(f"images must be [B, 3, H, W] (or [B, 1, H, W]) with B >= 1, got shape {list(images.shape)}")
    if not images.is_floating_point():
        raise ValueError(f"images must be float in [0, 1], got {images.dtype}")
    x = images.detach().float().cpu()
    if not torch.isfinite(x).all():
        raise ValueError("images contain NaN or inf")
    b, c, h, w = x.shape
    cols, rows = min(nrow, b), math.ceil(b / nrow)
    grid = torch.full((c, rows * (h + padding) + padding, cols * (w + padding) + padding), 0.5)
    for k in range(b):  # B tiles of a grid, not a hot path
        r, q = divmod(k, nrow)
        top, left = padding + r * (h + padding), padding + q * (w + padding)
        grid[:, top:top + h, left:left + w] = x[k]
    pixels = (grid.clamp(0.0, 1.0) * 255.0).round().to(torch.uint8).permute(1, 2, 0).contiguous().numpy()
    image = Image.fromarray(pixels[:, :, 0], mode="L") if c == 1 else Image.fromarray(pixels, mode="RGB")
    if scale != 1:
        image = image.resize((image.width * scale, image.height * scale), resample=Image.Resampling.NEAREST)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: image.save(tmp, format="PNG"))
    return path


def grid_boxes(count: int, height: int, width: int, *, nrow: int, scale: int, padding: int) -> list[list[int]]:
    """Pixel boxes ``[left, top, right, bottom]`` (right / bottom exclusive) of ``count`` tiles of ``height x width``
    source pixels in a :func:`save_grid` PNG, in tile order (rows filled left to right)."""
    boxes = []
    for k in range(count):
        r, q = divmod(k, nrow)
        top, left = padding + r * (height + padding), padding + q * (width + padding)
        boxes.append([scale * left, scale * top, scale * (left + width), scale * (top + height)])
    return boxes


def _score(value: float) -> float | None:
    return value if math.isfinite(value) else None  # strict JSON: NaN / inf as null


def write_wav(path: Path, waveform: Tensor, sample_rate: int) -> Path:
    """Write ``waveform [C, T]`` (float, clipped to [-1, 1]) as a 16-bit PCM WAV file at ``sample_rate`` Hz
    (stdlib ``wave``), atomically.

    Raises:
        ValueError: ``waveform`` is not ``[C, T]``.
    """
    import wave

    if waveform.ndim != 2:
        raise ValueError(f"waveform must be [C, T], got shape {tuple(waveform.shape)}")
    pcm = (waveform.detach().float().cpu().clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)
    frames = pcm.t().contiguous().numpy().tobytes()  # interleaved channels, little-endian on every host we run

    def write(tmp: Path) -> None:
        with wave.open(str(tmp), "wb") as out:
            out.setnchannels(int(pcm.shape[0]))
            out.setsampwidth(2)
            out.setframerate(int(sample_rate))
            out.writeframes(frames)

    atomic_write(Path(path), write)
    return Path(path)


def save_eval_grid(media: torch.Tensor, path: Path, prompts: Sequence[str],
                   scores: Mapping[str, torch.Tensor], step: int,
                   frame_labels: Sequence[Sequence[str] | None] | None = None, *,
                   all_scores: Mapping[str, torch.Tensor] | None = None, samples_per_prompt: int = 1,
                   audio: AudioBatch | None = None,
                   cell_extras: Sequence[Mapping[str, Any] | None] | None = None,
                   diversity: torch.Tensor | None = None) -> Path:
    """Write the eval grid ``path`` (PNG) and its caption sidecar ``path.with_suffix(".json")``.

    Args:
        media: ``[N, 3, H, W]`` images (tiled ``GRID_NROW`` per row) or ``[N, 3, F, H, W]`` videos (one row of
            ``F`` frames each), float in [0, 1].
        path: the PNG (``samples/step_<n>.png``).
        prompts: ``[N]`` the prompt of each image / video.
        scores: scorer name -> ``[N]`` float score of each image / video (higher is better; NaN allowed).
        step: the training step evaluated.
        frame_labels: videos only, optional: ``[N]`` entries, each ``F`` labels written under the video's frames
            (a world model's actions, :meth:`~flowforge.models.world_model.adapter.WorldModelAdapter.frame_labels`)
            or None (no per-frame labels for that video). The sidecar then lists each labelled frame's box.
        all_scores: optional, scorer name -> ``[N * samples_per_prompt]`` float score of every eval sample,
            prompt-major (the ``N`` media are the first sample of each prompt); kept as ``eval_scores``.
        samples_per_prompt: ``K``, the eval samples of each prompt in ``all_scores``.
        audio: optional, the ``N`` samples' sound (an audio-video model): one WAV per cell (module docstring).
        cell_extras: optional, ``[N]`` entries of further keys (JSON-able) merged into each cell, or None: e.g. a
            world model's real clip (:func:`flowforge.report.world_strips.write_real_strips`).
        diversity: optional, ``[N]`` float within-prompt diversity of each prompt's samples (NaN with one sample);
            kept as ``eval_diversity``.

    Returns:
        ``path``.

    Raises:
        ValueError: ``prompts``, a score, ``frame_labels`` or ``cell_extras`` does not have ``N`` entries; a label
            list that is not ``F`` long; an ``all_scores`` entry that is not ``N * samples_per_prompt`` long; a
            ``diversity`` that is not ``N`` long (and as ``save_grid``).
    """
    n = media.shape[0]
    if len(prompts) != n or any(v.numel() != n for v in scores.values()):
        raise ValueError(f"need {n} prompts and {n} scores per scorer, got {len(prompts)} prompts and "
                         f"{ {k: v.numel() for k, v in scores.items()} }")
    if all_scores is not None and any(v.numel() != n * samples_per_prompt for v in all_scores.values()):
        raise ValueError(f"all_scores need {n} x {samples_per_prompt} entries per scorer, got "
                         f"{ {k: v.numel() for k, v in all_scores.items()} }")
    if diversity is not None and diversity.numel() != n:
        raise ValueError(f"diversity needs {n} entries (one per prompt), got {diversity.numel()}")
    per_frame: list[list[dict[str, Any]] | None] = [None] * n
    if media.ndim == 5:
        frames, (h, w) = media.shape[2], media.shape[-2:]
        save_grid(video_frames(media), path, nrow=frames, scale=GRID_SCALE, padding=GRID_PADDING)
        rows = grid_boxes(n * frames, h, w, nrow=frames, scale=GRID_SCALE, padding=GRID_PADDING)
        boxes = [[rows[i * frames][0], rows[i * frames][1], rows[i * frames + frames - 1][2], rows[i * frames][3]]
                 for i in range(n)]
        labels = list(frame_labels) if frame_labels is not None else [None] * n
        if len(labels) != n or any(ls is not None and len(ls) != frames for ls in labels):
            raise ValueError(f"frame_labels must give {n} videos None or {frames} labels each")
        for i, ls in enumerate(labels):
            if ls is not None:
                per_frame[i] = [{"box": rows[i * frames + f], "label": str(ls[f])} for f in range(frames)]
    else:
        save_grid(media, path, nrow=GRID_NROW, scale=GRID_SCALE, padding=GRID_PADDING)
        boxes = grid_boxes(n, media.shape[-2], media.shape[-1], nrow=GRID_NROW, scale=GRID_SCALE,
                           padding=GRID_PADDING)
    values = {k: v.detach().float().cpu().reshape(-1).tolist() for k, v in scores.items()}
    cells = [{"prompt": p, "scores": {k: _score(v[i]) for k, v in values.items()}, "box": boxes[i],
              **({"frames": per_frame[i]} if per_frame[i] is not None else {})} for i, p in enumerate(prompts)]
    if audio is not None:
        if len(audio) != n:
            raise ValueError(f"audio has {len(audio)} clips for {n} cells")
        for i, cell in enumerate(cells):
            wav = Path(path).with_name(f"{Path(path).stem}_audio_{i}.wav")
            cell["audio"] = write_wav(wav, audio.waveform[i], audio.sample_rate).name
    if cell_extras is not None:
        if len(cell_extras) != n:
            raise ValueError(f"cell_extras has {len(cell_extras)} entries for {n} cells")
        for cell, extra in zip(cells, cell_extras):
            cell.update(extra or {})
    data: dict[str, Any] = {"step": step, "image": Path(path).name, "cells": cells}
    if all_scores is not None:
        data["eval_scores"] = {"samples_per_prompt": samples_per_prompt, "scores": {
            k: [_score(x) for x in v.detach().float().cpu().reshape(-1).tolist()] for k, v in all_scores.items()}}
    if diversity is not None:
        data["eval_diversity"] = [_score(x) for x in diversity.detach().float().cpu().reshape(-1).tolist()]
    text = json.dumps(data, indent=1, allow_nan=False) + "\n"
    atomic_write(Path(path).with_suffix(".json"), lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return Path(path)


def _is_box(box: Any) -> bool:
    return isinstance(box, list) and len(box) == 4 and all(isinstance(b, int) for b in box)


def read_grid_cells(png: Path) -> list[dict[str, Any]] | None:
    """The cells of grid ``png`` from its sidecar (``prompt``, ``scores`` with ``None`` for non-finite, ``box``, and
    for a video labelled per frame ``frames``: ``[{"box", "label"}, ...]`` in frame order); ``None`` when there is
    no sidecar or it cannot be read (never raises). A malformed ``frames`` list is dropped from its cell."""
    try:
        data = json.loads(Path(png).with_suffix(".json").read_text(encoding="utf-8"))
        cells = data["cells"]
        for cell in cells:
            if not (isinstance(cell["prompt"], str) and isinstance(cell["scores"], dict) and _is_box(cell["box"])):
                return None
            frames = cell.get("frames")
            if frames is not None and not (isinstance(frames, list) and frames and all(
                    isinstance(f, dict) and _is_box(f.get("box")) and isinstance(f.get("label"), str)
                    for f in frames)):
                del cell["frames"]
        return cells
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def read_eval_diversity(png: Path) -> list[float] | None:
    """``[N]`` within-prompt diversity of each eval prompt of grid ``png`` (NaN for null); ``None`` when its sidecar
    has none (a grid written before it was kept) or cannot be read (never raises)."""
    try:
        values = json.loads(Path(png).with_suffix(".json").read_text(encoding="utf-8"))["eval_diversity"]
        if not isinstance(values, list):
            return None
        return [float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan for v in values]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_eval_scores(png: Path) -> tuple[int, dict[str, list[float]]] | None:
    """``(samples_per_prompt, {scorer: [N*K scores, NaN for null]})`` of every eval sample of grid ``png``
    (prompt-major, module docstring); ``None`` when its sidecar has none (a grid written before they were kept) or
    cannot be read (never raises)."""
    try:
        data = json.loads(Path(png).with_suffix(".json").read_text(encoding="utf-8"))["eval_scores"]
        k, scores = data["samples_per_prompt"], data["scores"]
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or not isinstance(scores, dict):
            return None
        out = {}
        for name, values in scores.items():
            if not isinstance(values, list) or len(values) % k:
                return None
            out[str(name)] = [float(v) if isinstance(v, (int, float)) else math.nan for v in values]
        return k, out
    except (OSError, ValueError, KeyError, TypeError):
        return None
