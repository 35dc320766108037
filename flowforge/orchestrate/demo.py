"""The embedded pipeline demo's teacher: the digit reward classifier as a group judge that reads the prompt only.

A group judge sees what a paid multimodal judge would see -- the prompt text and the candidates' frames, nothing
from the prompt file's metadata -- so the requested digit must come from the prompt
(:func:`flowforge.demo.prompts.prompt_digit`: the demo's own phrasings, else the one digit the prompt names);
:class:`PromptDigitScorer` then scores each frame with the demo's reward classifier
(:class:`flowforge.rewards.scorers.digit.DigitScorer`: softmax probability of the requested digit, in [0, 1]).

Serve it as the teacher of ``examples/stages/``::

    flowforge serve judge --scorer flowforge.orchestrate.demo:PromptDigitScorer --port 0
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from torch import Tensor

from flowforge.demo.prompts import prompt_digit

__all__ = ["PromptDigitScorer", "prompt_digit"]


class PromptDigitScorer:
    """``[B, 3, H, W]`` in [0, 1] + prompts -> ``[B]`` float32: the demo reward classifier's probability of the
    digit each prompt asks for (:func:`prompt_digit`); metadata is not read.

    Args:
        batch_size: images per classifier forward (:class:`~flowforge.rewards.scorers.digit.DigitScorer`).

    Raises (``__call__``):
        ValueError: a prompt that names no digit or several; bad shapes.
    """

    name = "prompt_digit"
    needs_group: ClassVar[bool] = False

    def __init__(self, batch_size: int = 256) -> None:
        from flowforge.rewards.scorers.digit import DigitScorer

        self.inner = DigitScorer(batch_size=batch_size)

    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        return self.inner(media, prompts, [{"digit": prompt_digit(p)} for p in prompts])
