"""The three-stage pipeline end to end on a tiny random SD3 with a real teacher judge server: the quality gate (stop,
and extension of A up to the cap), the audit stop at the last good checkpoint, and kill -9 resume with the teacher's
request log showing no request twice."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flowforge.orchestrate.stages import newest_step, open_ledger, run_pipeline
from flowforge.reward_model.data import read_judged_groups
from flowforge.rewards.judge.protocol import billed_per_group, read_request_log
from tests.orchestrate.support import read_report


def log_keys(path: Path) -> list[str]:
    """The body keys of a judge server's request log, in the order received."""
    return [r["key"] for r in read_request_log(path)]


@pytest.mark.slow  # end-to-end runs (minutes of CPU together): CI runs them in the slow set
def test_gate_failure_extends_stage_a_up_to_the_cap_then_stops(pipeline):
    _, pcfg, directory = pipeline(stages={"n_a": 4, "extend_delta": 2, "extend_cap": 6, "on_gate_fail": "extend"},
                                  # reachable (check passes), never met; the margin over the baselines neither
                                  student={"gate": {"max_mae": 0.0, "min_spearman_above_baselines": 1.0}})
    outcome = run_pipeline(pcfg, progress=False)
    assert outcome.status == "gate_failed"
    assert "> max_mae=0" in outcome.reason and "cannot be extended further" in outcome.reason
    ledger = open_ledger(pcfg)
    assert ledger.budget("A") == 6 and ledger.used == {"A": 6, "C": 0} and ledger.extensions == {"gate-0": 2}
    assert newest_step(directory / "A") == 3  # 2 steps, then 1 more on the extension
    gates = [json.loads((directory / "B" / f"attempt_{i}" / "gate.json").read_text()) for i in (0, 1)]
    assert [g["groups"] for g in gates] == [4, 6] and not any(g["passed"] for g in gates)
    # the constant predictor: the median of the training split's marks, scored on the test split's
    judged = {g.key: g for g in read_judged_groups(directory / "A" / "judge" / "ledger.sqlite", {})}
    assert any(g["baselines"] for g in gates)  # some attempt had test groups: the checks below ran
    for i, g in enumerate(gates):
        splits = json.loads((directory / "B" / f"attempt_{i}" / "run.json").read_text())["splits"]
        marks = {name: torch.tensor([m for key in keys for m in judged[key].scores], dtype=torch.float64)
                 for name, keys in splits.items()}
        assert g["baselines"]["constant"]["mark"] == pytest.approx(float(marks["train"].median()))
        if len(marks["test"]):
            expected = float((marks["test"] - marks["train"].median()).abs().mean())
            assert g["constant_mae"] == pytest.approx(expected) == g["baselines"]["constant"]["mae"]
            # every baseline the student did not beat by 1.0 Spearman (the constant's 0: a perfect student only) is a
            # reason of the failed gate
            assert sorted(g["baselines"]) == ["constant", "init"]
            # the run's eval judge beside them, for reference: agreement with the teacher, never a reason
            assert set(g["eval_judges"]) == {"digit_eval"} and g["eval_judges"]["digit_eval"]["groups"] >= 1
            assert not any("digit_eval" in r for r in g["reasons"])
            assert all(f"is not 1 above the {name} baseline's" in " ".join(g["reasons"]) for name in g["baselines"])
    assert not (directory / "C").exists()
    summary = json.loads((directory / "summary.json").read_text())
    assert summary["status"] == "gate_failed" and summary["teacher"]["train_groups"] == 6
    assert summary["teacher"]["server_log"]["duplicates"] == 0
    # the report leads with the verdict, links only what exists (C never ran: no link to C/report.html)
    page, text = read_report(directory)
    assert "pipeline stopped at the quality gate: " + outcome.reason in text
    billed = summary["teacher"]["http_requests"]
    assert f"teacher budget spent: {billed} billed requests (no cap: teacher.max_requests is 0)" in text
    assert 'href="A/report.html"' in page and 'href="C/report.html"' not in page
    assert re.search(r"<tr><td>C</td><td>[^<]*</td><td>did not run</td><td>–</td></tr>", page)
    assert [f'href="B/attempt_{i}/gate.json"' in page for i in (0, 1)] == [True, True]
    assert "gate 0" in text and "gate 1" in text  # the agreement table: one row per gate attempt
    assert summary["A"]["headline"] and "eval/digit_eval" in summary["A"]["headline"]
    assert sorted(r["stage"] for r in summary["timeline"]) == ["A", "B0", "B1"]  # A, its gate, A extended, again
    # a rerun finds the same verdict without training or asking the teacher again
    before = log_keys(directory / "teacher" / "requests.log")
    assert run_pipeline(pcfg, progress=False).status == "gate_failed"
    assert log_keys(directory / "teacher" / "requests.log") == before
    # ... and refuses to re-read it under other gate values (it would pass or fail what it never judged)
    from flowforge.runtime.errors import UserError

    _, other, _ = pipeline(stages={"n_a": 4, "extend_delta": 2, "extend_cap": 6, "on_gate_fail": "extend"},
                           student={"gate": {"max_mae": 0.0, "min_spearman_above_baselines": 0.5}})
    gate_file = directory / "B" / "attempt_1" / "gate.json"
    kept = gate_file.read_bytes()
    with pytest.raises(UserError, match=r"judged under other student.gate values: min_spearman_above_baselines=1\.0 "
                                        r"\(now 0\.5\); restore them, or run the changed gate in a new pipeline"):
        run_pipeline(other, progress=False)
    assert gate_file.read_bytes() == kept and log_keys(directory / "teacher" / "requests.log") == before


