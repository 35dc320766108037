"""Digit reward and DigitEval (:mod:`flowforge.rewards.scorers.digit`) on real held-out digits."""

import pytest
import torch

from flowforge.demo import data
from flowforge.rewards.registry import build_scorer
from flowforge.rewards.scorers.digit import DigitScorer


def real_digits(n=8, split="eval_clf"):
    """``(media [n, 3, H, W], labels [n])``: the first ``n`` digits of a real split, grey replicated to RGB."""
    images, labels = data.load_split(split)
    return images[:n].expand(-1, 3, -1, -1).contiguous(), labels[:n]


def test_digit_scorer_rewards_the_requested_digit():
    media, labels = real_digits(16)
    scorer = DigitScorer()
    right = scorer(media, ["p"] * 16, [{"digit": int(d)} for d in labels])
    wrong = scorer(media, ["p"] * 16, [{"digit": (int(d) + 1) % 10} for d in labels])
    assert right.shape == (16,) and right.dtype == torch.float32
    assert bool(((right >= 0) & (right <= 1)).all())
    assert right.mean() > 0.8 and wrong.mean() < 0.1
    assert bool((right > wrong).all())


def test_digit_scorer_matches_softmax_of_the_reward_classifier_and_batches():
    from flowforge.demo.classifiers import load_reward_classifier

    media, labels = real_digits(10)
    metadata = [{"digit": int(d)} for d in labels]
    expected = torch.softmax(load_reward_classifier()(media), dim=1)[torch.arange(10), labels]
    torch.testing.assert_close(DigitScorer(batch_size=3)(media, ["p"] * 10, metadata), expected)


def test_digit_scorer_metadata_errors():
    media = torch.zeros(2, 3, 32, 32)
    with pytest.raises(ValueError, match=r"sample 1: metadata has no 'digit' key and prompt 'b' names no digit"):
        DigitScorer()(media, ["a", "b"], [{"digit": 1}, {"task": "t2i"}])
    with pytest.raises(ValueError, match=r"prompt 'the 3 or the 4' names several digits \[3, 4\]"):
        DigitScorer()(media, ["a", "the 3 or the 4"], [{"digit": 1}, {}])
    with pytest.raises(ValueError, match=r"metadata\[0\]\['digit'\] must be an int in 0..9"):
        DigitScorer()(media, ["a", "b"], [{"digit": "7"}, {"digit": 1}])


def test_digit_eval_scorer_is_the_eval_classifier_argmax():
    from flowforge.demo.classifiers import load_eval_classifier
    from flowforge.demo.data import load_split

    images, labels = load_split("reward")
    media = images[:20].expand(-1, 3, -1, -1)
    wrong = (labels[:20] + 1) % 10
    meta = [{"digit": int(d)} for d in labels[:20]]
    hits = build_scorer("digit_eval")(media, ["p"] * 20, meta)
    expected = (load_eval_classifier()(media).argmax(1) == labels[:20]).float()
    assert torch.equal(hits, expected) and hits.mean() >= 0.9
    misses = build_scorer("digit_eval")(media, ["p"] * 20, [{"digit": int(d)} for d in wrong])
    assert misses.sum() <= 2


def test_digit_cap_is_min_of_probability_and_cap():
    media, labels = real_digits(16)
    metadata = [{"digit": int(d)} for d in labels]
    plain = DigitScorer()(media, ["p"] * 16, metadata)
    capped = build_scorer("digit", cap=0.8)(media, ["p"] * 16, metadata)
    torch.testing.assert_close(capped, torch.minimum(plain, torch.tensor(0.8)))
    assert bool((plain > 0.8).any()) and bool((capped == 0.8).any())  # real digits clear the cap and tie at it
    for bad in (0, 1.5, True, "high"):
        with pytest.raises(ValueError, match="digit cap"):
            DigitScorer(cap=bad)


def test_digit_scorer_reads_the_digit_from_the_prompt_when_metadata_has_none():
    """A prompt file without metadata.digit (a plain .txt file) or a judge request (the prompt only): the digit
    comes from the prompt, and the reward equals the one given the digit in metadata."""
    media, labels = real_digits(10)
    words = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
    prompts = [f"a handwritten {words[int(d)]}" if i % 2 else f"the number {int(d)}, please"
               for i, d in enumerate(labels)]
    scorer = DigitScorer()
    from_prompt = scorer(media, prompts, [{} for _ in prompts])
    from_metadata = scorer(media, prompts, [{"digit": int(d)} for d in labels])
    torch.testing.assert_close(from_prompt, from_metadata)
    # metadata wins over the prompt: the reward of the digit metadata names, not the prompt's
    wrong = scorer(media, ["a handwritten zero"] * 10, [{"digit": int(d)} for d in labels])
    torch.testing.assert_close(wrong, from_metadata)
