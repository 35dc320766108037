"""The stage trainer's audit schedule and audit file (the audits themselves run in test_stages.py)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from flowforge.orchestrate.config import AuditConfig
from flowforge.orchestrate.stage_trainer import AUDIT_FILE, Auditor, AuditStop, read_audits


def test_audits_cover_the_first_groups_then_every_kth_step(tmp_path):
    auditor = Auditor(None, AuditConfig(first_groups=10, every=5), first_step=23, end_step=100, prompts_per_step=4,
                      run_dir=tmp_path)
    assert [s for s in range(23, 45) if auditor.due(s)] == [23, 24, 25, 30, 35, 40]  # 3 steps cover 10 groups
    only_first = Auditor(None, AuditConfig(first_groups=4, every=0), first_step=0, end_step=100, prompts_per_step=4,
                         run_dir=tmp_path)
    assert [s for s in range(0, 20) if only_first.due(s)] == [0]
    none = Auditor(None, AuditConfig(first_groups=0, every=0), first_step=0, end_step=20, prompts_per_step=4,
                   run_dir=tmp_path)
    assert not any(none.due(s) for s in range(20))  # no audits, no closing verdict either


def test_the_last_steps_of_c_are_audited_for_the_closing_verdict(tmp_path):
    """The closing window: enough of C's last steps for one pool (ceil(pool_groups / M)), one without pooling."""
    cfg = AuditConfig(first_groups=4, every=5, pool_groups=10)
    auditor = Auditor(None, cfg, first_step=23, end_step=44, prompts_per_step=4, run_dir=tmp_path)
    assert [s for s in range(23, 44) if auditor.due(s)] == [23, 25, 30, 35, 40, 41, 42, 43]  # 3 steps cover 10
    alone = Auditor(None, AuditConfig(first_groups=4, every=5, pool_groups=0), first_step=23, end_step=44,
                    prompts_per_step=4, run_dir=tmp_path)
    assert [s for s in range(23, 44) if alone.due(s)] == [23, 25, 30, 35, 40, 43]
    off = Auditor(None, dataclasses.replace(cfg, closing=False), first_step=23, end_step=44, prompts_per_step=4,
                  run_dir=tmp_path)
    assert [s for s in range(23, 44) if off.due(s)] == [23, 25, 30, 35, 40]
    short = Auditor(None, cfg, first_step=23, end_step=25, prompts_per_step=4, run_dir=tmp_path)
    assert [s for s in range(23, 25) if short.due(s)] == [23, 24]  # a C shorter than the window: all of it


def test_a_step_audited_again_after_a_resume_keeps_its_first_record(tmp_path):
    lines = [{"step": 5, "passed": True, "spearman": 0.5}, {"step": 3, "passed": True, "spearman": 0.1},
             {"step": 5, "passed": True, "spearman": 0.9}]
    (tmp_path / AUDIT_FILE).write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 7, "pas')
    assert [(a["step"], a["spearman"]) for a in read_audits(tmp_path)] == [(3, 0.1), (5, 0.5)]
    assert read_audits(tmp_path / "missing") == []


class _RankJudge:
    """A teacher that ranks every group's candidates 0..K-1 in presented order (one request per group)."""

    def score_groups(self, requests):
        return [torch.arange(len(r[1]), dtype=torch.float32) / (len(r[1]) - 1) for r in requests]

    def pop_metrics(self):
        return {"requests_sent": 4.0, "served_from_ledger": 0.0}


def _step(auditor, step, student):
    """Audit one step of 4 groups x 8 candidates (rows group by group) with ``[32]`` student scores."""
    records = [SimpleNamespace(prompt="p", metadata={"sample_id": f"c{step}-{i // 8}"}) for i in range(32)]
    batch = SimpleNamespace(records=records, group_ids=torch.arange(4).repeat_interleave(8))
    return auditor.audit(step, step, torch.zeros(32, 3, 4, 4), batch, student)


