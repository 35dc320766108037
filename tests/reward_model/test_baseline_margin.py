"""``student.gate.min_spearman_above_baselines``: the student must beat every baseline that never saw a teacher mark
by a margin of Spearman (issue 39: "the student must beat all three")."""

from __future__ import annotations

import math

from flowforge.reward_model.baselines import baseline_reasons

BASELINES = {"init": {"spearman": 0.19}, "constant": {"spearman": 0.0}, "digit": {"spearman": 0.35}}


def test_a_student_that_beats_every_baseline_by_the_margin_passes():
    assert baseline_reasons({"spearman": 0.56}, BASELINES, 0.2) == []


def test_each_baseline_the_student_does_not_beat_by_the_margin_is_one_reason():
    reasons = baseline_reasons({"spearman": 0.40}, BASELINES, 0.2)
    assert reasons == ["spearman=0.4 is not 0.2 above the digit baseline's 0.35 "
                       "(student.gate.min_spearman_above_baselines)"]
    assert len(baseline_reasons({"spearman": 0.1}, BASELINES, 0.2)) == 3


def test_no_margin_records_the_baselines_only():
    assert baseline_reasons({"spearman": -0.5}, BASELINES, None) == []


def test_a_baseline_with_no_order_counts_as_zero_and_a_student_with_none_beats_nothing():
    assert baseline_reasons({"spearman": 0.25}, {"tied": {"spearman": math.nan}}, 0.2) == []
    assert len(baseline_reasons({"spearman": math.nan}, BASELINES, 0.0)) == 3