def test_audit_below_threshold_stops_stage_c_at_the_last_good_checkpoint(pipeline):
    _, pcfg, directory = pipeline(stages={"n_a": 4, "c_steps": 2, "student_serving": "in_process"},
                                  audit={"first_groups": 2, "every": 0, "min_spearman": 1.0,
                                         "min_pairwise_accuracy": 1.0})
    outcome = run_pipeline(pcfg, progress=False)
    assert outcome.status == "audit_stopped" and "audit at step 2" in outcome.reason
    assert outcome.last_good == str(directory / "A" / "checkpoints" / "step_000002")
    audits = [json.loads(line) for line in (directory / "C" / "audit.jsonl").read_text().splitlines()]
    assert len(audits) == 1 and audits[0]["step"] == 2 and not audits[0]["passed"] and audits[0]["groups"] == 2
    ledger = open_ledger(pcfg)
    audited = audits[0]["conditions"]
    assert set(audited) == set(ledger.with_state("judged", "C")) and len(audited) == 2
    assert ledger.with_state("trained_on", "C") == []  # stopped before the update on the student's verdict
    assert newest_step(directory / "C") == -1
    summary = json.loads((directory / "summary.json").read_text())
    assert summary["status"] == "audit_stopped" and summary["teacher"]["audit_groups"] == 2
    page, text = read_report(directory)
    assert "pipeline stopped by a teacher audit: audit at step 2" in text
    assert [(p["kind"], p["passed"]) for p in summary["agreement"]] == [("gate", True), ("audit", False)]
    assert summary["agreement"][1]["position"] == 4 + 2  # A's 4 conditions, then C's first step's 2
    assert "audit at C step 2" in text and "teacher-student agreement over the pass" in page
    again = run_pipeline(pcfg, progress=False)  # the stop is read back, nothing runs again
    assert (again.status, again.last_good) == ("audit_stopped", outcome.last_good)
    assert len((directory / "C" / "audit.jsonl").read_text().splitlines()) == 1
    # the policy handed on is A's: the hand-off's evaluation is the student arm's, and nothing else is evaluated
    from flowforge.orchestrate.arms import arm_table

    table = arm_table(pcfg)
    assert table["student"]["source"] == "handoff" and table["student"]["metrics"] == table["handoff"]["metrics"]
    assert summary["C"]["last_good_eval"] == {} and not (directory / "last_good").exists()