def test_pooled_audits_pend_until_the_pool_fills_and_never_reuse_a_judged_group(tmp_path):
    """Issue 39: a verdict used to be taken on the last N audited groups, refilled from older audits (each group
    judged again and again); now each group counts toward one verdict only."""
    cfg = AuditConfig(first_groups=8, every=7, pool_groups=8, min_spearman=0.35, min_pairwise_accuracy=0.63)
    auditor = Auditor(_RankJudge(), cfg, first_step=24, end_step=100, prompts_per_step=4, run_dir=tmp_path)
    teacher_order = torch.arange(8.0).repeat(4)
    _step(auditor, 24, teacher_order)  # 4 of 8 groups: pending, whatever the agreement
    _step(auditor, 25, teacher_order)  # the first verdict, on 24's and 25's groups
    reverse = -teacher_order  # a student that ranks every group backwards: Spearman -1 on this step alone
    _step(auditor, 28, torch.cat([teacher_order[:24], reverse[24:]]))  # 3 good + 1 reversed: pending again
    with pytest.raises(AuditStop, match=r"spearman=-0.25 < audit.min_spearman=0.35 \(pooled over 8 groups\)"):
        _step(auditor, 35, reverse)  # 4 reversed + the 4 of step 28 (one reversed): pooled 8 of which 5 reversed
    audits = read_audits(tmp_path)
    assert [(a["step"], a["verdict"], a["passed"], a["pooled_groups"], a["pooled_steps"]) for a in audits] == [
        (24, "pending", None, 4, [24]), (25, "passed", True, 8, [24, 25]), (28, "pending", None, 4, [28]),
        (35, "failed", False, 8, [28, 35])]
    assert audits[0]["pending"] and audits[0]["reasons"] == [] and audits[0]["spearman"] == 1.0
    assert audits[2]["step_spearman"] == pytest.approx(0.5) and audits[2]["spearman"] == pytest.approx(0.5)
    assert audits[3]["spearman"] == pytest.approx(-1 * 5 / 8 + 3 / 8) and audits[3]["stop"] == "agreement"
    assert all(len(a["scores"]) == 4 and len(a["scores"][0][0]) == 8 for a in audits)  # per group [student, teacher]
    # the pair counts of the verdict's groups: 28 pairs a group, none tied (distinct marks, no margin)
    assert [(a["pairs_compared"], a["pairs_tied"], a["pairs_compared_raw"]) for a in audits] == [
        (112, 0, 112), (224, 0, 224), (112, 0, 112), (224, 0, 224)]
    assert audits[3]["spearman_raw"] == audits[3]["spearman"]


def test_without_pooling_each_step_is_judged_alone(tmp_path):
    alone = AuditConfig(first_groups=4, every=1, pool_groups=0, min_spearman=0.45, min_pairwise_accuracy=0.67)
    auditor = Auditor(_RankJudge(), alone, first_step=0, end_step=100, prompts_per_step=4, run_dir=tmp_path)
    with pytest.raises(AuditStop, match=r"spearman=-1 < audit.min_spearman=0.45;"):
        _step(auditor, 0, -torch.arange(8.0).repeat(4))
    (record,) = read_audits(tmp_path)
    assert (record["verdict"], record["passed"], record["pending"], record["pooled_groups"]) == ("failed", False,
                                                                                                  False, 4)
    # marks 0, 1/7, ..., 1 tied within 0.15 pair up: 4 of each group's 28 pairs tie, counted apart from the rest
    (tmp_path / "margin").mkdir()
    margin = Auditor(_RankJudge(), dataclasses.replace(alone, tie_margin=0.15), first_step=0, end_step=100,
                     prompts_per_step=4, run_dir=tmp_path / "margin")
    _step(margin, 0, torch.arange(8.0).repeat(4))
    (record,) = read_audits(tmp_path / "margin")
    assert (record["verdict"], record["pairs_compared"], record["pairs_tied"], record["pairs_compared_raw"]) == (
        "passed", 96, 16, 112)
    assert record["spearman"] < record["spearman_raw"] == 1.0 and record["pairwise_accuracy"] == 1.0


class _NearTieJudge(_RankJudge):
    """A teacher whose marks of the groups of steps in ``flat`` all lie within 0.005 (its retest noise), ordered
    0..K-1 otherwise."""

    def __init__(self, flat):
        self.flat, self.step = set(flat), None

    def score_groups(self, requests):
        ordered = super().score_groups(requests)
        return [0.9 + 0.005 * o if self.step in self.flat else o for o in ordered]


