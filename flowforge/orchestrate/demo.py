"""The embedded pipeline demo's teacher: the digit reward classifier as a group judge that reads the prompt only.

A group judge sees what a paid multimodal judge would see -- the prompt text and the candidates' frames, nothing
from the prompt file's metadata -- so the requested digit must come from the prompt
(:func:`flowforge.demo.prompts.prompt_digit`: the demo's own phrasings, else the one digit the prompt names);
:class:`PromptDigitScorer` then scores each frame with the demo's reward classifier
(:class:`flowforge.rewards.scorers.digit.DigitScorer`: softmax probability of the requested digit, in [0, 1]).

Three teachers:

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
* :class:`FineStrokeScorer`, a teacher whose criterion the student's initialisation lacks: the right digit *in a fine
  pen* -- the legibility mark times a thinness factor ``clamp(1 - ink / ink_scale, 0, 1)`` (``ink``: the share of
  the 32 x 32 grey image above half its peak) and a contrast factor (a faint grey digit is no fine pen). The
  student's pretrained tower (``demo:digit-tower``, a prompt-digit matcher) does not hold it: on ``demo:base``'s
  images the tower's score agrees with the legibility mark at a mean within-prompt Spearman of 0.66 but with ink at
  only 0.30 (bolder digits read more confidently), the wrong sign for a fine pen (10 prompts x 16 images,
  2026-12-06). Its independent eval judges are DigitEval (the right digit, another network) and
  :class:`flowforge.demo.stroke.StrokeWidth` (the stroke width in pixels from area and boundary after an Otsu
  threshold: no classifier, no ink share, no peak). With ``legible_at`` (0.5 in ``examples/stages/digits_pen.yaml``)
  legibility counts only up to that level, so a group of legible digits is ordered by the pen alone: the tower then
  agrees with the mark at 0.13 +- 0.07 (0.36 +- 0.06 without it; ``bench/tower_agreement.py``, 40 prompts x 8 of
  ``demo:base``). Measured in ``docs/guides/pipeline.md``, "The fine-pen demo".

Serve one as the teacher of ``examples/stages/`` (``digits_pen.yaml``'s: with ``--options`` a YAML file holding
``legible_at: 0.5``, as the pipeline passes ``teacher.scorer_options``)::

    flowforge serve judge --scorer flowforge.orchestrate.demo:FineStrokeScorer --options pen.yaml --port 0
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from flowforge.demo.prompts import prompt_digit

__all__ = ["FineStrokeScorer", "LegibilityScorer", "PromptDigitScorer", "prompt_digit"]


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

    @staticmethod
    def option_problems(options: dict[str, Any]) -> list[str]:
        """What is wrong with these keyword options' values (``flowforge check`` calls it before anything loads)."""
        a = options.get("augmentations", 1)
        return [] if isinstance(a, int) and not isinstance(a, bool) and a >= 1 else [
            f"augmentations must be an int >= 1, got {a!r}"]

    def __init__(self, augmentations: int = 64, seed: int = 0) -> None:
        from flowforge.demo.classifiers import load_reward_classifier

        problems = LegibilityScorer.option_problems({"augmentations": augmentations})
        if problems:
            raise ValueError(problems[0])
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


class FineStrokeScorer(LegibilityScorer):
    """``[B, 3, H, W]`` in [0, 1] + prompts -> ``[B]`` float32 in [0, 1]: :class:`LegibilityScorer`'s mark times
    a thinness factor and a contrast factor: the requested digit, robustly legible, drawn with a fine dark pen.

    On the 32 x 32 grey image (:func:`flowforge.demo.classifiers.to_gray32`), with ``peak`` its 99th-percentile
    intensity: ``ink`` is the share of pixels above ``peak / 2`` (relative, so dimming a digit does not thin it),
    ``thin = clamp(1 - ink / ink_scale, 0, 1)`` and ``contrast = clamp(peak / 0.9, 0, 1)`` (a faint grey digit is
    not a fine pen: dimmed to half brightness it loses about half its mark). ``demo:base`` draws ink shares of
    0.05-0.13 (10th-90th percentile), so the default ``ink_scale`` 0.2 keeps ``thin`` in 0.35-0.75 there. A blank
    image has ``peak`` 0 and earns 0.

    With ``legible_at`` the legibility mark ``L`` enters as ``min(L / legible_at, 1)``: a digit legible enough is
    marked by its pen alone, so a group of legible digits is ordered by the pen (and a student that knows legibility
    only has little of the order); below ``legible_at`` legibility still scales the mark down.

    Args:
        augmentations, seed: as :class:`LegibilityScorer`. ink_scale: the ink share at which ``thin`` reaches 0,
            in (0, 1]. legible_at: the legibility mark from which legibility no longer counts, in (0, 1]; None:
            the mark is ``L`` itself.

    Raises:
        ValueError: ``ink_scale`` or ``legible_at`` outside (0, 1]; (``__call__``) as :class:`LegibilityScorer`.
    """

    name = "fine_stroke"

    @staticmethod
    def option_problems(options: dict[str, Any]) -> list[str]:
        """As :meth:`LegibilityScorer.option_problems`, with ``ink_scale`` and ``legible_at``."""
        problems = LegibilityScorer.option_problems(options)
        for key in ("ink_scale", "legible_at"):
            value = options.get(key, 1.0)
            if key == "legible_at" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
                problems.append(f"{key} must be a number in (0, 1], got {value!r}")
        return problems

    def __init__(self, augmentations: int = 64, seed: int = 0, ink_scale: float = 0.2,
                 legible_at: float | None = None) -> None:
        problems = FineStrokeScorer.option_problems({"ink_scale": ink_scale, "legible_at": legible_at})
        if problems:
            raise ValueError(problems[0])
        super().__init__(augmentations=augmentations, seed=seed)
        self.ink_scale = float(ink_scale)
        self.legible_at = None if legible_at is None else float(legible_at)

    @torch.no_grad()
    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        from flowforge.demo.classifiers import to_gray32

        legibility = super().__call__(media, prompts, metadata)
        if not len(legibility):
            return legibility
        gray = to_gray32(media.detach().cpu()).flatten(1)  # [B, 1024]
        peak = gray.quantile(0.99, dim=1)  # [B]
        ink = (gray > peak[:, None] / 2).float().mean(dim=1) * (peak > 0)
        factor = (1.0 - ink / self.ink_scale).clamp(0.0, 1.0) * (peak / 0.9).clamp(0.0, 1.0)
        if self.legible_at is not None:
            legibility = (legibility / self.legible_at).clamp(max=1.0)
        return (legibility * factor.to(legibility.device)).float()
