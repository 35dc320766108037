"""Held-out agreement with the teacher (hand-computed cases) and the quality gate."""

from __future__ import annotations

import math

import pytest
import torch

from flowforge.reward_model.config import GateThresholds, student_config
from flowforge.reward_model.evaluate import agreement, average_ranks, gate, pair_agreement, spearman, tie_blocks


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


def test_tie_blocks_and_agreement_with_a_tie_margin_by_hand():
    # sorted 0.10, 0.105, 0.11, 0.13, 0.50: a block takes every mark within 0.01 of its lowest
    assert tie_blocks(t(0.5, 0.105, 0.1, 0.13, 0.11), 0.01).tolist() == [2.0, 0.0, 0.0, 1.0, 0.0]
    values = t(0.3, 0.1, 0.3, 0.9)
    assert average_ranks(tie_blocks(values)).tolist() == average_ranks(values).tolist()  # margin 0: exact ties
    with pytest.raises(ValueError, match="tie_margin"):
        tie_blocks(values, -0.1)
    # teacher [0.50, 0.505, 0.80]: at margin 0.01 the first two tie, pairs (0,2) (1,2) only; the student orders
    # the near-tied pair against the teacher and the two real pairs with it
    student, teacher = [t(0.9, 0.1, 1.0)], [t(0.50, 0.505, 0.80)]
    exact, margin = agreement(student, teacher), agreement(student, teacher, 0.01)
    assert exact["pairs"] == 3 and exact["pairwise_accuracy"] == pytest.approx(2 / 3)
    assert margin["pairs"] == 2 and margin["pairwise_accuracy"] == 1.0
    # ranks s = [1, 0, 2], blocks [0, 0, 1] -> [0.5, 0.5, 2]: centred [0, -1, 1] . [-0.5, -0.5, 1] = 1.5
    assert margin["spearman"] == pytest.approx(1.5 / (math.sqrt(2) * math.sqrt(1.5)))
    assert margin["mae"] == exact["mae"]  # raw marks
    # a group whose marks all lie within the margin has no order: left out like an exactly tied one
    near = agreement([t(0.1, 0.9)], [t(0.95, 0.955)], 0.01)
    assert near["groups_tied"] == 1 and near["pairs"] == 0 and math.isnan(near["spearman"])


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
