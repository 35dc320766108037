"""The permutation null: the batched draws are agreement() of random students exactly, the pass probability is
right where it can be counted by hand, and every shipped pipeline's gate and audit thresholds are ones a random
student fails (p < max_null_pass) at the group counts they are judged on."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from flowforge.orchestrate.config import load_pipeline
from flowforge.orchestrate import thresholds
from flowforge.reward_model.evaluate import agreement
from flowforge.reward_model.null import null_draws, null_summary, p_value, pass_probability, untied_groups

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").rglob("*.yaml"))


@pytest.mark.parametrize("margin", [0.0, 0.15])
def test_batched_draws_equal_agreement_of_the_same_random_students(margin):
    teacher = [torch.tensor([0.1, 0.5, 0.5, 0.9]), torch.tensor([0.3, 0.3, 0.3]),  # a tie, and a fully tied group
               torch.tensor([0.9, 0.2, 0.4, 0.6, 0.0]), torch.tensor([0.40, 0.45, 0.52])]  # one block at 0.15
    draws = null_draws(teacher, trials=50, seed=7, tie_margin=margin)
    gen = torch.Generator().manual_seed(7)  # the same random students as null_draws: a [trials, K] draw per group
    ranks = [torch.argsort(torch.rand(50, len(t), generator=gen), dim=1).double() for t in teacher]
    for i in range(50):  # scored one draw at a time by agreement()
        ref = agreement([r[i] for r in ranks], teacher, margin)
        assert draws["spearman"][i].item() == pytest.approx(ref["spearman"], abs=1e-12)
        assert draws["pairwise_accuracy"][i].item() == pytest.approx(ref["pairwise_accuracy"], abs=1e-12)


def test_pass_probability_where_it_can_be_counted():
    # one group of 2: a random student orders it right (Spearman 1, pairwise 1) half the time, wrong otherwise
    draws = null_draws(untied_groups(2, 1), trials=20000, seed=0)
    assert {round(v, 9) for v in draws["spearman"].tolist()} == {-1.0, 1.0}
    assert pass_probability(draws, 0.99, 0.99) == pytest.approx(0.5, abs=0.015)
    # one group of 3: 1 of the 6 orders is the teacher's
    draws = null_draws(untied_groups(3, 1), trials=30000, seed=1)
    assert pass_probability(draws, 0.99, 0.99) == pytest.approx(1 / 6, abs=0.01)
    assert p_value(draws["spearman"], 1.0) == pytest.approx(1 / 6, abs=0.01)
    assert math.isnan(p_value(draws["spearman"], math.nan))
    summary = null_summary(untied_groups(8, 4), 0.45, 0.67, {"spearman": 0.9, "pairwise_accuracy": 0.9})
    assert summary["pass_probability"] < 0.01 and summary["spearman_p"] < 0.001 and summary["groups"] == 4
    with pytest.raises(ValueError, match="k >= 2"):
        untied_groups(1, 3)


def test_more_groups_narrow_the_null():
    q = [null_summary(untied_groups(8, g), 0.0, 0.0)["spearman_q99"] for g in (2, 8, 32)]
    assert q[0] > q[1] > q[2] > 0


# the GPU examples' prompt files are not on this machine: tests/examples/test_vlm_student_example.py checks their
# thresholds at the test-group count the example states
@pytest.mark.parametrize("path", [p for p in EXAMPLES if "stages:" in p.read_text() and p.parent.name != "gpu"],
                         ids=lambda p: p.name)
def test_shipped_pipeline_thresholds_fail_a_random_student(path):
    pcfg = load_pipeline(path)
    problems, warnings = thresholds.threshold_problems(pcfg)
    assert problems == [] and warnings == []  # p < max_null_pass and not below the floors
    assert pcfg.student.gate.max_null_pass <= 0.01 and pcfg.audit.max_null_pass <= 0.01
    assert thresholds.test_groups_at_budget(pcfg) >= pcfg.student.gate.min_groups


def test_thresholds_a_random_student_passes_are_refused():
    pcfg = load_pipeline(Path(__file__).resolve().parents[2] / "examples" / "stages" / "digits.yaml",
                         ["audit.min_spearman=0.2", "audit.min_pairwise_accuracy=0.6",
                          "student.gate.min_spearman=0.1", "student.gate.min_pairwise_accuracy=0.55"])
    problems, warnings = thresholds.threshold_problems(pcfg)
    assert len(problems) == 2 and "student.gate" in problems[0] and "audit" in problems[1]
    assert "a random student passes" in problems[1] and len(warnings) == 1  # the audit floors are met, the gate's not


def test_pooled_audit_thresholds_are_checked_at_the_pooled_group_count():
    example = Path(__file__).resolve().parents[2] / "examples" / "stages" / "digits.yaml"
    pcfg = load_pipeline(example)
    assert pcfg.audit.pool_groups == 8 and thresholds.threshold_problems(pcfg) == ([], [])
    alone = load_pipeline(example, ["audit.pool_groups=0"])  # the same thresholds on one step's 4 groups
    problems, _ = thresholds.threshold_problems(alone)
    assert len(problems) == 1 and "on 4 groups per verdict" in problems[0]
    small = load_pipeline(example, ["audit.pool_groups=2"])
    assert any("audit.pool_groups=2 must be 0 or at least data.prompts_per_step=4" in p
               for p in thresholds.threshold_problems(small)[0])
