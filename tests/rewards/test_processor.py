"""The reward processor (:mod:`flowforge.rewards.processor`) on its own, with tiny scorers written here, plus one
run with the real digit / JPEG scorers.

What the processor promises (and what is tested): raw per-component scores ``[B]`` float32 on the media's device in
the order of ``scorers``, never multiplied by the weights (the weighted combination lives in
``flowforge.algorithms.advantages``, fed with ``components`` and ``processor.weights``); NaN in a required component
raises, NaN elsewhere is kept and left out of the statistics; ``batch_size`` only changes how scorers are called;
``needs_group`` scorers see whole groups.
"""

import math

import numpy as np
import pytest
import torch

from flowforge.algorithms.advantages import combine_components
from flowforge.rewards.processor import RewardProcessor
from flowforge.rewards.registry import build_scorer
from tests.rewards.scorers.test_digit import real_digits


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


def test_paid_scorers_score_only_the_first_paid_groups_and_none_with_zero():
    """Evaluation (``paid_groups``): a ``paid = True`` scorer is asked only for the rows of the N smallest group ids,
    NaN elsewhere, and not at all with 0; a free scorer scores every row either way."""
    paid = _Constant("judge", [0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    paid.needs_group, paid.paid = True, True
    free = _Constant("free", [1.0] * 6)
    processor = RewardProcessor({"free": free, "judge": paid}, {"judge": 1.0})
    ids = torch.tensor([2, 2, 0, 0, 1, 1])
    components, metrics = processor(*_batch(6), group_ids=ids, paid_groups=2)
    assert paid.calls == [[2, 3], [4, 5]] and free.calls == [[0, 1, 2, 3, 4, 5]]
    torch.testing.assert_close(components["judge"], torch.tensor([math.nan, math.nan, 0.3, 0.4, 0.5, 0.6]),
                               equal_nan=True)
    assert metrics["reward/judge_groups_scored"] == 2 and metrics["reward/judge_nan_fraction"] == 0.0
    paid.calls.clear()
    components, metrics = processor(*_batch(6), group_ids=ids, paid_groups=0)
    assert paid.calls == [] and list(components) == ["free"] and "reward/judge_mean" not in metrics
    components, _ = processor(*_batch(6), group_ids=ids)  # training: every row
    assert paid.calls == [[2, 3], [4, 5], [0, 1]] and not torch.isnan(components["judge"]).any()
    with pytest.raises(ValueError, match="paid_groups=1 needs group_ids"):
        processor(*_batch(6), paid_groups=1)


def test_a_paid_scorer_without_a_weight_is_never_called_on_a_training_step():
    """A paid monitor-only scorer (a judge in ``eval.scorers`` only) trains nothing, and each call is billed: a
    training call (``paid_groups=None``), sequential or streamed, leaves it out; evaluation still asks it. Was: called
    (and billed) on every training step."""
    paid = _Constant("judge", [0.1, 0.2, 0.3, 0.4])
    paid.needs_group, paid.paid = True, True
    free = _Constant("free", [1.0] * 4)
    processor = RewardProcessor({"free": free, "judge": paid}, {"free": 1.0})
    assert list(processor.training_scorers()) == ["free"]
    ids = torch.tensor([0, 0, 1, 1])
    components, metrics = processor(*_batch(4), group_ids=ids)
    assert paid.calls == [] and list(components) == ["free"] and "reward/judge_mean" not in metrics
    media, prompts, metadata = _batch(4)
    stream = processor.stream(prompts, metadata, ids)
    stream.add(torch.arange(4), media)
    _, components, _ = stream.finish()
    assert paid.calls == [] and list(components) == ["free"]
    components, _ = processor(*_batch(4), group_ids=ids, paid_groups=1)  # evaluation: the first group
    assert paid.calls == [[0, 1]] and components["judge"][:2].tolist() == pytest.approx([0.1, 0.2])


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
    media, labels = real_digits(6)
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


# ------------------------------------------------------------------------------------------------ direct tests


class _PerSample:
    """Test scorer whose score of a sample depends on that sample's image, prompt and metadata only:
    ``mean pixel + len(prompt) + 100 * metadata["i"]``, returned in ``dtype``. Records each call's rows."""

    needs_group = False

    def __init__(self, name="per_sample", dtype=torch.float32):
        self.name, self.dtype, self.calls = name, dtype, []

    def __call__(self, media, prompts, metadata):
        self.calls.append([m["i"] for m in metadata])
        lengths = torch.tensor([float(len(p)) for p in prompts])
        rows = torch.tensor([100.0 * m["i"] for m in metadata])
        return (media.mean(dim=(1, 2, 3)) + lengths + rows).to(self.dtype)


class _RankInGroup:
    """Group test scorer: rank (0 = lowest) of each image's mean pixel among the images it is called with.
    Records each call's rows and prompts."""

    needs_group = True

    def __init__(self):
        self.name, self.calls, self.prompts = "rank", [], []

    def __call__(self, media, prompts, metadata):
        self.calls.append([m["i"] for m in metadata])
        self.prompts.append(list(prompts))
        return media.mean(dim=(1, 2, 3)).argsort().argsort().float()


def _graded_batch(levels, prompts=None):
    """Images filled with the given grey levels; metadata ``{"i": index}``."""
    media = torch.tensor(levels, dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, 3, 4, 4).contiguous()
    prompts = prompts if prompts is not None else [f"p{'x' * i}" for i in range(len(levels))]
    return media, prompts, [{"i": i} for i in range(len(levels))]


def test_processor_returns_raw_scores_and_weights_feed_the_advantage_combination():
    a = _Constant("a", [1.0, 2.0, 3.0, 4.0])
    b = _Constant("b", [10.0, 0.0, 10.0, 0.0])
    monitor = _Constant("monitor", [float("nan"), 1.0, float("nan"), 1.0])  # no weight: logged, never optimised
    processor = RewardProcessor({"a": a, "b": b, "monitor": monitor}, {"a": 2, "b": 0.5}, ["a"])
    assert processor.weights == {"a": 2.0, "b": 0.5} and all(type(w) is float for w in processor.weights.values())
    components, metrics = processor(*_batch(4))
    assert list(components) == ["a", "b", "monitor"]
    # the weights are not applied by the processor: components are the scorers' raw values
    assert torch.equal(components["a"], torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert torch.equal(components["b"], torch.tensor([10.0, 0.0, 10.0, 0.0]))
    unit = RewardProcessor({"a": a, "b": b}, {"a": 1.0, "b": 1.0})(*_batch(4))[0]
    assert torch.equal(unit["a"], components["a"]) and torch.equal(unit["b"], components["b"])
    assert metrics["reward/a_mean"] == pytest.approx(2.5)  # statistics of the raw score, not of 2 * a
    # the total as the trainer forms it, sum_k w_k r_k, by hand: 2 * a + 0.5 * b
    total = sum(weight * components[name] for name, weight in processor.weights.items())
    assert torch.equal(total, torch.tensor([7.0, 4.0, 11.0, 8.0]))
    # group-relative advantage of that total (groups {0, 1}, {2, 3}; means 5.5 and 9.5); the NaN monitor is ignored
    group_ids = torch.tensor([0, 0, 1, 1])
    advantages = combine_components(components, processor.weights, group_ids, mode="weighted_sum", std_mode="none")
    torch.testing.assert_close(advantages, torch.tensor([1.5, -1.5, 1.5, -1.5]))


def test_optional_nan_is_kept_in_place_and_left_out_of_the_statistics():
    nan = float("nan")
    partly = _Constant("partly", [nan, 2.0, nan, 6.0])  # weighted, not required
    never = _Constant("never", [nan, nan, nan, nan])  # monitor-only, never applicable
    processor = RewardProcessor({"partly": partly, "never": never}, {"partly": 1.0})
    components, metrics = processor(*_batch(4))
    assert torch.equal(torch.isnan(components["partly"]), torch.tensor([True, False, True, False]))
    assert torch.equal(components["partly"][[1, 3]], torch.tensor([2.0, 6.0]))
    assert metrics["reward/partly_mean"] == pytest.approx(4.0)
    assert metrics["reward/partly_std"] == pytest.approx(2.0)  # population std of {2, 6}
    assert metrics["reward/partly_nan_fraction"] == pytest.approx(0.5)
    assert bool(torch.isnan(components["never"]).all())
    assert math.isnan(metrics["reward/never_mean"]) and math.isnan(metrics["reward/never_std"])
    assert metrics["reward/never_nan_fraction"] == 1.0


def test_required_nan_in_a_later_batch_names_the_global_sample_index():
    fine = _Constant("fine", [0.0] * 5)
    req = _Constant("req", [0.0, 1.0, 2.0, float("nan"), 4.0])
    processor = RewardProcessor({"fine": fine, "req": req}, {"fine": 1.0, "req": 1.0}, ["req", "req"], batch_size=2)
    assert processor.required == ("req",)
    with pytest.raises(ValueError, match=r"required reward component 'req' scored NaN for sample 3 \(1 of 5 "):
        processor(*_batch(5))
    # the same NaN in a component that is only weighted is "not applicable", not an error
    components, _ = RewardProcessor({"req": req}, {"req": 1.0}, batch_size=2)(*_batch(5))
    assert int(torch.isnan(components["req"]).sum()) == 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16, torch.float32])
def test_components_are_float32_with_one_entry_per_sample(dtype):
    media, prompts, metadata = _graded_batch([0.0, 0.25, 0.5])
    processor = RewardProcessor({"s": _PerSample(dtype=dtype)}, {"s": 1.0})
    components, _ = processor(media, prompts, metadata)
    scores = components["s"]
    assert scores.shape == (3,) and scores.dtype == torch.float32 and scores.device == media.device
    expected = torch.tensor([0.0 + 1, 0.25 + 2 + 100, 0.5 + 3 + 200], dtype=dtype).float()  # len('p')=1
    assert torch.equal(scores, expected)


def test_components_are_detached_from_a_scorer_graph():
    weight = torch.tensor(2.0, requires_grad=True)

    def differentiable(media, prompts, metadata):
        return weight * media.mean(dim=(1, 2, 3))

    components, _ = RewardProcessor({"g": differentiable}, {"g": 1.0})(*_graded_batch([0.5, 1.0]))
    assert not components["g"].requires_grad
    assert torch.equal(components["g"], torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("batch_size, calls", [(1, 7), (2, 4), (3, 3), (7, 1), (64, 1)])
def test_batch_size_gives_the_same_scores_as_one_batch(batch_size, calls):
    media, prompts, metadata = _graded_batch([0.1, 0.9, 0.3, 0.7, 0.5, 0.2, 0.8])
    whole_scorer = _PerSample()
    whole, whole_metrics = RewardProcessor({"s": whole_scorer}, {"s": 1.0}, batch_size=64)(media, prompts, metadata)
    assert whole_scorer.calls == [list(range(7))]
    scorer = _PerSample()
    split, metrics = RewardProcessor({"s": scorer}, {"s": 1.0}, batch_size=batch_size)(media, prompts, metadata)
    assert len(scorer.calls) == calls and all(len(rows) <= batch_size for rows in scorer.calls)
    assert [i for rows in scorer.calls for i in rows] == list(range(7))  # every sample once, in order
    assert torch.equal(split["s"], whole["s"])
    for key in ("reward/s_mean", "reward/s_std", "reward/s_nan_fraction"):
        assert metrics[key] == whole_metrics[key]


def test_group_scorer_sees_whole_interleaved_groups_and_scores_land_in_place():
    levels = [0.9, 0.2, 0.1, 0.7, 0.5, 0.3]
    group_ids = torch.tensor([1, 0, 1, 0, 2, 2])
    prompts = [f"prompt{int(g)}" for g in group_ids]
    rank, per_sample = _RankInGroup(), _PerSample()
    processor = RewardProcessor({"rank": rank, "s": per_sample}, {"rank": 1.0}, batch_size=1)
    components, _ = processor(*_graded_batch(levels, prompts), group_ids=group_ids)
    assert rank.calls == [[1, 3], [0, 2], [4, 5]]  # one call per group, groups in sorted id order
    assert rank.prompts == [["prompt0", "prompt0"], ["prompt1", "prompt1"], ["prompt2", "prompt2"]]
    # ranks inside each group, by hand: g1 {0.9, 0.1} -> 1, 0; g0 {0.2, 0.7} -> 0, 1; g2 {0.5, 0.3} -> 1, 0
    assert torch.equal(components["rank"], torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0]))
    assert per_sample.calls == [[i] for i in range(6)]  # a per-sample scorer beside it still follows batch_size


