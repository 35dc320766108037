"""The embedded pipeline demo's teacher: the digit reward classifier as a group judge that reads the prompt only.

A group judge sees what a paid multimodal judge would see -- the prompt text and the candidates' frames, nothing
from the prompt file's metadata -- so the requested digit must come from the prompt
(:func:`flowforge.demo.prompts.prompt_digit`: the demo's own phrasings, else the one digit the prompt names);
:class:`PromptDigitScorer` then scores each frame with the demo's reward classifier
(:class:`flowforge.rewards.scorers.digit.DigitScorer`: softmax probability of the requested digit, in [0, 1]).

Two teachers:

* :class:`PromptDigitScorer`: the reward classifier's probability of the requested digit. On a policy that already
  draws the right digit it marks the candidates of one group nearly alike (the classifier is confident on all of
  them), so there is little ranking for a student to learn.
* :class:`LegibilityScorer`, the teacher of ``examples/stages/digits.yaml``: a graded mark, the way a multimodal
  judge's 0-100 marks differ within a group -- how *robustly* legible the digit is: the same classifier's
  probability of the requested digit averaged over ``augmentations`` fixed random distortions of the image (rotation,
  scale, shear, shift, stroke width, blur, contrast, background, noise: :func:`flowforge.demo.classifiers.augment`).
  A clean, well-formed digit stays readable under all of them; a thin, broken, off-centre or ambiguous one loses the
  classifier under some, so its mark drops. It costs ``augmentations`` classifier passes per candidate (64 by
  default), against the student's one.

Serve one as the teacher of ``examples/stages/``::

    flowforge serve judge --scorer flowforge.orchestrate.demo:LegibilityScorer --port 0
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from flowforge.demo.prompts import prompt_digit

__all__ = ["LegibilityScorer", "PromptDigitScorer", "prompt_digit"]


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


class LegibilityScorer:
    """``[B, 3, H, W]`` in [0, 1] + prompts -> ``[B]`` float32 in [0, 1]: the demo reward classifier's probability
    of the digit each prompt asks for (:func:`prompt_digit`), averaged over ``augmentations`` distortions of the
    image (module docstring); metadata is not read.

    The distortions are drawn once from ``seed`` and applied to every image alike, so an image's mark depends on the
    image and its prompt only -- not on the other candidates of its group, their number or their order.

    Args:
        augmentations: distortions per image, >= 1. seed: their draw.

    Raises (``__call__``):
        ValueError: a prompt that names no digit or several; bad shapes.
    """

    name = "legibility"
    needs_group: ClassVar[bool] = False

    def __init__(self, augmentations: int = 64, seed: int = 0) -> None:
        from flowforge.demo.classifiers import load_reward_classifier

        if isinstance(augmentations, bool) or not isinstance(augmentations, int) or augmentations < 1:
            raise ValueError(f"augmentations must be an int >= 1, got {augmentations!r}")
        self.augmentations, self.seed = augmentations, int(seed)
        self.model = load_reward_classifier()

    @torch.no_grad()
    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        from flowforge.demo.classifiers import augment, to_gray32
        from flowforge.rewards.base import check_inputs

        check_inputs(media, prompts, metadata)
        digits = [prompt_digit(p) for p in prompts]
        gray = to_gray32(media.detach().cpu())
        marks = []
        for image, digit in zip(gray, digits, strict=True):
            copies = image[None].expand(self.augmentations, -1, -1, -1)
            # the same generator state for every image: the k-th distortion is the same for all of them
            distorted = augment(copies, torch.Generator().manual_seed(self.seed))
            marks.append(self.model(distorted).softmax(dim=1)[:, digit].mean())
        return torch.stack(marks).float().to(media.device) if marks else torch.zeros(0, device=media.device)
