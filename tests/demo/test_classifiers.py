"""Packaged digit classifiers: weights load, held-out accuracy, independence, input handling, DigitEval helpers."""

import pytest
import torch

from flowforge.demo import classifiers, data

# Measured on the packaged weights (python -m flowforge.demo.classifiers evaluate): RewardNet 0.982 on "eval_clf"
# and 0.978 on "sft"; EvalNet 0.966 on "reward" and 0.965 on "sft". With a grey background and noise (the test
# below): 0.983 and 0.967. Mean top-class probability on outlier noise: 0.11 and 0.11 (chance is 0.10).
HELD_OUT_BAR = 0.95
ROBUST_BAR = 0.95
NOISE_CONFIDENCE_BAR = 0.3


def test_weights_load_frozen_in_eval_mode_and_are_small():
    for path in (classifiers.REWARD_WEIGHTS, classifiers.EVAL_WEIGHTS):
        assert path.stat().st_size < 1_000_000
    for model in (classifiers.load_reward_classifier(), classifiers.load_eval_classifier()):
        assert not model.training
        assert all(not p.requires_grad for p in model.parameters())
    assert classifiers.load_reward_classifier() is classifiers.load_reward_classifier()


def test_classifiers_differ_in_architecture_and_weights():
    reward, evaluator = classifiers.load_reward_classifier(), classifiers.load_eval_classifier()
    assert type(reward) is not type(evaluator)
    reward_shapes = sorted(tuple(p.shape) for p in reward.parameters())
    eval_shapes = sorted(tuple(p.shape) for p in evaluator.parameters())
    assert reward_shapes != eval_shapes


@pytest.mark.parametrize(
    "loader, unseen_split",
    [(classifiers.load_reward_classifier, "eval_clf"), (classifiers.load_eval_classifier, "reward")],
)
def test_accuracy_on_the_split_each_classifier_never_saw(loader, unseen_split):
    images, labels = data.load_split(unseen_split)
    accuracy = classifiers.digit_eval_accuracy(images, labels, model=loader())
    assert accuracy >= HELD_OUT_BAR


def test_rgb_and_grey_inputs_agree_and_other_sizes_are_resized():
    images, labels = data.load_split("eval_clf")
    images, labels = images[:64], labels[:64]
    model = classifiers.load_reward_classifier()
    grey = classifiers.predict_logits(model, images)
    rgb = classifiers.predict_logits(model, images.expand(-1, 3, -1, -1))
    assert grey.shape == (64, 10) and grey.dtype == torch.float32
    torch.testing.assert_close(grey, rgb)
    big = torch.nn.functional.interpolate(images, size=(64, 64), mode="bilinear", align_corners=False)
    assert (classifiers.predict_logits(model, big).argmax(1) == labels).float().mean() > 0.8


def test_digit_eval_default_model_and_wrong_digits():
    images, labels = data.load_split("reward")
    images, labels = images[:50], labels[:50]
    correct = classifiers.digit_eval(images, labels)
    assert correct.dtype == torch.bool and correct.shape == (50,)
    assert correct.float().mean() > 0.9
    wrong = classifiers.digit_eval(images, (labels + 1) % 10)
    assert wrong.float().mean() < 0.1
    assert classifiers.digit_eval_accuracy(images, labels.tolist()) == pytest.approx(correct.float().mean().item())


def test_digit_eval_errors():
    images = torch.zeros(2, 1, 32, 32)
    with pytest.raises(ValueError, match="one entry per image"):
        classifiers.digit_eval(images, [1])
    with pytest.raises(ValueError, match="0..9"):
        classifiers.digit_eval(images, [1, 10])
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        classifiers.digit_eval(torch.zeros(2, 2, 32, 32), [1, 2])
    with pytest.raises(ValueError, match="empty batch"):
        classifiers.digit_eval_accuracy(torch.zeros(0, 1, 32, 32), [])
    with pytest.raises(ValueError, match=r"\['reward', 'eval'\]"):
        classifiers.train_classifier("both")


def test_augment_keeps_range_shape_and_is_seeded():
    images, _ = data.load_split("eval_clf")
    images = images[:16]
    a = classifiers.augment(images, torch.Generator().manual_seed(0))
    b = classifiers.augment(images, torch.Generator().manual_seed(0))
    c = classifiers.augment(images, torch.Generator().manual_seed(1))
    assert a.shape == images.shape and float(a.min()) >= 0.0 and float(a.max()) <= 1.0
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(a, images)


@pytest.mark.parametrize(
    "loader, unseen_split",
    [(classifiers.load_reward_classifier, "eval_clf"), (classifiers.load_eval_classifier, "reward")],
)
def test_accuracy_holds_on_grey_background_and_noise(loader, unseen_split):
    images, labels = data.load_split(unseen_split)
    noise = 0.1 * torch.randn(images.shape, generator=torch.Generator().manual_seed(0))
    degraded = (0.1 + 0.8 * images + noise).clamp(0.0, 1.0)
    assert classifiers.digit_eval_accuracy(degraded, labels, model=loader()) >= ROBUST_BAR


@pytest.mark.parametrize("loader", [classifiers.load_reward_classifier, classifiers.load_eval_classifier])
def test_noise_is_not_a_confident_digit(loader):
    noise = classifiers.outlier_images(200, torch.Generator().manual_seed(3))
    assert noise.shape == (200, 1, 32, 32) and float(noise.min()) >= 0.0 and float(noise.max()) <= 1.0
    probabilities = torch.softmax(classifiers.predict_logits(loader(), noise), dim=1)
    assert probabilities.max(dim=1).values.mean() < NOISE_CONFIDENCE_BAR
