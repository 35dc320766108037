"""Control arms of the pipeline (flowforge.orchestrate.arms): the arm's ledger starts from stage A's hand-off, its
stage C draws the student's C conditions, the teacher arm bills each group once within the pipeline's budget, and
the arm table puts every arm beside the base and the hand-off."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys

import pytest

from flowforge.orchestrate.arms import (_a_takes, arm_dir, arm_table, check_arm_settings, format_arm_table,
                                        handoff_records, run_arm_pipeline)
from flowforge.orchestrate.config import load_pipeline
from flowforge.orchestrate.stages import run_pipeline
from flowforge.report.grids import read_eval_scores
from flowforge.report.run import find_grids
from flowforge.rewards.judge.protocol import billed_per_group, read_request_log
from flowforge.runtime.errors import UserError
from tests.orchestrate.support import write_pipeline

LEDGER = [
    {"kind": "header", "version": 1, "seed": 0},
    {"kind": "take", "stage": "A", "step": 0, "policy_version": 0, "n": 2, "ids": ["a", "b"]},
    {"kind": "mark", "state": "judged", "stage": "A", "step": 0, "policy_version": 0, "ids": ["a", "b"]},
    {"kind": "mark", "state": "used_for_rm", "stage": "B", "step": 0, "policy_version": 0, "ids": ["a"]},
    {"kind": "take", "stage": "C", "step": 1, "policy_version": 1, "n": 2, "ids": ["c", "d"]},
    {"kind": "mark", "state": "trained_on", "stage": "C", "step": 1, "policy_version": 1, "ids": ["c", "d"]},
]


def test_the_hand_off_keeps_everything_but_stage_c_and_a_changed_a_is_seen():
    lines = [json.dumps(r) for r in LEDGER]
    kept = [json.loads(line) for line in handoff_records(lines)]
    assert [r.get("stage") for r in kept] == [None, "A", "A", "B"]
    extended = lines + [json.dumps({"kind": "extend", "key": "gate-1", "amount": 2, "budget_a": 4})]
    assert _a_takes(lines) != _a_takes(extended)  # an extension of A makes an arm's hand-off stale
    assert _a_takes(lines) == _a_takes(lines[:2])  # B's marks and C's records do not


def _prompt_means(run_dir, step):
    """Each held-out prompt's mean digit_eval at the evaluation of ``step`` (samples are prompt-major)."""
    k, scores = read_eval_scores(dict(find_grids(run_dir))[int(step)])
    values = scores["digit_eval"]
    return [statistics.fmean(values[i * k:(i + 1) * k]) for i in range(len(values) // k)]


def _takes(path, stage):
    return [(r["step"], r["ids"]) for r in map(json.loads, path.read_text().splitlines())
            if r.get("kind") == "take" and r.get("stage") == stage]


@pytest.mark.slow  # three stage-C runs of the tiny pipeline (a minute of CPU): CI runs it in the slow set
def test_the_teacher_and_proxy_arms_train_stage_c_on_the_students_conditions(pipeline):
    sections = {"stages": {"n_a": 4, "c_steps": 2, "proxy_reward": "digit"}, "teacher": {"max_requests": 12},
                "eval": {"every": 0}}
    _, pcfg, directory = pipeline(**sections)
    assert run_pipeline(pcfg, progress=False).status == "done"
    student_takes = _takes(directory / "conditions.jsonl", "C")
    assert len(student_takes) == 2
    billed_a = len(read_request_log(directory / "teacher" / "requests.log"))

    table = run_arm_pipeline(pcfg, "teacher", progress=False)
    teacher_ledger = arm_dir(pcfg, "teacher") / "conditions.jsonl"
    assert _takes(teacher_ledger, "C") == student_takes  # the same conditions, in the same order
    assert _takes(teacher_ledger, "A") == _takes(directory / "conditions.jsonl", "A")
    records = read_request_log(directory / "teacher" / "requests.log")
    # C's 2 steps x 2 groups, on top of A's and the audits'; the first step's 2 groups are the ones the audits
    # judged (same policy, noise and conditions): answered from the audit ledger, not sent again
    assert len(records) == billed_a + 2
    assert set(billed_per_group(records).values()) == {1}  # no group billed twice
    assert (arm_dir(pcfg, "teacher") / "C" / "judge" / "ledger.sqlite").is_file()

    table = run_arm_pipeline(pcfg, "proxy", progress=False)
    assert _takes(arm_dir(pcfg, "proxy") / "conditions.jsonl", "C") == student_takes
    assert len(read_request_log(directory / "teacher" / "requests.log")) == len(records)  # the proxy pays nothing
    assert set(table) == {"base", "handoff", "student", "teacher", "proxy"}
    assert table["base"]["step"] == 0 and table["handoff"]["step"] == 2
    assert all(row["step"] == 4 for name, row in table.items() if name in ("student", "teacher", "proxy"))
    for row in table.values():
        assert "eval/digit_eval" in row["metrics"]
    gain = table["proxy"]["metrics"]["eval/digit_eval"] - table["handoff"]["metrics"]["eval/digit_eval"]
    assert table["proxy"]["gain"]["eval/digit_eval"] == pytest.approx(gain)
    # its standard error, paired over the held-out prompts, from the per-sample scores beside each evaluation's grid
    means = {name: _prompt_means(run, table[name]["step"]) for name, run in
             (("handoff", directory / "A"), ("proxy", arm_dir(pcfg, "proxy") / "C"), ("student", directory / "C"))}
    diffs = [b - a for a, b in zip(means["handoff"], means["proxy"], strict=True)]
    assert len(diffs) == 2 and table["proxy"]["gain_se"]["eval/digit_eval"] == pytest.approx(
        statistics.stdev(diffs) / math.sqrt(len(diffs)))
    versus = table["student"]["versus"]["proxy"]  # did the student beat the arm without it, by how many SE
    assert versus["diff"]["eval/digit_eval"] == pytest.approx(
        table["student"]["metrics"]["eval/digit_eval"] - table["proxy"]["metrics"]["eval/digit_eval"])
    diffs = [b - a for a, b in zip(means["proxy"], means["student"], strict=True)]
    assert versus["se"]["eval/digit_eval"] == pytest.approx(statistics.stdev(diffs) / math.sqrt(len(diffs)))
    assert "student - proxy" in format_arm_table(table) and " ± " in format_arm_table(table)
    assert json.loads((directory / "arms" / "arms.json").read_text()) == json.loads(json.dumps(table))
    assert arm_table(pcfg) == table  # rerun: every arm is done, nothing trains again
    assert run_arm_pipeline(pcfg, "teacher", progress=False) == table
    assert len(read_request_log(directory / "teacher" / "requests.log")) == len(records)

    # the gate extends A after the arm started: the arm's hand-off is stale and a rerun says so
    ledger = directory / "conditions.jsonl"
    ledger.write_text(ledger.read_text() + json.dumps({"kind": "extend", "key": "gate-9", "amount": 0,
                                                       "budget_a": 4}) + "\n")
    with pytest.raises(UserError, match="stage A changed since this arm started"):
        run_arm_pipeline(pcfg, "proxy", progress=False)


def test_arm_command_line_errors_are_one_line(tmp_path, tiny_model_dir, encode_cache_dir):
    path = write_pipeline(tmp_path / "pipeline.yaml", tiny_model_dir, tmp_path / "runs", encode_cache_dir)
    for extra, expected in ((["--arm", "proxy"], "--arm proxy needs stages.proxy_reward"),
                            (["--arm", "teacher", "--stage", "A"], "give --arm or --stage, not both"),
                            (["--arm", "proxy", "stages.proxy_reward=no_such_scorer"], "stages.proxy_reward: unknown")):
        proc = subprocess.run([sys.executable, "-m", "flowforge.cli", "stages", str(path), *extra],
                              capture_output=True, text=True)
        assert proc.returncode == 2, proc.stderr
        assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs" / "p" / "arms").exists()


def test_an_arm_rerun_under_another_proxy_or_c_override_is_refused_not_returned_stale(tmp_path, tiny_model_dir,
                                                                                     encode_cache_dir):
    """A finished arm's rerun returns its table row without training: were stages.proxy_reward or c_overrides
    changed since, that row would be shown as the new config's. The arm records what it ran with and refuses."""
    path = write_pipeline(tmp_path / "pipeline.yaml", tiny_model_dir, tmp_path / "runs", encode_cache_dir,
                          stages={"proxy_reward": "digit", "c_overrides": ["train.lr=2.0e-4"]})
    pcfg = load_pipeline(path)
    other_reward = load_pipeline(path, ["stages.proxy_reward=jpeg_compressibility"])
    check_arm_settings(other_reward, "proxy", trained=False)  # a first start that stopped before C trained ...
    for arm in ("proxy", "teacher"):
        check_arm_settings(pcfg, arm, trained=False)  # ... is recorded over: nothing was computed under it
        check_arm_settings(pcfg, arm, trained=True)  # the same settings again, the arm trained: accepted
    recorded = json.loads((arm_dir(pcfg, "proxy") / "arm.json").read_text())
    assert recorded == {"stages.c_overrides": ["train.lr=2.0e-4"], "stages.proxy_options": {},
                        "stages.proxy_reward": "digit"}
    with pytest.raises(UserError, match=r'^stages.proxy_reward: arm proxy ran with "digit", this config gives '
                                        r'"jpeg_compressibility"'):
        check_arm_settings(other_reward, "proxy", trained=True)
    check_arm_settings(other_reward, "teacher", trained=True)  # the teacher arm does not use the proxy reward
    other_lr = load_pipeline(path, ["stages.c_overrides=[train.lr=5.0e-4]"])
    for arm in ("proxy", "teacher"):
        with pytest.raises(UserError, match=rf"^stages.c_overrides: arm {arm} ran with \["):
            check_arm_settings(other_lr, arm, trained=True)
    assert json.loads((arm_dir(pcfg, "proxy") / "arm.json").read_text()) == recorded  # the record is kept


def test_one_teacher_budget_caps_stage_a_the_audits_and_the_teacher_arm_together(tmp_path):
    """teacher.max_requests caps the sum of every teacher ledger of the pipeline: each spender's ledger gets the
    budget less what the others billed, whichever ran first (an arm before C, an extension of A after both), and a
    spender left nothing is refused, never handed max_billed=0 (no limit)."""
    from flowforge.orchestrate.directory import PipelineLayout
    from flowforge.orchestrate.budget import teacher_cap, teacher_spent
    from flowforge.rewards.judge.ledger import BudgetExhausted, RequestLedger

    path = write_pipeline(tmp_path / "p.yaml", tmp_path / "model", tmp_path / "runs", tmp_path / "cache",
                          teacher={"max_requests": 10})
    pcfg = load_pipeline(path)
    layout = PipelineLayout.of(pcfg)

    def bill(ledger_path, n):
        book = RequestLedger(ledger_path)
        for i in range(n):
            key = f"{ledger_path.parent.parent.name}-{i}"
            book.begin(key, model="m", template_sha256="t", request={})
            book.finish_attempt(book.start_attempt(key, "first"), "timeout")
            book.finish(key, "failed", scores=None, response=[])
        book.close()

    bill(layout.a_judge_ledger, 6)
    bill(layout.arm_judge_ledger("teacher"), 3)
    assert teacher_spent(pcfg) == 9
    assert teacher_cap(pcfg, layout.audit_judge_ledger, "audits") == 1  # not 10 - 6 = 4: the arm spent 3
    assert teacher_cap(pcfg, layout.a_judge_ledger, "A") == 7  # A's own 6 count inside its cap
    assert teacher_cap(pcfg, layout.arm_judge_ledger("teacher"), "arm") == 4
    bill(layout.audit_judge_ledger, 1)
    with pytest.raises(BudgetExhausted, match="teacher.max_requests=10 was spent"):
        teacher_cap(pcfg, layout.arm_judge_ledger("other"), "another spender")
    unlimited = load_pipeline(path, ["teacher.max_requests=0"])
    assert teacher_cap(unlimited, layout.audit_judge_ledger, "audits") == 0
