"""Held-out agreement with the teacher (hand-computed cases) and the quality gate."""

from __future__ import annotations

import math

import pytest
import torch

from flowforge.reward_model.config import GateThresholds, student_config
from flowforge.reward_model.evaluate import agreement, average_ranks, gate, pair_agreement, spearman


def t(*values):
    return torch.tensor(values, dtype=torch.float64)


def test_ranks_spearman_and_pairs_by_hand():
    assert average_ranks(t(0.3, 0.1, 0.3, 0.9)).tolist() == [1.5, 0.0, 1.5, 3.0]
    assert spearman(t(1, 2, 3, 4), t(0.1, 0.2, 0.3, 0.4)) == pytest.approx(1.0)
    assert spearman(t(4, 3, 2, 1), t(0.1, 0.2, 0.3, 0.4)) == pytest.approx(-1.0)
    # ranks s = [0, 1.5, 1.5, 3], t = [0, 1, 2, 3]: centred [-1.5, 0, 0, 1.5] . [-1.5, -.5, .5, 1.5] = 4.5,
    # norms sqrt(4.5) and sqrt(5): rho = 4.5 / sqrt(22.5)
    assert spearman(t(0.1, 0.5, 0.5, 0.9), t(1, 2, 3, 4)) == pytest.approx(4.5 / math.sqrt(22.5))
    assert math.isnan(spearman(t(1, 2, 3), t(0.5, 0.5, 0.5)))  # the teacher gives no order
    assert spearman(t(0.2, 0.2, 0.2), t(1, 2, 3)) == 0.0
    # teacher pairs (i<j, t_i != t_j): (0,1) (0,2) (1,2); student: agree, tie (1/2), disagree
    assert pair_agreement(t(0.1, 0.5, 0.1), t(0.0, 0.5, 1.0)) == (1.5, 3)
    assert pair_agreement(t(1, 2), t(0.5, 0.5)) == (0.0, 0)


def test_agreement_over_groups():
    student = [t(0.1, 0.5, 0.9), t(0.9, 0.1), t(math.nan, 0.2), t(0.4, 0.4)]
    teacher = [t(0.0, 0.5, 1.0), t(0.2, 0.8), t(0.1, 0.2), t(0.3, 0.3)]
    m = agreement(student, teacher)
    assert m["groups"] == 3 and m["groups_tied"] == 1 and m["failure_rate"] == 0.25
    assert m["spearman"] == pytest.approx((1.0 - 1.0) / 2)  # the tied teacher group has no Spearman
    assert m["pairs"] == 4 and m["pairwise_accuracy"] == pytest.approx(3 / 4)
    errors = [0.1, 0.0, 0.1, 0.7, 0.7, 0.1, 0.1]
    assert m["mae"] == pytest.approx(sum(errors) / len(errors))
    empty = agreement([], [])
    assert empty["groups"] == 0 and math.isnan(empty["spearman"]) and math.isnan(empty["failure_rate"])
    with pytest.raises(ValueError, match="teacher scores"):
        agreement([t(1, 2)], [t(1, 2, 3)])


def test_the_gate_passes_or_says_why():
    good = {"groups": 20.0, "spearman": 0.8, "pairwise_accuracy": 0.9, "mae": 0.1, "failure_rate": 0.0}
    assert gate(good, GateThresholds()) == (True, [])
    assert gate(good, {"min_spearman": 0.9, "min_pairwise_accuracy": 0.7, "max_mae": 0.2, "max_failure_rate": 0,
                       "min_groups": 1})[0] is False
    bad = {"groups": 3.0, "spearman": 0.2, "pairwise_accuracy": math.nan, "mae": 0.4, "failure_rate": 0.5}
    passed, reasons = gate(bad, GateThresholds(min_groups=5))
    assert not passed and len(reasons) == 5
    assert "min_groups=5" in reasons[0] and "spearman=0.2 < min_spearman=0.5" in reasons[1]
    assert "pairwise_accuracy is NaN" in reasons[2] and "mae=0.4 > max_mae=0.25" in reasons[3]
    assert "failure_rate=0.5 > max_failure_rate=0.05" in reasons[4]
    assert student_config({"gate": {"min_spearman": 0.7}}).gate.min_spearman == 0.7
