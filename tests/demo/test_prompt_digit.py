"""The digit a prompt asks for, read from its text (:func:`flowforge.demo.prompts.prompt_digit`): what the digit
reward uses for rows without ``metadata.digit`` (plain-text prompt files, judge requests)."""

from __future__ import annotations

import json

import pytest

from flowforge.demo.prompts import DIGIT_WORDS, EVAL_TEMPLATES, TRAIN_TEMPLATES, prompt_digit, prompt_file, render


def test_every_packaged_prompt_reads_as_its_metadata_digit():
    for name in ("train", "eval"):
        rows = [json.loads(line) for line in prompt_file(name).read_text().splitlines()]
        assert [prompt_digit(r["prompt"]) for r in rows] == [r["metadata"]["digit"] for r in rows]


def test_count_word_one_in_the_demo_phrasings_is_not_the_digit():
    # the templates that use "one" as a count word name another digit too: the lookup table decides those
    for template in (*TRAIN_TEMPLATES, *EVAL_TEMPLATES):
        for digit in range(10):
            assert prompt_digit(render(template, digit).upper() + "!") == digit


@pytest.mark.parametrize("prompt, digit", [
    ("a 7", 7), ("Seven, in red ink", 7), ("one 3 on a napkin", 3), ("one", 1), ("a big 1", 1),
    ("the digit zero drawn twice", 0), ("9 9 9", 9)])
def test_prompts_outside_the_demo_phrasings_name_one_digit(prompt, digit):
    assert prompt_digit(prompt) == digit


@pytest.mark.parametrize("prompt, message", [
    ("a cat", "names no digit"), ("", "names no digit"), ("12 apples", "names no digit"),
    ("3 or 4", r"several digits \[3, 4\]"), ("seven and 8", r"several digits \[7, 8\]"),
    ("1 and 2", r"several digits \[1, 2\]")])
def test_prompts_without_exactly_one_digit_are_refused(prompt, message):
    with pytest.raises(ValueError, match=message):
        prompt_digit(prompt)


def test_digit_words_are_the_ten_digits():
    assert len(DIGIT_WORDS) == 10 and prompt_digit(" ".join(["the", DIGIT_WORDS[4]])) == 4
