"""Name -> factory table of the built-in reward scorers (an explicit dict, no import-time magic).

``build_scorer("digit")``, ``build_scorer("jpeg_compressibility", quality=95)``. Options are passed to the factory
as keyword arguments; a wrong option raises the factory's own ``TypeError`` / ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flowforge.rewards.base import RewardScorer
from flowforge.rewards.clip_scorers import AestheticScorer, ClipScore, HPSv2Scorer, PickScore
from flowforge.rewards.digit import DigitEvalScorer, DigitScorer
from flowforge.rewards.jpeg import JpegCompressibility, JpegIncompressibility

SCORERS: dict[str, Callable[..., RewardScorer]] = {
    "digit": DigitScorer,
    "digit_eval": DigitEvalScorer,
    "jpeg_compressibility": JpegCompressibility,
    "jpeg_incompressibility": JpegIncompressibility,
    "pickscore": PickScore,
    "clip_score": ClipScore,
    "aesthetic": AestheticScorer,
    "hps": HPSv2Scorer,
}
"""Built-in scorer names and their factories."""


def build_scorer(name: str, **options: Any) -> RewardScorer:
    """Build the scorer registered as ``name`` with keyword ``options``.

    Raises:
        ValueError: ``name`` is not registered (the message lists the allowed names).
    """
    if name not in SCORERS:
        raise ValueError(f"unknown reward scorer {name!r}; allowed names: {sorted(SCORERS)}")
    return SCORERS[name](**options)
