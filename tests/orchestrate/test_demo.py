"""The pipeline demo's teacher: the requested digit read from the prompt text, scored by the demo classifier."""

from __future__ import annotations

import json

import pytest
import torch

from flowforge.demo.prompts import prompt_file
from flowforge.orchestrate.demo import PromptDigitScorer, prompt_digit
from flowforge.rewards.scorers.digit import DigitScorer


def test_every_demo_prompt_maps_to_its_digit():
    for name in ("train", "eval"):
        rows = [json.loads(line) for line in prompt_file(name).read_text().splitlines()]
        assert [prompt_digit(r["prompt"]) for r in rows] == [r["metadata"]["digit"] for r in rows]
    assert prompt_digit("  A HANDWRITTEN seven!") == 7 and prompt_digit("one handwritten character: nine") == 9
    with pytest.raises(ValueError, match="names no digit"):
        prompt_digit("a cat")


def test_the_teacher_scores_like_the_digit_reward_given_the_metadata():
    media = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    prompts = ["a handwritten seven", "the digit 3", "draw a zero", "digit: nine"]
    teacher = PromptDigitScorer()(media, prompts, [{}] * 4)
    reference = DigitScorer()(media, prompts, [{"digit": d} for d in (7, 3, 0, 9)])
    assert torch.equal(teacher, reference) and teacher.dtype == torch.float32
    other = PromptDigitScorer()(media, ["the digit 4"] * 4, [{}] * 4)
    assert not torch.equal(other, teacher)  # the prompt, not the metadata, decides


def test_the_legibility_teacher_grades_alike_whatever_the_group_and_prefers_clean_digits():
    """The graded teacher (:class:`LegibilityScorer`): an image's mark depends on the image and its prompt only
    (not on the other candidates, their number or order); a real held-out digit is marked higher for its own digit
    than for another; a clean real digit higher than the same digit blurred and faded; marks within one class of
    real digits differ (a scale, not a verdict)."""
    from flowforge.demo import data
    from flowforge.orchestrate.demo import LegibilityScorer

    images, labels = data.load_split("eval_clf")
    sevens = images[labels == 7][:8].expand(-1, 3, -1, -1)
    teacher = LegibilityScorer(augmentations=32)
    marks = teacher(sevens, ["a handwritten seven"] * 8, [{}] * 8)
    order = torch.tensor([5, 2, 7, 0, 1, 6, 3, 4])
    shuffled = teacher(sevens[order], ["a handwritten seven"] * 8, [{}] * 8)
    alone = teacher(sevens[3:4], ["a handwritten seven"], [{}])
    assert torch.equal(shuffled, marks[order]) and torch.equal(alone, marks[3:4])
    assert marks.dtype == torch.float32 and float(marks.min()) >= 0 and float(marks.max()) <= 1
    assert float(marks.std()) > 0.01
    other = teacher(sevens, ["a handwritten one"] * 8, [{}] * 8)
    assert bool((marks > other).all())
    blurred = torch.nn.functional.avg_pool2d(sevens, 5, stride=1, padding=2) * 0.5
    assert bool((teacher(blurred, ["a handwritten seven"] * 8, [{}] * 8) < marks).float().mean() >= 0.75)
    with pytest.raises(ValueError, match="augmentations must be an int >= 1"):
        LegibilityScorer(augmentations=0)


def test_the_fine_stroke_teacher_prefers_a_fine_dark_pen():
    """Issue 39 (digits demo): :class:`FineStrokeScorer` = the legibility mark x clamp(1 - ink / ink_scale, 0, 1)
    x clamp(peak / 0.9, 0, 1), ink the share of grey pixels above half the 99th-percentile peak. The same real sevens
    drawn with a thicker pen (a 3 x 3 max filter: the same digit, more ink) are marked lower, though the classifier
    still reads them; so are the sevens dimmed to half brightness (a faint digit is no fine pen, the hole a binary
    ink share at 0.5 would leave); a blank image earns 0."""
    from flowforge.demo import data
    from flowforge.demo.classifiers import to_gray32
    from flowforge.orchestrate.demo import FineStrokeScorer, LegibilityScorer

    images, labels = data.load_split("eval_clf")
    sevens = images[labels == 7][:8].expand(-1, 3, -1, -1)
    prompts, meta = ["a handwritten seven"] * 8, [{}] * 8
    teacher = FineStrokeScorer(augmentations=16, ink_scale=0.4)
    marks = teacher(sevens, prompts, meta)
    gray = to_gray32(sevens).flatten(1)
    peak = gray.quantile(0.99, dim=1)
    ink = (gray > peak[:, None] / 2).float().mean(dim=1)
    factor = (1 - ink / 0.4).clamp(0, 1) * (peak / 0.9).clamp(0, 1)
    expected = LegibilityScorer(augmentations=16)(sevens, prompts, meta) * factor
    assert torch.allclose(marks, expected) and marks.dtype == torch.float32
    bold = torch.nn.functional.max_pool2d(sevens, 3, stride=1, padding=1)
    assert bool((teacher(bold, prompts, meta) < marks).all())
    assert bool((teacher(sevens * 0.5, prompts, meta) < marks).all())
    assert float(teacher(torch.zeros(1, 3, 32, 32), prompts[:1], meta[:1])) == 0.0
    with pytest.raises(ValueError, match=r"ink_scale must be a number in \(0, 1\]"):
        FineStrokeScorer(ink_scale=0)


def test_legible_at_lets_the_pen_alone_mark_a_legible_digit():
    """``legible_at``: the legibility mark ``L`` enters as ``min(L / legible_at, 1)``, so among digits legible
    enough the pen alone decides the order (the tower, a legibility judge, then has little of it); a digit below
    ``legible_at`` is still scaled down by its legibility (the sevens asked for as threes)."""
    from flowforge.demo import data
    from flowforge.orchestrate.demo import FineStrokeScorer, LegibilityScorer

    images, labels = data.load_split("eval_clf")
    sevens = images[labels == 7][:8].expand(-1, 3, -1, -1)
    prompts, meta = ["a handwritten seven"] * 8, [{}] * 8
    plain = FineStrokeScorer(augmentations=16, ink_scale=0.4)
    gated = FineStrokeScorer(augmentations=16, ink_scale=0.4, legible_at=0.5)
    legibility = LegibilityScorer(augmentations=16)(sevens, prompts, meta)
    factor = plain(sevens, prompts, meta) / legibility  # the pen's factor, the same in both
    expected = (legibility / 0.5).clamp(max=1.0) * factor
    assert torch.allclose(gated(sevens, prompts, meta), expected, atol=1e-6)
    assert bool((legibility >= 0.5).any())  # some sevens are marked by the pen alone ...
    wrong = ["a handwritten three"] * 8  # ... and the wrong digit still earns (almost) nothing
    assert float(gated(sevens, wrong, meta).max()) < 0.5 * float(gated(sevens, prompts, meta).max())
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=r"legible_at must be a number in \(0, 1\]"):
            FineStrokeScorer(legible_at=bad)
