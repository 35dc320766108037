"""``eval/sample_change``: how far a run has moved its held-out samples from where it started.

Whether a run moved its outputs at all -- a parameter mode or LoRA that cannot reach the output trains without
changing what the model draws -- is read off the held-out eval, whose noise is fixed: ``eval/sample_change`` is the
mean over eval samples ``i`` of ``||t(x_i) - t(x_i^0)||_2 / sqrt(d)``, where ``x_i^0`` is sample ``i`` at the step-0
eval (same prompt, same noise), ``t`` the :func:`change_thumbnail` (every frame average-pooled to at most
:data:`CHANGE_SIDE` pixels a side) and ``d`` its element count: the RMS per-element change in pixel units,
comparable to the within-group diversity of :mod:`flowforge.train.metrics`; exactly 0 while the weights that sample
are unchanged.

The step-0 eval's thumbnails are kept in ``samples/start_samples.safetensors`` (:class:`StartSamples`) with a
fingerprint of the eval set (:func:`eval_fingerprint`), so a resumed run compares against the same start and a
changed eval set is not compared at all.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from flowforge.runtime.durable import atomic_write

log = logging.getLogger("flowforge")

CHANGE_SIDE = 64
"""The longest side (pixels) of the frames :func:`sample_change` compares: larger frames are average-pooled down, so
the step-0 samples a run keeps stay small (float32: 64 eval images of 1024 px keep 3 MB per frame, not 800)."""


def change_thumbnail(images: Tensor) -> Tensor:
    """The samples :func:`sample_change` compares: every frame average-pooled to at most :data:`CHANGE_SIDE` pixels
    on its longer side (``adaptive_avg_pool2d``: exact block means when the sides divide, overlapping windows
    otherwise; aspect kept; smaller frames unchanged), as float32 on the CPU.

    Args:
        images: ``[B, C, H, W]`` images or ``[B, C, F, H, W]`` video, pixels in [0, 1], any float dtype and device.

    Returns:
        ``[B, C, h, w]`` / ``[B, C, F, h, w]`` float32 on the CPU, ``max(h, w) <= CHANGE_SIDE``.

    Raises:
        ValueError: ``images`` is not 4-d or 5-d float.
    """
    if images.dim() not in (4, 5) or not images.is_floating_point():
        raise ValueError(f"images must be [B, C, H, W] or [B, C, F, H, W] float, got {images.dtype} "
                         f"{list(images.shape)}")
    x = images.detach().float()
    h, w = x.shape[-2:]
    if max(h, w) > CHANGE_SIDE:
        scale = CHANGE_SIDE / max(h, w)
        size = (max(1, round(h * scale)), max(1, round(w * scale)))
        x = torch.nn.functional.adaptive_avg_pool2d(x.reshape(-1, 1, h, w), size).reshape(*x.shape[:-2], *size)
    return x.cpu()


def sample_change(current: Tensor, start: Tensor) -> float:
    """``eval/sample_change`` (module docstring): the mean over samples of the RMS per-element difference between
    the thumbnails (:func:`change_thumbnail`) of the same eval samples at two evals. A sample with a non-finite
    element in either is left out of the mean.

    Args:
        current: ``[B, ...]`` float, this eval's thumbnails.
        start: ``[B, ...]`` float, the step-0 eval's thumbnails, same shape.

    Returns:
        A float in pixel units: 0 when every thumbnail is identical, at most 1 for pixels in [0, 1]; NaN when no
        sample is finite in both.

    Raises:
        ValueError: the shapes differ or ``B`` is 0.
    """
    if current.shape != start.shape or current.shape[0] == 0:
        raise ValueError(f"sample_change compares equal non-empty shapes, got {list(current.shape)} and "
                         f"{list(start.shape)}")
    a, b = current.float().reshape(current.shape[0], -1), start.float().reshape(start.shape[0], -1)
    finite = torch.isfinite(a).all(dim=1) & torch.isfinite(b).all(dim=1)
    if not bool(finite.any()):
        return math.nan
    return float((a[finite] - b[finite]).pow(2).mean(dim=1).sqrt().mean())


def eval_fingerprint(prompts: Sequence, seed: int, samples_per_prompt: int, sigmas: Sequence[float],
                     guidance_scale: float) -> str:
    """sha256 (hex) of what fixes the eval's samples apart from the weights: the prompt records (``.prompt`` and
    ``.metadata``), the noise seed, samples per prompt, the sigma schedule and the guidance scale."""
    what = {"prompts": [[r.prompt, r.metadata] for r in prompts], "seed": seed, "k": samples_per_prompt,
            "sigmas": [float(s) for s in sigmas], "guidance": guidance_scale}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


class StartSamples:
    """The step-0 eval's thumbnails of one run, kept in ``path`` with the eval set's ``fingerprint``."""

    def __init__(self, path: Path, fingerprint: str):
        self.path = Path(path)
        self.fingerprint = fingerprint
        self._warned: set[str] = set()  # each reason is warned once per run, not at every eval

    def _skip(self, reason: str, message: str, *args) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning(message + " (warned once per run)", *args)

    def measure(self, step: int, images: Tensor) -> float | None:
        """``eval/sample_change`` of this eval's ``images`` (``[B, C, H, W]`` / ``[B, C, F, H, W]`` in [0, 1]).
        Step 0 keeps its thumbnails (atomic write) and returns 0. None when the media are not images or video or the
        file is missing (a run begun before flowforge kept it); None with a warning (once per run and reason) when the
        file is unreadable or was kept by another eval set (the eval changed on resume)."""
        from safetensors import SafetensorError, safe_open
        from safetensors.torch import save_file

        if images.dim() not in (4, 5):
            return None
        thumbs = change_thumbnail(images)
        if step == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, lambda tmp: save_file({"samples": thumbs.contiguous()}, str(tmp),
                                                          metadata={"eval": self.fingerprint}))
            return 0.0
        if not self.path.is_file():
            return None
        try:
            with safe_open(str(self.path), framework="pt") as f:  # one read: the fingerprint and the samples
                kept = (f.metadata() or {}).get("eval")
                start = f.get_tensor("samples")
        except (OSError, KeyError, SafetensorError) as exc:
            self._skip("unreadable", "eval/sample_change not logged: %s is unreadable (%s)", self.path, exc)
            return None
        if kept != self.fingerprint or start.shape != thumbs.shape:
            self._skip("foreign", "eval/sample_change not logged: %s was kept by another eval set (prompts, noise "
                       "seed, schedule or guidance changed since step 0)", self.path)
            return None
        return sample_change(thumbs, start)