@pytest.mark.slow  # ~40 s of CPU here: A, B and two steps of C
def test_steps_the_teacher_cannot_order_stop_stage_c_once_the_unaudited_budget_is_spent(pipeline):
    """Issue 39: audited groups whose marks all tie within audit.tie_margin gave no verdict and no stop, for ever.
    The brightness teacher's marks of one group lie within 0.9: steps 2 and 3 are audited (first_groups 4 of M 2),
    step 2 spends the budget of 1, step 3 stops C before its update."""
    _, pcfg, directory = pipeline(stages={"n_a": 4, "c_steps": 2, "student_serving": "in_process"},
                                  teacher={"scorer": "tests.serve.judge_support:Brightness"},
                                  audit={"first_groups": 4, "every": 0, "tie_margin": 0.9, "max_unaudited": 1})
    outcome = run_pipeline(pcfg, progress=False)
    assert outcome.status == "unaudited_stopped", outcome
    assert outcome.reason == ("audit at step 3: the teacher could not order any of the 2 audited groups (marks "
                              "within audit.tie_margin=0.9) at 2 audited steps > audit.max_unaudited=1")
    audits = [json.loads(line) for line in (directory / "C" / "audit.jsonl").read_text().splitlines()]
    assert [(a["step"], a["verdict"], a["unaudited"], a["stop"]) for a in audits] == [
        (2, "pending", True, None), (3, "pending", True, "unaudited")]
    assert [a["step"] for a in audits if a["passed"] is False] == []  # no agreement verdict failed
    assert open_ledger(pcfg).with_state("trained_on", "C") != []  # step 2 trained, step 3 did not
    assert (directory / "C" / "checkpoints").is_dir() is False or newest_step(directory / "C") <= 2
    summary = json.loads((directory / "summary.json").read_text())
    assert summary["status"] == "unaudited_stopped"
    _, text = read_report(directory)
    assert "pipeline stopped: the teacher could not order the audited groups: " + outcome.reason in text
    assert [p["verdict"] for p in summary["agreement"]] == ["passed", "pending", "pending"]  # the gate, 2 audits
    assert "(pending: the teacher could not order the audited groups)" in text
    again = run_pipeline(pcfg, progress=False)  # the stop is read back, nothing runs again
    assert (again.status, again.reason) == (outcome.status, outcome.reason)
    assert len((directory / "C" / "audit.jsonl").read_text().splitlines()) == 2


def _in_flight(db: Path) -> int:
    """Attempts of a judge ledger recorded as sent and not (yet) as answered, read-only."""
    if not db.is_file():
        return 0
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return int(con.execute("SELECT COUNT(*) FROM attempts WHERE outcome = 'pending'").fetchone()[0])
    except sqlite3.OperationalError:  # not created yet
        return 0
    finally:
        con.close()


def _kill_in_the_window(proc: subprocess.Popen, directory: Path, stage: str) -> bool:
    """SIGKILL ``proc`` while a request of ``stage``'s judge is in flight -- recorded as sent, its answer not
    recorded -- when such a moment is caught (the process frozen with SIGSTOP to look); else kill it anyway.
    Returns whether it was caught in the window."""
    db = directory / stage / "judge" / "ledger.sqlite"
    for _ in range(400):
        os.kill(proc.pid, signal.SIGSTOP)
        if _in_flight(db):
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            return True
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return False


