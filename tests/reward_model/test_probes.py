"""Shortcut probes at the gate: a student trained on a brightness teacher beats its blank-media baseline and keeps
its ranking when the candidates are re-ordered (it passes); a student that scores presented positions, and one that
never looks at the media, are failed by the probe made for them."""

from __future__ import annotations

import torch

from flowforge.reward_model.config import GateThresholds, student_config
from flowforge.reward_model.gate import gate_on_test
from flowforge.reward_model.probes import VACUOUS
from flowforge.reward_model.students import load_student
from flowforge.reward_model.train import train_student
from tests.reward_model import support

FAST = {"kind": "scalar_head", "epochs": 12, "lr": 3e-3, "batch_size": 8, "split": [1.0, 0.0, 0.0],
        "scalar_head": {"image_size": 16, "channels": [8, 16], "hidden": 16, "text_encoder": "none"}}
THRESHOLDS = GateThresholds(min_spearman=0.5, min_pairwise_accuracy=0.7, max_mae=1.0, min_groups=8)


class PositionStudent:
    """Scores the candidate shown first highest, then the next (what a position-biased judge does); the held-out
    groups are built so that the teacher's best candidate is always shown first."""

    def predict(self, groups):
        return [torch.linspace(1.0, 0.0, len(g.labels)) for g in groups]


class BlindStudent:
    """Never looks at the media: it reads the answers from the group record (a stand-in for any signal that is not
    the pixels, such as a leaked label), so blank media score exactly as the real ones."""

    def predict(self, groups):
        return [torch.tensor(g.scores) for g in groups]


class SeesTheGroup:
    """A student that does not declare it scores candidates alone (as one that reads the whole group would not):
    its probes run."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def predict(self, groups):
        return self.inner.predict(groups)


def test_a_trained_student_passes_its_probes(tmp_path):
    torch.set_num_threads(1)
    train = support.synthetic_groups(tmp_path / "train", 48, seed=0)
    test = support.synthetic_groups(tmp_path / "test", 12, seed=1)
    result = train_student(student_config(FAST), train, tmp_path / "run")
    verdict = gate_on_test(load_student(result.student_dir), test, THRESHOLDS)
    assert verdict["passed"], verdict["reasons"]
    probes = verdict["probes"]
    # it scores each candidate alone: blank media would tie every candidate and order cannot matter, so the two
    # probes could not fail it beyond the agreement check; they are said to be vacuous instead of passed
    assert probes["prompt_only"] == probes["position"] == {"vacuous": VACUOUS}
    assert probes["no_reference"] == {"groups": 0.0}
    group_aware = gate_on_test(SeesTheGroup(load_student(result.student_dir)), test, THRESHOLDS)
    assert group_aware["passed"] and group_aware["probes"]["prompt_only"]["spearman"] == 0.0
    assert group_aware["probes"]["prompt_only"]["spearman_gain"] > 0.5
    assert group_aware["probes"]["position"]["order_consistency"] > 0.999


def test_shortcut_students_are_failed_by_their_probe(tmp_path):
    groups = support.synthetic_groups(tmp_path, 12, seed=2)
    # present each group best-first, so that scoring positions agrees with the teacher in the original order
    ordered = []
    for g in groups:
        order = sorted(range(len(g.labels)), key=lambda i: -g.scores[i])
        ordered.append(type(g)(**{**g.__dict__, "candidates": tuple(g.candidates[i] for i in order),
                                  "scores": tuple(g.scores[i] for i in order),
                                  "hashes": tuple(g.hashes[i] for i in order)}))
    verdict = gate_on_test(PositionStudent(), ordered, THRESHOLDS)
    assert verdict["test"]["spearman"] > 0.99 and not verdict["passed"]
    assert any("position shortcut" in r for r in verdict["reasons"])
    assert verdict["probes"]["position"]["order_consistency"] < 0.5
    # scoring positions on groups in the teacher's random order: below the thresholds in either order, so the gate's
    # own agreement fails it and no position shortcut is claimed
    verdict = gate_on_test(PositionStudent(), groups, THRESHOLDS)
    assert not verdict["passed"] and not any("position shortcut" in r for r in verdict["reasons"])
    verdict = gate_on_test(BlindStudent(), groups, THRESHOLDS)
    assert verdict["test"]["spearman"] > 0.99 and not verdict["passed"]
    assert any("prompt-only baseline" in r for r in verdict["reasons"])
