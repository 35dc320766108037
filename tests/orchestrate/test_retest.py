"""The teacher retest (flowforge.orchestrate.retest): pairs the retest orders alike or not, binned by the recorded
marks' distance, on judged groups written to disk."""

from __future__ import annotations

import math

import torch

from flowforge.orchestrate.retest import reproduces, retest_pairs, retest_table
from tests.reward_model import support


def brightness(media, prompts, metadata):
    return media.mean(dim=(1, 2, 3))


def test_the_retest_counts_pairs_ordered_alike_by_distance(tmp_path):
    groups = support.synthetic_groups(tmp_path, 6, k=4)  # teacher mark = each candidate's brightness level
    dist, same = retest_pairs(groups, [brightness])
    assert dist.shape == same.shape == (6 * 6,)  # 6 pairs per group of 4, one retest
    far = dist >= 0.1
    assert far.any() and bool((same[far] == 1).all())  # the image's own brightness orders clearly apart marks alike
    dist2, reversed_ = retest_pairs(groups, [brightness, lambda m, p, md: -brightness(m, p, md)])
    second = reversed_.view(6, 2, 6)[:, 1]  # group-major, then retest: the reversing retest's pairs
    assert dist2.shape == (2 * 36,) and float(second.mean()) == 0.0 and bool((reversed_.view(6, 2, 6)[:, 0] == 1).all())
    rows = retest_table(dist, same, edges=(0.0, 0.1, 1.0))
    assert [r["pairs"] for r in rows] == [float((~far).sum()), float(far.sum())] and rows[1]["same_order"] == 1.0
    assert math.isnan(retest_table(dist, same, edges=(2.0, 3.0))[0]["same_order"])


def test_only_the_recorded_teacher_reproduces_the_recorded_marks(tmp_path):
    groups = support.synthetic_groups(tmp_path, 3, k=4)
    marks = {g.candidates[j][0]: s for g in groups for j, s in enumerate(g.scores)}
    order = iter([torch.tensor(g.scores, dtype=torch.float32) for g in groups])
    assert reproduces(groups, lambda media, prompts, metadata: next(order))
    assert not reproduces(groups, brightness) and len(marks) == 12
