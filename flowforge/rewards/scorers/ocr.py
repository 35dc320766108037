"""OCR reward for text rendering (Flow-GRPO's OCR reward, flow_grpo ``ocr.py``), on RapidOCR's PP-OCRv4 ONNX models.

For each image, with ``target`` the text the image should show and ``read`` what the OCR reads:

    t = normalize(target), o = normalize(read)          normalize: delete spaces, lower-case
    d = 0 if t is a substring of o else min(lev(o, t), len(t))
    r = 1 - d / len(t)                                   in [0, 1], 1 = the text is rendered exactly

``lev`` is the Levenshtein edit distance (unit-cost insert / delete / substitute); capping ``d`` at ``len(t)`` means
reading many unrelated characters costs no more than reading nothing (Flow-GRPO). ``read`` joins every recognised
line (reading order as the detector returns it) whose confidence is at least ``min_confidence``.

The target is ``metadata["text"]`` when present, else the first double-quoted span of the prompt
(``'a sign that says "OPEN"'`` -> ``OPEN``); a sample with neither (or an empty target) scores NaN ("not
applicable"), never 0.

``mode="detect"`` runs text detection then recognition on each detected line (any layout); ``mode="recognize"``
skips detection and reads the whole image as one text line: about 50x faster, for images that are just the text.

The models (PP-OCRv4 detection and recognition, in ONNX) ship inside the ``rapidocr-onnxruntime`` wheel, so this
runs offline: ``pip install 'flowforge[ocr]'``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from flowforge.media import to_uint8
from flowforge.rewards.base import check_inputs

MODES = ("detect", "recognize")


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance between ``a`` and ``b`` (unit-cost insertions, deletions and substitutions)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def normalize_text(text: str) -> str:
    """Flow-GRPO's normalisation: spaces deleted, lower-cased."""
    return text.replace(" ", "").lower()


def ocr_reward(read: str, target: str) -> float:
    """``1 - min(d, len(t)) / len(t)`` with ``d = 0`` when ``t`` occurs in ``o`` (module docstring); NaN for an
    empty normalised target."""
    t, o = normalize_text(target), normalize_text(read)
    if not t:
        return float("nan")
    distance = 0 if t in o else min(edit_distance(o, t), len(t))
    return 1.0 - distance / len(t)


def target_text(prompt: str, metadata: dict[str, Any]) -> str | None:
    """``metadata["text"]``, else the first double-quoted span of ``prompt``, else None.

    Raises:
        ValueError: ``metadata["text"]`` is present but not a string."""
    if "text" in metadata:
        if not isinstance(metadata["text"], str):
            raise ValueError(f"metadata['text'] must be a string, got {type(metadata['text']).__name__}")
        return metadata["text"]
    parts = prompt.split('"')
    return parts[1] if len(parts) >= 3 else None


def import_rapidocr() -> Any:
    """The ``RapidOCR`` class.

    Raises:
        ImportError: ``rapidocr-onnxruntime`` is not installed (the message says how to install it)."""
    try:
        from rapidocr_onnxruntime import RapidOCR
    except ImportError as exc:
        raise ImportError("the ocr reward needs rapidocr-onnxruntime: pip install 'flowforge[ocr]'") from exc
    return RapidOCR


class OcrScorer:
    """Reward = 1 - normalised edit distance between the OCR reading and the target text (module docstring).

    Args:
        mode: ``"detect"`` (detection + recognition) or ``"recognize"`` (the whole image is one text line).
        min_confidence: recognised lines below this confidence (0..1) are ignored (RapidOCR's and PaddleOCR's
            default drop threshold, 0.5).
        num_threads: onnxruntime intra-op threads; -1 = onnxruntime's default (all cores).

    Raises:
        ValueError: a bad option. ImportError: ``rapidocr-onnxruntime`` is not installed.
    """

    name: ClassVar[str] = "ocr"
    needs_group: ClassVar[bool] = False

    def __init__(self, mode: str = "detect", min_confidence: float = 0.5, num_threads: int = -1) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
        if isinstance(min_confidence, bool) or not isinstance(min_confidence, (int, float)) \
                or not 0 <= min_confidence <= 1:
            raise ValueError(f"min_confidence must be a number in [0, 1], got {min_confidence!r}")
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or (num_threads < 1 and num_threads != -1):
            raise ValueError(f"num_threads must be an int >= 1 or -1 (onnxruntime's default), got {num_threads!r}")
        self.mode = mode
        self.min_confidence = float(min_confidence)
        self.engine = import_rapidocr()(text_score=self.min_confidence, intra_op_num_threads=num_threads,
                                        inter_op_num_threads=num_threads)

    def read(self, image: np.ndarray) -> str:
        """The text in one ``[H, W, 3]`` uint8 RGB image, recognised lines joined in the detector's order."""
        bgr = np.ascontiguousarray(image[:, :, ::-1])  # RapidOCR takes arrays in OpenCV's BGR order
        if self.mode == "recognize":
            lines, _ = self.engine(bgr, use_det=False, use_cls=False, use_rec=True)
            return "".join(text for text, score in (lines or []) if score >= self.min_confidence)
        lines, _ = self.engine(bgr, use_det=True, use_cls=False, use_rec=True)
        return "".join(line[1] for line in (lines or []) if line[2] >= self.min_confidence)

    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """``media [B, 3, H, W]`` in [0, 1] -> ``[B]`` float32 in [0, 1] on ``media``'s device; NaN for a sample
        without a target text.

        Raises:
            ValueError: bad shapes / lengths, or a non-string ``metadata["text"]``.
        """
        check_inputs(media, prompts, metadata)
        pixels = to_uint8(media).cpu().permute(0, 2, 3, 1)
        scores = []
        for image, prompt, meta in zip(pixels.numpy(), prompts, metadata):
            target = target_text(prompt, meta)
            scores.append(float("nan") if target is None else ocr_reward(self.read(image), target))
        return torch.tensor(scores, dtype=torch.float32, device=media.device)
