"""The embedded pipeline demo's teacher: the digit reward classifier as a group judge that reads the prompt only.

A group judge sees what a paid multimodal judge would see -- the prompt text and the candidates' frames, nothing
from the prompt file's metadata -- so the requested digit must come from the prompt. :func:`prompt_digit` looks the
prompt up in the demo's own phrasings (:mod:`flowforge.demo.prompts`: every train and eval template rendered for
every digit); :class:`PromptDigitScorer` then scores each frame with the demo's reward classifier
(:class:`flowforge.rewards.scorers.digit.DigitScorer`: softmax probability of the requested digit, in [0, 1]).

Serve it as the teacher of ``examples/stages/``::

    flowforge serve judge --scorer flowforge.orchestrate.demo:PromptDigitScorer --port 0
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, ClassVar

from torch import Tensor


@functools.lru_cache(maxsize=1)
def _digit_table() -> dict[str, int]:
    from flowforge.demo.prompts import EVAL_TEMPLATES, TRAIN_TEMPLATES, render
    from flowforge.data.clusters import normalise_text

    return {normalise_text(render(t, d)): d for t in (*TRAIN_TEMPLATES, *EVAL_TEMPLATES) for d in range(10)}


def prompt_digit(prompt: str) -> int:
    """The digit (0..9) a demo prompt asks for, matched after :func:`~flowforge.data.clusters.normalise_text`
    (case, punctuation and spacing ignored).

    Raises:
        ValueError: the prompt is none of the demo's phrasings.
    """
    from flowforge.data.clusters import normalise_text

    digit = _digit_table().get(normalise_text(prompt))
    if digit is None:
        raise ValueError(f"prompt {prompt!r} is not one of the digits demo's phrasings (flowforge.demo.prompts)")
    return digit


class PromptDigitScorer:
    """``[B, 3, H, W]`` in [0, 1] + prompts -> ``[B]`` float32: the demo reward classifier's probability of the
    digit each prompt asks for (:func:`prompt_digit`); metadata is not read.

    Args:
        batch_size: images per classifier forward (:class:`~flowforge.rewards.scorers.digit.DigitScorer`).

    Raises (``__call__``):
        ValueError: a prompt outside the demo's phrasings; bad shapes.
    """

    name = "prompt_digit"
    needs_group: ClassVar[bool] = False

    def __init__(self, batch_size: int = 256) -> None:
        from flowforge.rewards.scorers.digit import DigitScorer

        self.inner = DigitScorer(batch_size=batch_size)

    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        return self.inner(media, prompts, [{"digit": prompt_digit(p)} for p in prompts])
