"""Reward scorers (JPEG, digit), the registry and the reward processor."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from flowforge.demo import data
from flowforge.rewards.base import RewardScorer
from flowforge.rewards.digit import DigitScorer
from flowforge.rewards.jpeg import JpegCompressibility, JpegIncompressibility, jpeg_size_kb
from flowforge.rewards.processor import RewardProcessor
from flowforge.rewards.registry import SCORERS, build_scorer


def _digits(n=8, split="eval_clf"):
    images, labels = data.load_split(split)
    return images[:n].expand(-1, 3, -1, -1).contiguous(), labels[:n]


def test_jpeg_size_matches_pillow_directly():
    gen = torch.Generator().manual_seed(0)
    media = torch.rand(2, 3, 16, 24, generator=gen)
    expected = []
    for image in media:
        array = (image.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(array)).save(buffer, format="JPEG", quality=95)
        expected.append(len(buffer.getvalue()) / 1000)
    sizes = jpeg_size_kb(media)
    assert sizes.dtype == torch.float32 and sizes.shape == (2,)
    torch.testing.assert_close(sizes, torch.tensor(expected))


def test_jpeg_rewards_order_flat_and_noisy_images():
    flat = torch.full((1, 3, 32, 32), 0.5)
    noisy = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    media = torch.cat([flat, noisy])
    prompts, metadata = ["a", "b"], [{}, {}]
    compress = JpegCompressibility()(media, prompts, metadata)
    incompress = JpegIncompressibility()(media, prompts, metadata)
    assert compress[0] > compress[1] and incompress[1] > incompress[0]
    torch.testing.assert_close(compress, -incompress)
    assert bool((compress < 0).all())


def test_jpeg_input_errors():
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        JpegCompressibility()(torch.zeros(1, 1, 8, 8), ["a"], [{}])
    with pytest.raises(ValueError, match="prompts"):
        JpegCompressibility()(torch.zeros(2, 3, 8, 8), ["a"], [{}, {}])
    with pytest.raises(ValueError, match="floating"):
        JpegCompressibility()(torch.zeros(1, 3, 8, 8, dtype=torch.uint8), ["a"], [{}])
    with pytest.raises(ValueError, match="quality"):
        JpegCompressibility(quality=100)


def test_digit_scorer_rewards_the_requested_digit():
    media, labels = _digits(16)
    scorer = DigitScorer()
    right = scorer(media, ["p"] * 16, [{"digit": int(d)} for d in labels])
    wrong = scorer(media, ["p"] * 16, [{"digit": (int(d) + 1) % 10} for d in labels])
    assert right.shape == (16,) and right.dtype == torch.float32
    assert bool(((right >= 0) & (right <= 1)).all())
    assert right.mean() > 0.8 and wrong.mean() < 0.1
    assert bool((right > wrong).all())


def test_digit_scorer_matches_softmax_of_the_reward_classifier_and_batches():
    from flowforge.demo.classifiers import load_reward_classifier

    media, labels = _digits(10)
    metadata = [{"digit": int(d)} for d in labels]
    expected = torch.softmax(load_reward_classifier()(media), dim=1)[torch.arange(10), labels]
    torch.testing.assert_close(DigitScorer(batch_size=3)(media, ["p"] * 10, metadata), expected)


def test_digit_scorer_metadata_errors():
    media = torch.zeros(2, 3, 32, 32)
    with pytest.raises(ValueError, match=r"metadata\[1\] has no 'digit'"):
        DigitScorer()(media, ["a", "b"], [{"digit": 1}, {"task": "t2i"}])
    with pytest.raises(ValueError, match=r"metadata\[0\]\['digit'\] must be an int in 0..9"):
        DigitScorer()(media, ["a", "b"], [{"digit": "7"}, {"digit": 1}])


def test_registry_builds_every_scorer_and_lists_names_on_error():
    builtin = ("digit", "digit_eval", "jpeg_compressibility", "jpeg_incompressibility")
    assert set(SCORERS) >= set(builtin)
    for name in builtin:
        scorer = build_scorer(name)
        assert isinstance(scorer, RewardScorer)
        assert scorer.name == name and scorer.needs_group is False
    assert build_scorer("jpeg_compressibility", quality=50).quality == 50
    with pytest.raises(ValueError, match="allowed names.*digit.*jpeg_compressibility.*jpeg_incompressibility"):
        build_scorer("clip")


class _Constant:
    """Test scorer: returns fixed values and records the batch sizes it was called with."""

    needs_group = False

    def __init__(self, name, values):
        self.name, self.values, self.calls = name, torch.tensor(values, dtype=torch.float32), []

    def __call__(self, media, prompts, metadata):
        index = torch.tensor([m["i"] for m in metadata])
        self.calls.append(index.tolist())
        return self.values[index]


def _batch(n):
    return torch.zeros(n, 3, 8, 8), [f"p{i}" for i in range(n)], [{"i": i} for i in range(n)]


def test_processor_scores_components_in_batches_with_metrics():
    values = [1.0, 2.0, 3.0, 4.0, float("nan")]
    optional = _Constant("opt", values)
    required = _Constant("req", [0.0, 1.0, 0.0, 1.0, 0.0])
    processor = RewardProcessor({"req": required, "opt": optional}, {"req": 1.0, "opt": 0.5}, ["req"], batch_size=2)
    components, metrics = processor(*_batch(5))
    assert list(components) == ["req", "opt"]
    torch.testing.assert_close(components["opt"], torch.tensor(values), equal_nan=True)
    assert optional.calls == [[0, 1], [2, 3], [4]]
    assert metrics["reward/opt_mean"] == pytest.approx(2.5)
    assert metrics["reward/opt_std"] == pytest.approx(np.std([1, 2, 3, 4]))
    assert metrics["reward/opt_nan_fraction"] == pytest.approx(0.2)
    assert metrics["reward/req_mean"] == pytest.approx(0.4)
    for key in ("reward/req_time", "reward/opt_time", "reward/score_time"):
        assert metrics[key] >= 0.0
    assert metrics["reward/score_time"] >= metrics["reward/req_time"]


def test_processor_nan_in_required_component_names_component_and_sample():
    scorer = _Constant("req", [0.0, 0.0, float("nan"), float("nan")])
    processor = RewardProcessor({"req": scorer}, {"req": 1.0}, ["req"])
    with pytest.raises(ValueError, match=r"'req' scored NaN for sample 2 \(2 of 4"):
        processor(*_batch(4))


def test_processor_calls_group_scorers_once_per_group():
    scorer = _Constant("rank", [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    scorer.needs_group = True
    processor = RewardProcessor({"rank": scorer}, {"rank": 1.0}, batch_size=1)
    processor(*_batch(6), group_ids=torch.tensor([0, 0, 0, 1, 1, 1]))
    assert scorer.calls == [[0, 1, 2], [3, 4, 5]]
    scorer.calls.clear()
    processor(*_batch(6))
    assert scorer.calls == [[0, 1, 2, 3, 4, 5]]


def test_processor_with_real_scorers():
    media, labels = _digits(6)
    processor = RewardProcessor(
        {"digit": build_scorer("digit"), "jpeg_compressibility": build_scorer("jpeg_compressibility")},
        {"digit": 1.0},
        ["digit"],
        batch_size=4,
    )
    components, metrics = processor(media, ["p"] * 6, [{"digit": int(d)} for d in labels])
    assert components["digit"].shape == components["jpeg_compressibility"].shape == (6,)
    assert metrics["reward/digit_mean"] > 0.8
    assert metrics["reward/jpeg_compressibility_mean"] < 0


@pytest.mark.parametrize(
    "weights, required, match",
    [
        ({"b": 1.0}, ["a"], "required reward component 'a' has no weight"),
        ({"x": 1.0}, [], r"weights names unknown reward component 'x'; known components: \['a', 'b'\]"),
        ({"a": 1.0}, ["y"], "required names unknown reward component 'y'"),
        ({"a": float("inf")}, [], r"weights\['a'\] must be a finite number"),
    ],
)
def test_processor_validation(weights, required, match):
    scorers = {"a": _Constant("a", [0.0]), "b": _Constant("b", [0.0])}
    with pytest.raises(ValueError, match=match):
        RewardProcessor(scorers, weights, required)


def test_processor_rejects_wrong_output_shape_and_empty_scorers():
    processor = RewardProcessor({"bad": lambda media, prompts, metadata: torch.zeros(3)}, {})
    with pytest.raises(ValueError, match=r"'bad' returned \(3,\), expected a \[2\] tensor"):
        processor(*_batch(2))
    with pytest.raises(ValueError, match="at least one"):
        RewardProcessor({}, {})


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
