"""Size and power of an audit verdict simulated from teacher marks (:mod:`flowforge.reward_model.power`)."""

from __future__ import annotations

import torch

from flowforge.orchestrate.config import AuditConfig
from flowforge.reward_model.config import GateThresholds
from flowforge.reward_model.evaluate import tie_blocks
from flowforge.reward_model.null import null_draws, pass_probability, untied_groups
from flowforge.reward_model.power import batched_tie_blocks, default_marks, size_and_power


def _defaults(marks, **audit):
    a, g = AuditConfig(**audit), GateThresholds()
    return size_and_power(marks, 8, a.pool_groups, min_spearman=a.min_spearman,
                          min_pairwise_accuracy=a.min_pairwise_accuracy, gate_spearman=g.min_spearman,
                          gate_pairwise_accuracy=g.min_pairwise_accuracy, tie_margin=a.tie_margin)


def test_the_default_audits_have_size_under_1_percent_and_power_of_0_8_deterministically():
    first = _defaults(default_marks(8))
    assert first == _defaults(default_marks(8))  # seeded: the same numbers every call
    assert first["size"] < 0.01 and first["power"] >= 0.8, first
    # the student at the bar meets the gate's thresholds in expectation, no more (the binding one: pairwise 0.7)
    assert first["bar_spearman"] >= 0.5 - 0.01 and abs(first["bar_pairwise_accuracy"] - 0.7) < 0.01, first
    # the former 0.35 / 0.63 had the size but stopped that student < 10 % of the time
    former = _defaults(default_marks(8), min_spearman=0.35, min_pairwise_accuracy=0.63)
    assert former["size"] < 0.01 and former["power"] < 0.1, former


def test_the_random_student_is_the_permutation_null():
    """The simulated size equals the permutation null's pass probability on untied groups (its own draws)."""
    for rho, pairs, groups in ((0.1, 0.55, 4), (0.2, 0.5, 8), (0.0, 0.56, 8)):
        sim = _defaults(default_marks(8), pool_groups=groups, min_spearman=rho, min_pairwise_accuracy=pairs)["size"]
        null = pass_probability(null_draws(untied_groups(8, groups)), rho, pairs)
        assert abs(sim - null) < 0.04, (rho, pairs, groups, sim, null)


def test_a_better_student_or_more_groups_is_stopped_less_and_a_perfect_one_never():
    marks = default_marks(8)
    common = {"min_spearman": 0.55, "min_pairwise_accuracy": 0.74, "tie_margin": 0.0}
    at_bar = size_and_power(marks, 8, 8, gate_spearman=0.5, gate_pairwise_accuracy=0.7, **common)
    better = size_and_power(marks, 8, 8, gate_spearman=0.7, gate_pairwise_accuracy=0.8, **common)
    perfect = size_and_power(marks, 8, 8, gate_spearman=1.0, gate_pairwise_accuracy=1.0, **common)
    assert at_bar["power"] > better["power"] > perfect["power"] == 0.0 and perfect["sigma"] == 0.0
    assert size_and_power(marks, 8, 32, gate_spearman=0.7, gate_pairwise_accuracy=0.8, **common)["power"] < \
        better["power"]


def test_tied_marks_are_left_out_and_the_batched_tie_rule_is_tie_blocks():
    marks = torch.stack(default_marks(8, groups=64))
    marks[:8, :3] = 0.5
    marks[8:16] = 0.3 + 0.001 * torch.arange(8)  # all within 0.01: no order at tie_margin 0.01
    for margin in (0.0, 0.01, 0.2):
        assert torch.equal(batched_tie_blocks(marks, margin), torch.stack([tie_blocks(m, margin) for m in marks]))
    out = size_and_power(list(marks), 8, 8, min_spearman=0.55, min_pairwise_accuracy=0.74, gate_spearman=0.5,
                         gate_pairwise_accuracy=0.7, tie_margin=0.01)
    assert out["orderable"] == 56 / 64
    try:
        size_and_power(list(marks[8:16]), 8, 8, min_spearman=0.55, min_pairwise_accuracy=0.74, gate_spearman=0.5,
                       gate_pairwise_accuracy=0.7, tie_margin=0.01)
    except ValueError as exc:
        assert "has an order at tie_margin=0.01" in str(exc)
    else:
        raise AssertionError("marks the teacher cannot order must be refused")