def _wait_for_lines(path: Path, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text().count("\n") >= 1:
            return
        assert proc.poll() is None, f"the pipeline exited early ({proc.returncode})"
        time.sleep(0.1)
    raise AssertionError(f"{path} got no line in {timeout} s")


def _servers_of(token_file: Path) -> list[int]:
    """Pids of processes started with ``token_file`` on their command line (this test's judge servers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(token_file).encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


@pytest.mark.slow  # a pipeline killed and rerun (multi-process, tens of seconds): CI runs it after the default set
@pytest.mark.parametrize("kill_in", ["A", "C"])
def test_kill_9_and_rerun_never_bill_a_group_twice(pipeline, kill_in):
    """Killed while a judge request is in flight (between send and record); the rerun continues the stage: the
    teacher's own request log shows every group billed exactly once, and the group whose answer the crash swallowed
    is dropped (zero weight), never asked again."""
    # split_seed 11: each of A's three steps judges one train-split and one test-split cluster (demo:train, pass
    # seed 0), so whichever step the kill loses, stage B still has groups of both splits to train and gate on
    path, pcfg, directory = pipeline(stages={"n_a": 6, "c_steps": 3}, student={"split_seed": 11},
                                     audit={"first_groups": 2, "every": 0})
    command = [sys.executable, "-m", "flowforge.cli", "stages", str(path), "--no-progress"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with open(directory.parents[1] / "first.log", "w") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        _wait_for_lines(directory / kill_in / "metrics.jsonl", proc)
        caught = _kill_in_the_window(proc, directory, kill_in)
    sent_before = log_keys(directory / "teacher" / "requests.log")
    assert sent_before and proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while _servers_of(directory / "judge.token") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _servers_of(directory / "judge.token") == []  # the judge servers died with the pipeline
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    keys = log_keys(directory / "teacher" / "requests.log")
    assert len(keys) == len(set(keys)) and keys[:len(sent_before)] == sent_before  # none sent twice
    per_group = billed_per_group(read_request_log(directory / "teacher" / "requests.log"))
    assert set(per_group.values()) == {1}, per_group  # the server's own count: every group billed once
    rows = [json.loads(line) for line in (directory / kill_in / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("reward/vlm_judge_served_from_ledger", 0) > 0 for r in rows)  # the replayed steps' answers
    student_keys = log_keys(directory / "student" / "requests.log")
    assert len(student_keys) == len(set(student_keys))
    ledger = open_ledger(pcfg)
    assert ledger.used == {"A": 6, "C": 6}
    takes = [json.loads(line) for line in (directory / "conditions.jsonl").read_text().splitlines()[1:]]
    handed = [i for t in takes if t["kind"] == "take" for i in t["ids"]]
    assert len(handed) == len(set(handed)) == 12  # no condition used twice
    # a step whose groups were all lost is skipped (not trained on); every other step trains on its usable groups
    assert len(ledger.with_state("trained_on", "A")) >= 4 and len(ledger.with_state("trained_on", "C")) >= 4
    assert newest_step(directory / "A") == 3 and newest_step(directory / "C") == 6
    summary = json.loads((directory / "summary.json").read_text())
    assert summary["status"] == "done" and summary["teacher"]["server_log"] == {
        "requests": len(keys), "groups": len(per_group), "max_per_group": 1, "duplicates": 0}
    lost = summary["teacher"]["failed_groups"]  # killed in A's window: the lost groups are the teacher's
    assert (lost >= 1 if caught else lost >= 0) if kill_in == "A" else lost == 0
    assert summary["teacher"]["train_groups"] + lost == 6
    # the ledgers count every attempt recorded as sent; one killed before it left is counted (lost) but never
    # reached the server: the ledgers' bill is the server's, plus at most the lost attempts
    assert len(keys) <= summary["teacher"]["http_requests"] <= len(keys) + lost
    assert summary["A"]["eval"]["step"] == 3 and summary["C"]["eval"]["step"] == 6
    assert [a["step"] for a in summary["C"]["audits"]] == [3] and summary["C"]["audits"][0]["passed"]
    page, _ = read_report(directory)  # one report linking the stages' own
    for linked in ("A/report.html", "B/attempt_0/gate.json", "C/report.html"):
        assert f'href="{linked}"' in page and (directory / linked).is_file()


def test_one_stage_at_a_time_with_a_teacher_the_user_started(pipeline, tmp_path, monkeypatch, capsys):
    from flowforge.cli import main
    from tests.serve.judge_support import TOKEN_ENV, start, stop

    (tmp_path / "token").write_text("s3cret")
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    server, url = start(["-m", "flowforge.cli", "serve", "judge", "--scorer",
                         "flowforge.orchestrate.demo:PromptDigitScorer", "--port", "0", "--token-file",
                         str(tmp_path / "token"), "--model-name", "digit-teacher", "--request-log",
                         str(tmp_path / "teacher.log"), "--num-threads", "1"])
    try:
        path, pcfg, directory = pipeline(stages={"n_a": 4, "c_steps": 1, "student_serving": "in_process"},
                                         teacher={"url": url + "/v1", "api_key_env": TOKEN_ENV, "scorer": ""},
                                         audit={"first_groups": 2, "min_pairwise_accuracy": 1.0})
        for early in ("B", "C"):
            with pytest.raises(ValueError, match="run `flowforge stages CONFIG --stage A`|run stage B first"):
                run_pipeline(pcfg, stage=early, progress=False)
        outcome = run_pipeline(pcfg, stage="A", progress=False)
        assert (outcome.status, outcome.stages_run) == ("partial", ["A"])
        assert newest_step(directory / "A") == 2 and not (directory / "B").exists()
        summary = json.loads((directory / "summary.json").read_text())  # says what ran, in plain text
        assert (summary["status"], summary["stages_run"]) == ("partial", ["A"])
        assert "digit_eval" in summary["A"]["headline"] and "<" not in summary["A"]["headline"]
        page, text = read_report(directory)
        assert "pipeline partly run: ran stage A only" in " ".join(text.split())
        assert "finished" not in text and 'class="good">finished' not in page
        assert not (directory / "teacher").exists()  # the user's server, not one the pipeline started
        assert len(log_keys(tmp_path / "teacher.log")) == 4  # 2 steps x 2 groups; evaluation never asks the teacher
        assert run_pipeline(pcfg, stage="B", progress=False).stages_run == ["B"]
        assert json.loads((directory / "B" / "attempt_0" / "gate.json").read_text())["passed"]
        assert main(["stages", str(path), "--stage", "C", "--no-progress"]) == 3  # the audit stops C
        err = capsys.readouterr().err
        assert "pipeline stopped: audit at step 2" in err and "last good checkpoint:" in err
        assert len(log_keys(tmp_path / "teacher.log")) == 4 + 2  # + the audit's 2 groups (C evaluates with the student)
    finally:
        stop(server)


def test_a_group_without_marks_is_dropped_and_the_stage_goes_on(pipeline, tmp_path, monkeypatch):
    """The teacher never answers the first group in the strict format: after its bounded attempts the group gets no
    marks, is dropped with zero weight and counted, and stage A trains on; a step is never stopped by it."""
    from tests.serve.judge_support import TOKEN_ENV, start, stop

    (tmp_path / "token").write_text("s3cret")
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    script = tmp_path / "script.json"
    script.write_text(json.dumps(["malformed", "wrong_count", "malformed"]))
    server, url = start(["-m", "tests.serve.judge_support", "scripted", "--script", str(script), "--token-file",
                         str(tmp_path / "token"), "--request-log", str(tmp_path / "teacher.log")])
    try:
        _, pcfg, directory = pipeline(stages={"n_a": 4}, teacher={
            "url": url + "/v1", "api_key_env": TOKEN_ENV, "scorer": "", "model": "scripted",
            "judge": {"frames": 1, "max_side": 32, "max_concurrency": 1, "max_attempts": 3, "retry_backoff_s": 0.01}})
        assert run_pipeline(pcfg, stage="A", progress=False).status == "partial"
    finally:
        stop(server)
    rows = [json.loads(line) for line in (directory / "A" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/judge_failed_groups"] for r in rows] == [1.0, 0.0]
    assert [r["train/skipped"] for r in rows] == [0.0, 0.0]  # the other group of step 1 was trained on
    assert len(log_keys(tmp_path / "teacher.log")) == 3 + 3  # 3 attempts for the failed group, 1 per other group
    from flowforge.rewards.judge.ledger import RequestLedger

    book = RequestLedger(directory / "A" / "judge" / "ledger.sqlite")
    assert sorted(e.status for e in book.entries()) == ["malformed", "ok", "ok", "ok"] and book.billed() == 6
    ledger = open_ledger(pcfg)
    assert len(ledger.with_state("judged", "A")) == 3 and len(ledger.with_state("trained_on", "A")) == 4


def test_the_teacher_budget_stops_the_pipeline_before_it_is_exceeded(pipeline):
    """teacher.max_requests=3 with 2 groups a step: step 1 spends 2, step 2 would need 2 of the 1 left -- the
    pipeline stops there, nothing of step 2 sent; a rerun with a larger budget continues without re-sending."""
    _, pcfg, directory = pipeline(stages={"n_a": 4}, teacher={"max_requests": 3})
    outcome = run_pipeline(pcfg, stage="A", progress=False)
    assert outcome.status == "budget_exhausted" and "cannot pay for 2 more groups" in outcome.reason
    first = log_keys(directory / "teacher" / "requests.log")
    assert len(first) == 2 and newest_step(directory / "A") == 1
    _, more, _ = pipeline(stages={"n_a": 4}, teacher={"max_requests": 4})
    assert run_pipeline(more, stage="A", progress=False).status == "partial"
    keys = log_keys(directory / "teacher" / "requests.log")
    assert len(keys) == 4 and keys[:2] == first
    assert set(billed_per_group(read_request_log(directory / "teacher" / "requests.log")).values()) == {1}


def test_teacher_scorer_options_reach_the_judge_server_the_pipeline_starts(pipeline):
    """teacher.scorer_options are the keyword options of the teacher's scorer: the pipeline writes them to its own
    ``teacher/scorer_options.yaml`` and starts ``flowforge serve judge --options`` on it (a scale of 0.1 on the
    brightness teacher: every judged mark is at most 0.1, where brightness alone is ~0.5)."""
    import yaml

    _, pcfg, directory = pipeline(stages={"n_a": 2}, teacher={"scorer": "tests.serve.judge_support:Brightness",
                                                              "scorer_options": {"scale": 0.1}})
    assert run_pipeline(pcfg, stage="A", progress=False).status == "partial"
    assert yaml.safe_load((directory / "teacher" / "scorer_options.yaml").read_text()) == {"scale": 0.1}
    marks = [m for g in read_judged_groups(directory / "A" / "judge" / "ledger.sqlite") for m in g.scores]
    assert len(marks) == 8 and all(0.0 <= m <= 0.1 for m in marks) and max(marks) > 0.01  # 2 groups x K 4


def test_evaluation_asks_the_teacher_only_for_eval_teacher_groups(pipeline):
    """Evaluation never calls the teacher unless eval.teacher_groups asks: then the first N held-out groups of each
    eval (2 evals in A: at the start and the end), bound as 'eval' and billed like the rest."""
    _, pcfg, directory = pipeline(stages={"n_a": 4}, eval={"teacher_groups": 1})
    assert run_pipeline(pcfg, stage="A", progress=False).status == "partial"
    records = read_request_log(directory / "teacher" / "requests.log")
    assert len(records) == 4 + 2 and set(billed_per_group(records).values()) == {1}
    from flowforge.rewards.judge.ledger import RequestLedger

    book = RequestLedger(directory / "A" / "judge" / "ledger.sqlite")
    purposes = sorted((e.slot.purpose, e.slot.step) for e in book.entries())
    assert purposes == [("eval", 0), ("eval", 2), ("train", 0), ("train", 0), ("train", 1), ("train", 1)]
    evals = [json.loads(line) for line in (directory / "A" / "eval.jsonl").read_text().splitlines()]
    assert all(0.0 <= e["eval/vlm_judge"] <= 1.0 and "eval/digit_eval" in e for e in evals) and len(evals) == 2


def test_a_teacher_unreachable_from_the_start_stops_stage_a_and_a_rerun_retries_it(pipeline, tmp_path, monkeypatch):
    """Issue 42: with the teacher unreachable during all of A, A's conditions were used up with 0 judged groups, A
    counted as done, and every rerun stopped at stage B. Now A stops at its first step in one line (exit 2), before
    anything is trained or saved; the rerun with the teacher up (a real loopback judge server) runs A on the same
    conditions, every group judged."""
    import socket

    from tests.cli.harness import run_cli
    from tests.rewards.loopback import TOKEN, TOKEN_ENV, judge_server

    with socket.socket() as probe:  # a loopback port where nothing listens (closed again before the run)
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}/v1"
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    judge = {"frames": 1, "max_side": 32, "max_attempts": 1, "retry_backoff_s": 0.0}
    teacher = {"api_key_env": TOKEN_ENV, "scorer": "", "model": "loopback", "judge": judge}
    path, pcfg, directory = pipeline(stages={"n_a": 4}, teacher={**teacher, "url": dead})
    rc, _, err = run_cli(["stages", path, "--stage", "A", "--no-progress"], tmp_path, in_process=True)
    lines = err.strip().splitlines()  # the run's log lines (the judge's warnings), then one error line
    assert rc == 2 and "Traceback" not in err and "internal error" not in err, err
    assert [line for line in lines if line.startswith("error:")] == lines[-1:]
    for expected in ("stage A: the teacher judged none of the 2 groups of step 0", "is unreachable",
                     "rerun the same command"):
        assert expected in lines[-1], (expected, lines[-1])
    ledger = open_ledger(pcfg)
    assert newest_step(directory / "A") == -1 and ledger.with_state("judged") == []
    taken = ledger.takes[("A", 0)]["ids"]
    assert (directory / "conditions.jsonl").is_file()  # nothing of the pipeline's was removed
    with judge_server() as (url, counter):
        path, pcfg, _ = pipeline(stages={"n_a": 4}, teacher={**teacher, "url": url})
        assert run_pipeline(pcfg, stage="A", progress=False).status == "partial"
    ledger = open_ledger(pcfg)
    assert newest_step(directory / "A") == 2 and ledger.takes[("A", 0)]["ids"] == taken  # the same conditions
    assert len(ledger.with_state("judged", "A")) == 4 and counter.total == 4 and ledger.used["A"] == 4