def test_groups_the_teacher_cannot_order_count_toward_no_verdict(tmp_path):
    judge = _NearTieJudge(flat={25, 35})
    cfg = AuditConfig(first_groups=8, every=7, pool_groups=8, min_spearman=0.35, min_pairwise_accuracy=0.63,
                      tie_margin=0.01)
    auditor = Auditor(judge, cfg, first_step=24, end_step=100, prompts_per_step=4, run_dir=tmp_path)
    good, reverse = torch.arange(8.0).repeat(4), -torch.arange(8.0).repeat(4)

    def step(n, student):
        judge.step = n
        return _step(auditor, n, student)

    step(24, good)
    step(25, reverse)  # near-tied marks: reversed or not, nothing to judge; no verdict, one unaudited step
    step(28, good)  # with step 24's 4: the first verdict
    step(35, reverse)  # near-tied again: no verdict (not a passed audit for the last good checkpoint)
    step(42, reverse)  # 4 reversed groups: pending (step 28's were judged already)
    with pytest.raises(AuditStop, match=r"spearman=-1 < audit.min_spearman=0.35 \(pooled over 8 groups\)"):
        step(49, reverse)
    audits = read_audits(tmp_path)
    assert [(a["step"], a["verdict"], a["pooled_groups"], a["pooled_steps"], a["unaudited"]) for a in audits] == [
        (24, "pending", 4, [24], False), (25, "pending", 4, [24], True), (28, "passed", 8, [24, 28], False),
        (35, "pending", 0, [], True), (42, "pending", 4, [42], False), (49, "failed", 8, [42, 49], False)]
    assert [a["unaudited_steps"] for a in audits] == [0, 1, 1, 2, 2, 2]
    assert all(len(a["scores"]) == 4 for a in audits)  # every group is kept in the file, orderable or not
    assert (audits[1]["pairs_compared"], audits[1]["pairs_tied"]) == (112, 0)  # its pending pool: step 24's groups
    # without the margin the same near-tied marks are an order, and the reversed step 25 would count
    (tmp_path / "exact").mkdir()
    exact = Auditor(_NearTieJudge(flat={25}), AuditConfig(first_groups=8, every=7, pool_groups=8,
                    min_spearman=0.35, min_pairwise_accuracy=0.63), first_step=24, end_step=100,
                    prompts_per_step=4, run_dir=tmp_path / "exact")
    exact.judge.step = 24
    _step(exact, 24, good)
    exact.judge.step = 25
    with pytest.raises(AuditStop):
        _step(exact, 25, reverse)


def test_steps_the_teacher_cannot_order_spend_a_bounded_budget_then_stop(tmp_path):
    """Issue 39: a teacher that could order none of the audited groups gave no verdict and no stop, for ever."""
    judge = _NearTieJudge(flat={25, 28, 35})
    cfg = AuditConfig(first_groups=8, every=7, pool_groups=8, min_spearman=0.35, min_pairwise_accuracy=0.63,
                      tie_margin=0.01, max_unaudited=1)
    auditor = Auditor(judge, cfg, first_step=24, end_step=100, prompts_per_step=4, run_dir=tmp_path)
    for n in (24, 25):
        judge.step = n
        _step(auditor, n, torch.arange(8.0).repeat(4))
    judge.step = 28
    with pytest.raises(AuditStop, match=r"audit at step 28: the teacher could not order any of the 4 audited groups "
                                        r"\(marks within audit.tie_margin=0.01\) at 2 audited steps > "
                                        r"audit.max_unaudited=1") as stop:
        _step(auditor, 28, torch.arange(8.0).repeat(4))
    assert stop.value.record["stop"] == "unaudited" and stop.value.record["verdict"] == "pending"
    assert [(a["step"], a["verdict"], a["unaudited"]) for a in read_audits(tmp_path)] == [
        (24, "pending", False), (25, "pending", True), (28, "pending", True)]


def test_the_closing_verdict_covers_the_last_step_on_whatever_gathered(tmp_path):
    """The digits pen seed 4 run (low gate) ended C ``done`` with its last audit pending (Spearman 0.08 on 4 groups,
    never pooled): the policy it handed on had been trained past its last verdict. Now C's last step takes a verdict
    on every group gathered since the last one, and the window before it defers its verdict to it."""
    cfg = AuditConfig(first_groups=4, every=10, pool_groups=8, min_spearman=0.35, min_pairwise_accuracy=0.63)
    good, reverse = torch.arange(8.0).repeat(4), -torch.arange(8.0).repeat(4)
    auditor = Auditor(_RankJudge(), cfg, first_step=24, end_step=30, prompts_per_step=4, run_dir=tmp_path)
    assert [s for s in range(24, 30) if auditor.due(s)] == [24, 28, 29]  # early, then the closing window of 2
    _step(auditor, 24, good)
    _step(auditor, 28, good)  # 8 groups gathered and passing, but in the window: it waits for C's last step
    with pytest.raises(AuditStop, match=r"spearman=0.3333 < audit.min_spearman=0.35 \(pooled over 12 groups\)"):
        _step(auditor, 29, reverse)  # the student turned at the very end: 4 reversed of 12
    audits = read_audits(tmp_path)
    assert [(a["step"], a["verdict"], a["pooled_steps"], a["closing"]) for a in audits] == [
        (24, "pending", [24], False), (28, "pending", [24, 28], False), (29, "failed", [24, 28, 29], True)]
    # without the closing verdict the same run passes at step 28 and trains step 29 on an unaudited student
    (tmp_path / "off").mkdir()
    off = Auditor(_RankJudge(), dataclasses.replace(cfg, closing=False), first_step=24, end_step=30,
                  prompts_per_step=4, run_dir=tmp_path / "off")
    assert [s for s in range(24, 30) if off.due(s)] == [24]
    # a full pool in the window that fails does not wait: it stops C at once
    (tmp_path / "early").mkdir()
    early = Auditor(_RankJudge(), cfg, first_step=24, end_step=30, prompts_per_step=4, run_dir=tmp_path / "early")
    _step(early, 24, good)
    with pytest.raises(AuditStop, match=r"pooled over 8 groups"):
        _step(early, 28, reverse)
    assert [(a["step"], a["verdict"], a["closing"]) for a in read_audits(tmp_path / "early")] == [
        (24, "pending", False), (28, "failed", False)]


