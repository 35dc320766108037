"""The gate record's baselines (:mod:`flowforge.reward_model.baselines`): the student's initialisation, a constant
and free reward scorers, each scored against the teacher on the test groups."""

from __future__ import annotations

import pytest
import torch

from flowforge.reward_model.baselines import baselines_on_test, scorer_predictions
from flowforge.reward_model.config import student_config
from flowforge.reward_model.evaluate import agreement
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
    out = baselines_on_test(cfg, groups)
    assert set(out) == {"init", "constant", "tests.serve.judge_support:Brightness"}
    teacher = [torch.tensor(g.scores, dtype=torch.float64) for g in groups]
    assert out["init"] == agreement(create_student(cfg).predict(groups), teacher)  # the same seeded start
    assert out["constant"]["spearman"] == 0.0 and out["constant"]["pairwise_accuracy"] == 0.5
    assert out["tests.serve.judge_support:Brightness"]["pairwise_accuracy"] == 1.0  # the teacher's own criterion
    assert out["constant"]["groups"] == 6 and baselines_on_test(cfg, []) == {}


def test_a_video_scorer_baseline_sees_whole_ordered_clips(tmp_path):
    groups = _order_groups(tmp_path / "o", 4)  # forwards (mark 0.9) vs backwards (0.1): the same frames
    scores = scorer_predictions(Motion(), groups)
    teacher = [torch.tensor(g.scores, dtype=torch.float64) for g in groups]
    assert agreement(scores, teacher)["pairwise_accuracy"] == 1.0


def test_an_unknown_baseline_is_a_config_problem_naming_the_field():
    from flowforge.settings.schema import ConfigError

    with pytest.raises(ConfigError, match="student.gate.baselines: unknown component 'no_such_reward'"):
        student_config({**FAST, "gate": {"baselines": ["no_such_reward"]}})
