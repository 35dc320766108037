"""The gate record's baselines (:mod:`flowforge.reward_model.baselines`): the student's initialisation, a constant
and free reward scorers, each scored against the teacher on the test groups."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flowforge.reward_model.baselines import baselines_on_test, constant_mark, judges_on_test, scorer_predictions
from flowforge.reward_model.config import GateThresholds, student_config
from flowforge.reward_model.evaluate import agreement
from flowforge.reward_model.gate import gate_on_test
from flowforge.reward_model.students import create_student
from tests.reward_model import support
from tests.reward_model.test_scalar_head import FAST, _order_groups


class Motion:
    """A whole-video scorer (``takes_video``): how far the bright square travelled down, last frame vs first."""

    name = "motion"
    needs_group = False
    takes_video = True

    def __call__(self, media, prompts, metadata):
        assert media.dim() == 5  # [K, 3, F, H, W]: whole ordered clips
        rows = torch.arange(media.shape[-2], dtype=torch.float32)

        def centre(frames):  # [K, 3, H, W] -> [K] mean row of the brightness
            weight = frames.mean(1).sum(-1)
            return (weight * rows).sum(-1) / weight.sum(-1)

        return centre(media[:, :, -1]) - centre(media[:, :, 0])


def test_baselines_record_init_constant_and_free_scorers(tmp_path):
    groups = support.synthetic_groups(tmp_path / "g", 6)  # teacher mark = the candidate's brightness
    cfg = student_config({**FAST, "gate": {"baselines": ["tests.serve.judge_support:Brightness"]}})
    out = baselines_on_test(cfg, groups, constant=0.5)
    assert set(out) == {"init", "constant", "tests.serve.judge_support:Brightness"}
    teacher = [torch.tensor(g.scores, dtype=torch.float64) for g in groups]
    assert out["init"] == agreement(create_student(cfg).predict(groups), teacher)  # the same seeded start
    assert out["constant"]["spearman"] == 0.0 and out["constant"]["pairwise_accuracy"] == 0.5
    assert out["tests.serve.judge_support:Brightness"]["pairwise_accuracy"] == 1.0  # the teacher's own criterion
    assert out["constant"]["groups"] == 6 and baselines_on_test(cfg, [], constant=0.5) == {}


def test_a_video_scorer_baseline_sees_whole_ordered_clips(tmp_path):
    groups = _order_groups(tmp_path / "o", 4)  # forwards (mark 0.9) vs backwards (0.1): the same frames
    scores = scorer_predictions(Motion(), groups)
    teacher = [torch.tensor(g.scores, dtype=torch.float64) for g in groups]
    assert agreement(scores, teacher)["pairwise_accuracy"] == 1.0


def test_an_unknown_baseline_is_a_config_problem_naming_the_field():
    from flowforge.settings.schema import ConfigError

    with pytest.raises(ConfigError, match="student.gate.baselines: unknown component 'no_such_reward'"):
        student_config({**FAST, "gate": {"baselines": ["no_such_reward"]}})


class Fixed:
    """A student whose every score is one given value (a constant predictor)."""

    def __init__(self, value: float) -> None:
        self.value = value

    def predict(self, groups):
        return [torch.full((len(g.scores),), self.value, dtype=torch.float64) for g in groups]


class Teacher:
    """The teacher's own marks, shrunk towards their group's mean: the right order, the marks a little off."""

    def predict(self, groups):
        out = []
        for g in groups:
            t = torch.tensor(g.scores, dtype=torch.float64)
            out.append(t.mean() + 0.8 * (t - t.mean()))
        return out


class FailsFirst:
    """Another student's scores, but NaN for the first group (an answer it could not give)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def predict(self, groups):
        out = self.inner.predict(groups)
        return [torch.full_like(out[0], float("nan")), *out[1:]]


