"""The three-stage pipeline end to end on a tiny random SD3 with a real teacher judge server: the quality gate (stop,
and extension of A up to the cap), the audit stop at the last good checkpoint, and kill -9 resume with the teacher's
request log showing no request twice."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowforge.orchestrate.config import check_pipeline, load_pipeline
from flowforge.orchestrate.stages import newest_step, open_ledger, run_pipeline
from tests.orchestrate.support import write_pipeline


@pytest.fixture
def pipeline(tiny_model_dir, tmp_path, encode_cache_dir):
    def make(**sections):
        path = write_pipeline(tmp_path / "pipeline.yaml", tiny_model_dir, tmp_path / "runs", encode_cache_dir,
                              **sections)
        pcfg = load_pipeline(path)
        check_pipeline(pcfg)
        return path, pcfg, tmp_path / "runs" / "p"
    return make


def log_keys(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line] if path.is_file() else []


def test_gate_failure_extends_stage_a_up_to_the_cap_then_stops(pipeline):
    _, pcfg, directory = pipeline(stages={"n_a": 4, "extend_delta": 2, "extend_cap": 6, "on_gate_fail": "extend"},
                                  student={"gate": {"min_groups": 1000}})
    outcome = run_pipeline(pcfg, progress=False)
    assert outcome.status == "gate_failed"
    assert "min_groups=1000" in outcome.reason and "cannot be extended further" in outcome.reason
    ledger = open_ledger(pcfg)
    assert ledger.budget("A") == 6 and ledger.used == {"A": 6, "C": 0} and ledger.extensions == {"gate-0": 2}
    assert newest_step(directory / "A") == 3  # 2 steps, then 1 more on the extension
    gates = [json.loads((directory / "B" / f"attempt_{i}" / "gate.json").read_text()) for i in (0, 1)]
    assert [g["groups"] for g in gates] == [4, 6] and not any(g["passed"] for g in gates)
    assert not (directory / "C").exists()
    summary = json.loads((directory / "summary.json").read_text())
    assert summary["status"] == "gate_failed" and summary["teacher"]["train_groups"] == 6
    assert summary["teacher"]["server_log"]["duplicates"] == 0
    # a rerun finds the same verdict without training or asking the teacher again
    before = log_keys(directory / "teacher" / "requests.log")
    assert run_pipeline(pcfg, progress=False).status == "gate_failed"
    assert log_keys(directory / "teacher" / "requests.log") == before


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
    again = run_pipeline(pcfg, progress=False)  # the stop is read back, nothing runs again
    assert (again.status, again.last_good) == ("audit_stopped", outcome.last_good)
    assert len((directory / "C" / "audit.jsonl").read_text().splitlines()) == 1


def _answered(db: Path) -> int:
    """HTTP requests answered in a judge ledger, read-only (never blocks the stopped writer)."""
    if not db.is_file():
        return 0
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return int(con.execute("SELECT COALESCE(SUM(attempts), 0) FROM requests").fetchone()[0])
    finally:
        con.close()


def _kill_between_requests(proc: subprocess.Popen, directory: Path) -> None:
    """SIGKILL ``proc`` at a moment when no judge request is in flight: freeze it, let the servers log what
    reached them, and kill only when every logged request has its answer in a ledger."""
    servers = {"teacher": [directory / "A" / "judge" / "ledger.sqlite",
                           directory / "C" / "audit" / "judge" / "ledger.sqlite"],
               "student": [directory / "C" / "judge" / "ledger.sqlite"]}
    for _ in range(200):
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.3)
        if all(len(log_keys(directory / name / "requests.log")) == sum(_answered(db) for db in ledgers)
               for name, ledgers in servers.items()):
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            return
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.05)
    raise AssertionError("never caught the pipeline between two teacher requests")


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


@pytest.mark.parametrize("kill_in", ["A", "C"])
def test_kill_9_and_rerun_continues_without_sending_a_teacher_request_twice(pipeline, kill_in):
    path, pcfg, directory = pipeline(stages={"n_a": 6, "c_steps": 3},
                                     audit={"first_groups": 2, "every": 0})
    command = [sys.executable, "-m", "flowforge.cli", "stages", str(path), "--no-progress"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with open(directory.parents[1] / "first.log", "w") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        _wait_for_lines(directory / kill_in / "metrics.jsonl", proc)
        _kill_between_requests(proc, directory)
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
    rows = [json.loads(line) for line in (directory / kill_in / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("reward/vlm_judge_served_from_ledger", 0) > 0 for r in rows)  # the replayed steps' answers
    student_keys = log_keys(directory / "student" / "requests.log")
    assert len(student_keys) == len(set(student_keys))
    ledger = open_ledger(pcfg)
    assert ledger.used == {"A": 6, "C": 6}
    takes = [json.loads(line) for line in (directory / "conditions.jsonl").read_text().splitlines()[1:]]
    handed = [i for t in takes if t["kind"] == "take" for i in t["ids"]]
    assert len(handed) == len(set(handed)) == 12  # no condition used twice
    assert len(ledger.with_state("trained_on", "A")) == 6 and len(ledger.with_state("trained_on", "C")) == 6
    assert newest_step(directory / "A") == 3 and newest_step(directory / "C") == 6
    summary = json.loads((directory / "summary.json").read_text())
    assert summary["status"] == "done" and summary["teacher"]["server_log"] == {"requests": len(keys),
                                                                               "duplicates": 0}
    assert summary["teacher"]["train_groups"] == 6 and summary["teacher"]["audit_groups"] == 2
    assert summary["savings"] == {"c_groups": 6, "teacher_requests_if_A": 6, "audit_groups": 2,
                                  "teacher_requests_saved": 4}
    assert summary["A"]["eval"]["step"] == 3 and summary["C"]["eval"]["step"] == 6
    assert [a["step"] for a in summary["C"]["audits"]] == [3] and summary["C"]["audits"][0]["passed"]
    page = (directory / "report.html").read_text()  # one report linking the stages' own
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
        assert run_pipeline(pcfg, stage="A", progress=False).status == "done"
        assert newest_step(directory / "A") == 2 and not (directory / "B").exists()
        assert not (directory / "teacher").exists()  # the user's server, not one the pipeline started
        assert len(log_keys(tmp_path / "teacher.log")) == 4 + 2 + 2  # 2 steps x 2 groups + 2 evals x 2 prompts
        assert run_pipeline(pcfg, stage="B", progress=False).status == "done"
        assert json.loads((directory / "B" / "attempt_0" / "gate.json").read_text())["passed"]
        assert main(["stages", str(path), "--stage", "C", "--no-progress"]) == 3  # the audit stops C
        err = capsys.readouterr().err
        assert "pipeline stopped: audit at step 2" in err and "last good checkpoint:" in err
        assert len(log_keys(tmp_path / "teacher.log")) == 8 + 2  # + the audit's 2 groups (C evaluates with the student)
    finally:
        stop(server)