def test_the_closing_verdict_when_the_teacher_cannot_order_the_last_steps(tmp_path):
    """Ties at the end: a closing verdict on fewer groups than a pool; a last step whose own groups tie judged on the
    window's others without the unaudited budget's stop; nothing orderable since the last verdict stops C (the
    policy C would hand on has no verdict)."""
    cfg = AuditConfig(first_groups=4, every=10, pool_groups=12, min_spearman=0.35, min_pairwise_accuracy=0.63,
                      tie_margin=0.01)
    good = torch.arange(8.0).repeat(4)

    def run(name, flat, max_unaudited):
        judge = _NearTieJudge(flat=flat)
        (tmp_path / name).mkdir()
        auditor = Auditor(judge, dataclasses.replace(cfg, max_unaudited=max_unaudited), first_step=24, end_step=30,
                          prompts_per_step=4, run_dir=tmp_path / name)
        assert [s for s in range(24, 30) if auditor.due(s)] == [24, 27, 28, 29]  # early, then the window of 3
        for n in (24, 27, 28, 29):
            judge.step = n
            _step(auditor, n, good)
        return [(a["step"], a["verdict"], a["pooled_groups"], a["closing"], a["unaudited"], a["stop"])
                for a in read_audits(tmp_path / name)]

    assert run("fewer", {27, 28}, 2) == [  # 8 orderable groups gathered, not 12: judged all the same
        (24, "pending", 4, False, False, None), (27, "pending", 4, False, True, None),
        (28, "pending", 4, False, True, None), (29, "passed", 8, True, False, None)]
    # the last step's own groups tie: judged on 24's and 28's; its unaudited step is the 2nd > max 1, yet no stop
    assert run("last", {27, 29}, 1) == [
        (24, "pending", 4, False, False, None), (27, "pending", 4, False, True, None),
        (28, "pending", 8, False, False, None), (29, "passed", 8, True, True, None)]
    with pytest.raises(AuditStop, match=r"C's last step 29: the teacher could not order any group audited since "
                                        r"the last verdict") as stop:
        run("none", {24, 27, 28, 29}, 5)  # nothing orderable at all: no verdict for the policy C would hand on
    assert stop.value.record["stop"] == "unaudited" and stop.value.record["verdict"] == "pending"


class _SilentJudge(_RankJudge):
    """A teacher that answers no group (every mark NaN: failed after its attempts)."""

    def score_groups(self, requests):
        return [torch.full((len(r[1]),), float("nan")) for r in requests]


def test_a_step_the_teacher_answered_none_of_stops_c_saying_so(tmp_path):
    cfg = AuditConfig(first_groups=8, every=7, pool_groups=8, min_spearman=0.35, min_pairwise_accuracy=0.63)
    auditor = Auditor(_RankJudge(), cfg, first_step=24, end_step=100, prompts_per_step=4, run_dir=tmp_path)
    _step(auditor, 24, torch.arange(8.0).repeat(4))  # pending: 4 groups
    auditor.judge = _SilentJudge()
    with pytest.raises(AuditStop, match=r"the teacher answered none of the 4 audited groups of step 25: no "
                                        r"agreement to measure$"):
        _step(auditor, 25, torch.arange(8.0).repeat(4))


def test_the_pipeline_trains_with_the_plain_trainer_and_overrides_nothing():
    """Issue 40: stages A and C compose the trainer's seams (a prompt source, step hooks) instead of a Trainer
    subclass overriding its stages and passing state between them through hidden attributes."""
    import importlib
    import inspect
    import pkgutil

    import flowforge.orchestrate as package
    from flowforge.orchestrate import stage_trainer
    from flowforge.train.trainer import Trainer

    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        subclasses = [v for v in vars(module).values()
                      if isinstance(v, type) and issubclass(v, Trainer) and v is not Trainer]
        assert not subclasses, (info.name, subclasses)
    source = inspect.getsource(stage_trainer)
    assert "Trainer(cfg" in source  # the plain trainer, configured
    for hidden in ("_dropped", "_eval_step", "objective.prepare", "def next_prompts", "def optimize"):
        assert hidden not in source, hidden