def test_group_ids_must_have_one_entry_per_sample():
    processor = RewardProcessor({"rank": _RankInGroup()}, {"rank": 1.0})
    with pytest.raises(ValueError, match=r"group_ids must have shape \[4\], got \(3,\)"):
        processor(*_graded_batch([0.1, 0.2, 0.3, 0.4]), group_ids=torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match=r"group_ids must have shape \[4\], got \(2, 2\)"):
        processor(*_graded_batch([0.1, 0.2, 0.3, 0.4]), group_ids=torch.tensor([[0, 0], [1, 1]]))


def test_empty_batch_calls_no_scorer():
    scorer = _PerSample()
    components, metrics = RewardProcessor({"s": scorer}, {"s": 1.0}, ["s"])(*_graded_batch([]))
    assert scorer.calls == []
    assert components["s"].shape == (0,) and components["s"].dtype == torch.float32
    assert metrics["reward/s_nan_fraction"] == 0.0 and math.isnan(metrics["reward/s_mean"])


@pytest.mark.parametrize("bad", [0, -2, True, 2.0, "8"])
def test_processor_rejects_a_bad_batch_size(bad):
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        RewardProcessor({"s": _PerSample()}, {"s": 1.0}, batch_size=bad)


def test_processor_rejects_a_non_tensor_output_and_bad_inputs():
    processor = RewardProcessor({"bad": lambda media, prompts, metadata: [0.0, 0.0]}, {})
    with pytest.raises(ValueError, match=r"'bad' returned list, expected a \[2\] tensor"):
        processor(*_batch(2))
    with pytest.raises(ValueError, match="prompts must have one entry per image"):
        processor(torch.zeros(2, 3, 8, 8), ["only one"], [{}, {}])
