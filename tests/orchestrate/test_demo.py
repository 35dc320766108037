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