def test_the_constant_baseline_is_the_training_split_median_and_the_gate_can_require_beating_it(tmp_path):
    train = support.synthetic_groups(tmp_path / "train", 6, seed=0)
    test = support.synthetic_groups(tmp_path / "test", 8, seed=1)
    marks = torch.tensor([m for g in train for m in g.scores], dtype=torch.float64)
    mark = constant_mark(train)
    assert mark == float(marks.median()) and constant_mark([]) == 0.5
    # the median is the constant with the least absolute error on the marks it was taken from
    assert all((marks - mark).abs().sum() <= (marks - c).abs().sum() + 1e-12 for c in marks.tolist() + [0.5, 0.0])
    cfg = student_config({**FAST, "gate": {"max_mae": 1.0}})
    record = baselines_on_test(cfg, test, constant=mark)["constant"]
    teacher = torch.cat([torch.tensor(g.scores, dtype=torch.float64) for g in test])
    assert record["mark"] == mark and record["mae"] == pytest.approx(float((teacher - mark).abs().mean()))

    loose = GateThresholds(min_spearman=-1.0, min_pairwise_accuracy=0.0, max_mae=1.0, min_groups=1, max_null_pass=1.0,
                           fail_on_shortcuts=False)
    strict = dataclasses.replace(loose, mae_below_constant=True)
    # max_mae alone passes the constant predictor; mae_below_constant fails it, naming the field and both errors
    assert gate_on_test(Fixed(mark), test, loose, constant=mark)["passed"]
    verdict = gate_on_test(Fixed(mark), test, strict, constant=mark)
    assert not verdict["passed"] and verdict["constant_mae"] == pytest.approx(record["mae"])
    assert any("not below the constant predictor's mae" in r and "mae_below_constant" in r for r in verdict["reasons"])
    assert gate_on_test(Teacher(), test, strict, constant=mark)["passed"]  # closer to the marks than the median
    # a group the student could not score (NaN) counts in neither MAE: both average the same candidates
    failing_first = FailsFirst(Teacher())
    verdict = gate_on_test(failing_first, test, strict, constant=mark)
    rest = torch.cat([torch.tensor(g.scores, dtype=torch.float64) for g in test[1:]])
    assert verdict["test"]["failure_rate"] == 1 / len(test)
    assert verdict["constant_mae"] == pytest.approx(float((rest - mark).abs().mean()))
    with pytest.raises(ValueError, match="mae_below_constant needs"):
        gate_on_test(Teacher(), test, strict)


class SignedBrightness:
    """Per image: ``sign`` x its mean brightness, negated where the prompt row's metadata says ``flip``."""

    name = "signed_brightness"
    needs_group = False

    def __init__(self, sign: float = 1.0) -> None:
        self.sign = sign

    def __call__(self, media, prompts, metadata):
        flip = torch.tensor([-1.0 if m.get("flip") else 1.0 for m in metadata])
        return self.sign * flip * media.flatten(1).mean(1)


class PaidJudge(SignedBrightness):
    paid = True  # billed per request: never asked beside the gate


class Broken(SignedBrightness):
    def __call__(self, media, prompts, metadata):
        raise KeyError("real_clip")


def test_eval_judges_beside_the_gate_get_the_rows_metadata_and_options(tmp_path, caplog):
    """The issue: the independent eval judges are printed beside the gate's baselines for reference. They read
    their condition's prompt-row metadata (the world judges' real clip and actions) and their reward.options; a
    paid one is never asked; one that cannot score is recorded with its reason, not a crash."""
    groups = support.synthetic_groups(tmp_path / "g", 4)  # teacher mark = brightness
    here = "tests.reward_model.test_baselines"
    names = [f"{here}:SignedBrightness", f"{here}:PaidJudge", f"{here}:Broken"]
    plain = judges_on_test(names, groups, tie_margin=0.0)
    assert set(plain) == {names[0], names[2]}  # the paid judge left out
    assert plain[names[0]]["spearman"] == pytest.approx(1.0) and plain[names[0]]["groups"] == 4
    assert plain[names[2]] == {"error": "KeyError: 'real_clip'"} and "eval judge" in caplog.text
    flipped = {g.condition_id: {"flip": True} for g in groups[:2]}  # the row's metadata reaches the judge
    some = judges_on_test(names[:1], groups, tie_margin=0.0, metadata=flipped)[names[0]]
    assert some["spearman"] == pytest.approx(0.0)  # two groups reversed, two in order
    negated = judges_on_test(names[:1], groups, tie_margin=0.0, options={names[0]: {"sign": -1.0}})
    assert negated[names[0]]["spearman"] == pytest.approx(-1.0)
    assert judges_on_test(names, [], tie_margin=0.0) == {}
