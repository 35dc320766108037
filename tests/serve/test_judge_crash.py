"""Crash and resume of the ``vlm_judge`` client against ``flowforge serve judge`` on loopback: killed (SIGKILL, or
stopped after any ledger commit) at every point of a request's life, the rerun never sends a body twice, and the
servers' own request logs agree with the ledger's bill. Servers and helpers: :mod:`tests.serve.test_judge_server`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.serve import judge_support as S
from tests.serve.test_judge_server import (  # noqa: F401 -- the fixtures, used by name
    _billed_by_server, _brightness, _lines, _scripted_judge, _token_env, scorer_server, scripted_server, token_file)


# ------------------------------------------------------------------------------------------------ crash + resume

def _drive(url: str, ledger: Path, *extra: str, model: str = "brightness") -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(S.ROOT)}
    return subprocess.run([sys.executable, "-m", "tests.serve.judge_support", "drive", "--base-url", url + "/v1",
                           "--ledger", str(ledger), "--groups", "6", "--model", model, *extra], cwd=S.ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_run_killed_after_recording_resumes_without_sending_any_request_twice(scorer_server, tmp_path):
    url, log = scorer_server
    ledger = tmp_path / "run" / "judge" / "ledger.sqlite"
    before = len(_lines(log))
    killed = _drive(url, ledger, "--kill-after", "3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert len(_lines(log)) == before + 3
    resumed = _drive(url, ledger)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    metrics = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert (metrics["served_from_ledger"], metrics["requests_sent"], metrics["failures"]) == (3, 3, 0)
    rerun = _drive(url, ledger)
    metrics = json.loads(rerun.stdout.strip().splitlines()[-1])
    assert (metrics["served_from_ledger"], metrics["requests_sent"]) == (6, 0)
    assert _billed_by_server(log, before) == [1] * 6  # the server's own log: every group billed exactly once


def test_kill_9_between_send_and_record_never_bills_a_group_twice(scorer_server, tmp_path):
    """The answer of the 3rd group has arrived, the ledger has it as sent (pending) but not its answer, and the
    process dies. The rerun finds the attempt in flight: lost, billed, never sent again -- the group scores NaN
    (dropped with zero weight by the trainer) and every other group is served or sent once."""
    url, log = scorer_server
    ledger = tmp_path / "run" / "judge" / "ledger.sqlite"
    before = len(_lines(log))
    killed = _drive(url, ledger, "--kill-in-window", "3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert len(_lines(log)) == before + 3  # the server answered 3
    resumed = _drive(url, ledger)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    metrics = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert (metrics["served_from_ledger"], metrics["lost"], metrics["failures"], metrics["requests_sent"]) == \
        (3, 1, 1, 3)
    assert _billed_by_server(log, before) == [1] * 6
    from flowforge.rewards.judge.ledger import RequestLedger

    book = RequestLedger(ledger)
    lost = book.failures()
    assert [(f["status"], f["attempts"]) for f in lost] == [("lost", 1)] and book.billed() == 6
    assert len(_lines(log)) - before == book.billed()  # the ledger's billing agrees with the server's


def test_kill_9_while_the_request_is_in_flight_never_bills_a_group_twice(scripted_server, tmp_path):
    """Killed from outside while the judge is still working on the 3rd request (the server sleeps 3 s before it
    answers): the request left, the answer never came back."""
    url, script, log = scripted_server
    script.write_text(json.dumps(["ok", "ok", "sleep:3"]))
    ledger = tmp_path / "run" / "judge" / "ledger.sqlite"
    before = len(_lines(log))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(S.ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tests.serve.judge_support", "drive", "--base-url", url + "/v1",
                             "--ledger", str(ledger), "--groups", "6", "--model", "scripted"], cwd=S.ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(_lines(log)) < before + 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert len(_lines(log)) == before + 3, "the 3rd request never reached the server"
    finally:
        proc.kill()
        proc.wait()
    resumed = _drive(url, ledger, model="scripted")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    metrics = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert (metrics["lost"], metrics["requests_sent"]) == (1, 3)
    assert _billed_by_server(log, before) == [1] * 6


class _Killed(BaseException):
    """Stands for SIGKILL in the sweep below: raised right after a COMMIT, caught by nothing in the judge."""


class _DieAfterCommit:
    """A ledger connection that raises :class:`_Killed` right after its ``n``-th COMMIT returned."""

    def __init__(self, db, n: int) -> None:
        self.db, self.n, self.commits = db, n, 0

    def execute(self, sql, *args):
        out = self.db.execute(sql, *args)
        if sql == "COMMIT":
            self.commits += 1
            if self.commits == self.n:
                raise _Killed(self.n)
        return out

    def __getattr__(self, name):
        return getattr(self.db, name)


def test_killed_after_any_ledger_commit_the_rerun_sends_no_body_twice(scripted_server, tmp_path, monkeypatch):
    """Every state a kill can leave: the run stops right after each of the ledger's commits in turn (claim, begin,
    attempt recorded, malformed answer recorded, repair recorded, answer + end) of two groups, the first answered
    malformed then repaired. A new process (another owner token) reruns both groups. The server never receives one
    body twice; a group is lost (NaN) only when the stop left an attempt in flight; a rerun after a malformed answer
    sends the repair, not the first message again. Found in CI: a kill between the answered attempt and the
    request's end left the request pending, and the rerun sent it again."""
    from flowforge.rewards.judge import ledger as ledger_module

    url, script, log = scripted_server
    groups = [S.group(70), S.group(71)]
    expected = [_brightness(media) for media, _, _ in groups]
    commits, stop = None, 1
    while commits is None or stop <= commits:
        script.write_text(json.dumps(["malformed", "ok", "ok"]))
        before = len(_lines(log))
        root = tmp_path / f"stop_{stop}"
        judge = _scripted_judge(url, root)
        judge.ledger._db = _DieAfterCommit(judge.ledger._db, stop)
        try:
            judge.score_groups(groups[:1])
            judge.score_groups(groups[1:])
        except _Killed:
            pass
        else:  # ran to the end: every commit of the two groups' lives has been a stopping point
            commits = judge.ledger._db.commits
        judge.close()
        monkeypatch.setattr(ledger_module, "OWNER", f"rerun-{stop}")
        rerun = _scripted_judge(url, root)
        scores = [rerun(*group) for group in groups]
        keys = _lines(log)[before:]
        assert len(keys) == len(set(keys)), f"stopped after commit {stop}: a body was sent twice"
        lost = {f["key"] for f in rerun.ledger.failures() if f["status"] == "lost"}
        for got, want in zip(scores, expected, strict=True):
            assert torch.isnan(got).all() if lost and torch.isnan(got).any() else torch.allclose(got, want, atol=0.02)
        assert len(lost) <= 1 and len(keys) <= rerun.ledger.billed() <= len(keys) + len(lost)
        repairs = [a["kind"] for a in rerun.ledger.attempts()]
        assert repairs.count("first") == 2 and repairs.count("repair") <= 1
        rerun.close()
        stop += 1
    assert commits == 10  # claim, begin, attempt, malformed, repair, end; claim, begin, attempt, end
