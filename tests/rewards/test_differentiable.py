"""Differentiable rewards: the digit reward's gradient reaches the images; the weighted sum refuses what has none."""

import pytest
import torch

from flowforge.rewards.differentiable import DifferentiableReward, declares_differentiable, non_differentiable
from flowforge.rewards.scorers.digit import DigitEvalScorer, DigitScorer


def test_digit_reward_is_differentiable_in_the_images_and_digit_eval_is_not():
    images = torch.rand(3, 3, 32, 32, requires_grad=True)
    meta = [{"digit": d} for d in (1, 7, 3)]
    scorer = DigitScorer()
    r = scorer(images, ["a"] * 3, meta)
    r.sum().backward()
    assert images.grad is not None and images.grad.abs().sum() > 0
    # the gradient is the reward's: a small step along it raises the reward
    with torch.no_grad():
        stepped = scorer((images + 1e-3 * images.grad / images.grad.norm()).clamp(0, 1), ["a"] * 3, meta)
    assert float(stepped.sum()) > float(r.detach().sum())
    assert declares_differentiable("digit") and not declares_differentiable("digit_eval")
    assert not declares_differentiable("jpeg_compressibility") and not declares_differentiable("no_such_scorer")
    assert non_differentiable({"digit": 1.0, "digit_eval": 0.0, "jpeg_compressibility": 0.5}) == \
        ["jpeg_compressibility"]


def test_weighted_sum_and_refusals():
    digit = DigitScorer()
    images = torch.rand(2, 3, 32, 32, requires_grad=True)
    meta = [{"digit": 4}, {"digit": 9}]
    fn = DifferentiableReward({"digit": digit, "digit_eval": DigitEvalScorer()}, {"digit": 0.5, "digit_eval": 0.0})
    total = fn(images, ["p", "q"], meta)
    assert total.requires_grad
    torch.testing.assert_close(total.detach(), 0.5 * digit(images, ["p", "q"], meta).detach())
    video = torch.rand(2, 3, 2, 32, 32)  # frames averaged per video, as the reward processor does
    frames = [digit(video[:, :, f], ["p", "q"], meta) for f in range(2)]
    torch.testing.assert_close(fn(video, ["p", "q"], meta), 0.25 * (frames[0] + frames[1]))
    with pytest.raises(ValueError, match=r"reward.weights: \['digit_eval'\]"):
        DifferentiableReward({"digit_eval": DigitEvalScorer()}, {"digit_eval": 1.0})
    with pytest.raises(ValueError, match="not among the scorers"):
        DifferentiableReward({"digit": digit}, {"other": 1.0})


def test_nan_score_is_an_error():
    class Partial:
        name, needs_group, differentiable = "partial", False, True

        def __call__(self, media, prompts, metadata):
            return torch.tensor([1.0, float("nan")])

    with pytest.raises(ValueError, match="NaN on 1 of 2"):
        DifferentiableReward({"partial": Partial()}, {"partial": 1.0})(torch.rand(2, 3, 8, 8), ["a", "b"], [{}, {}])
