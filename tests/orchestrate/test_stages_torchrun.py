"""``flowforge stages`` under ``torchrun --nproc_per_node 2`` (gloo, CPU) on the tiny pipeline: stages A and C train on
both ranks while rank 0 alone talks to the judges (every group whole, judged once) and writes the ledgers; kill -9 of
one rank while a teacher request is in flight, then a rerun of the same command: the teacher's own request log shows
no group billed twice and no condition handed out twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowforge.orchestrate.config import load_pipeline
from flowforge.orchestrate.stages import newest_step, open_ledger
from flowforge.rewards.judge.protocol import billed_per_group, read_request_log
from tests.orchestrate.support import write_pipeline
from tests.orchestrate.test_stages import _in_flight, _servers_of

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # two ranks + judge servers, tens of seconds per run

ROOT = Path(__file__).resolve().parents[2]
K = 4  # data.group_size of the tiny pipeline


def _command(path: Path) -> list[str]:
    # torchrun's module through this interpreter: works without an activated venv (no `torchrun` on PATH)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
            "flowforge.cli", "stages", str(path), "--no-progress"]


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


@pytest.fixture
def pipeline(tiny_model_dir, tmp_path, encode_cache_dir):
    # 2 prompts x 4 candidates a step: rank 0 holds group 0, rank 1 group 1 (each rank would judge its own group
    # without single_client); C served by a student server, audited on its first 2 groups
    path = write_pipeline(tmp_path / "pipeline.yaml", tiny_model_dir, tmp_path / "runs", encode_cache_dir,
                          stages={"n_a": 6, "c_steps": 2}, student={"split_seed": 11},
                          audit={"first_groups": 2, "every": 0})
    return path, load_pipeline(path), tmp_path / "runs" / "p"


def _takes(directory: Path) -> list[dict]:
    lines = (directory / "conditions.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines[1:]) if r["kind"] == "take"]


def _check_one_writer_and_no_double_bill(directory: Path, pcfg) -> dict:
    """What every finished two-rank pipeline must show; returns the teacher's per-group counts."""
    log = read_request_log(directory / "teacher" / "requests.log")
    keys = [r["key"] for r in log]
    assert keys and len(keys) == len(set(keys))  # no request sent twice
    per_group = billed_per_group(log)
    assert set(per_group.values()) == {1}, per_group  # the server's own count: every group billed once
    assert all(len(r["candidates"]) == K for r in log)  # every group whole: rank 1's members reached rank 0
    student = read_request_log(directory / "student" / "requests.log")
    # C's 2 steps x 2 training groups whole (K candidates), and the eval at C's end on the student (free): 2 prompts
    # x eval.samples_per_prompt=2
    assert sorted(len(r["candidates"]) for r in student) == [2, 2, K, K, K, K]
    assert len({r["key"] for r in student}) == len(student)
    takes = _takes(directory)  # one writer: one take per step (a second writer would repeat them)
    assert [(t["stage"], t["step"]) for t in takes] == [("A", 0), ("A", 1), ("A", 2), ("C", 3), ("C", 4)]
    handed = [i for t in takes for i in t["ids"]]
    assert len(handed) == len(set(handed)) == 10  # no condition used twice
    ledger = open_ledger(pcfg)
    assert ledger.used == {"A": 6, "C": 4}
    assert newest_step(directory / "A") == 3 and newest_step(directory / "C") == 5
    summary = json.loads((directory / "summary.json").read_text())
    assert summary["status"] == "done" and summary["teacher"]["server_log"]["duplicates"] == 0
    # rank 0's request ledgers bill what the server received, plus at most attempts a kill left unanswered
    lost = summary["teacher"]["failed_groups"]
    assert len(keys) <= summary["teacher"]["http_requests"] <= len(keys) + lost
    assert [a["step"] for a in summary["C"]["audits"]] == [3]
    return per_group


def test_stages_a_and_c_under_torchrun_judge_every_group_once_on_rank_0(pipeline):
    path, pcfg, directory = pipeline
    done = subprocess.run(_command(path), env=_env(), capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("pipeline directory:") == 1  # one summary, from rank 0
    per_group = _check_one_writer_and_no_double_bill(directory, pcfg)
    assert len(per_group) == 6 + 2  # A's 3 steps x 2 groups + the audit's 2 groups; evaluation asks no teacher
    ledger = open_ledger(pcfg)
    # both ranks' groups were marked: every condition of A judged, every condition of both stages trained on
    assert len(ledger.with_state("judged", "A")) == 6
    assert len(ledger.with_state("trained_on", "A")) == 6 and len(ledger.with_state("trained_on", "C")) == 4
    rows = [json.loads(line) for line in (directory / "A" / "metrics.jsonl").read_text().splitlines()]
    # rank 0 sent both groups of each step; the counter is rank 0's, not its mean with rank 1's zero
    assert [r["reward/vlm_judge_requests_sent"] for r in rows] == [2.0, 2.0, 2.0]
    assert all(r["reward/vlm_judge_groups_scored"] == 2.0 for r in rows)


def _ranks(agent: int) -> dict[int, int]:
    """rank -> pid of the worker processes a torchrun agent started (its children with RANK in the environment)."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != agent:
                continue
            env = dict(item.split("=", 1) for item in (entry / "environ").read_bytes().decode().split("\0")
                       if "=" in item)
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = int(entry.name)
    return found


def _kill_rank_in_the_window(agent: subprocess.Popen, directory: Path, rank: int) -> bool:
    """SIGKILL worker ``rank`` while a teacher request of stage A is in flight (recorded as sent by rank 0, its
    answer not recorded), looking with rank 0 frozen (SIGSTOP); else kill it anyway. Returns whether it was caught
    in the window."""
    db = directory / "A" / "judge" / "ledger.sqlite"
    ranks = _ranks(agent.pid)
    assert sorted(ranks) == [0, 1], ranks
    for _ in range(600):
        os.kill(ranks[0], signal.SIGSTOP)
        caught = _in_flight(db)
        if caught:
            os.kill(ranks[rank], signal.SIGKILL)
        os.kill(ranks[0], signal.SIGCONT)
        if caught:
            return True
        time.sleep(0.01)
    os.kill(ranks[rank], signal.SIGKILL)
    return False


@pytest.mark.parametrize("killed", [1, 0])
def test_kill_9_of_one_rank_and_a_rerun_never_bill_a_group_twice(pipeline, killed):
    """Rank ``killed`` is killed while rank 0 has a teacher request in flight; torchrun ends the other rank (and
    with rank 0 the judge servers die); the rerun of the same command finishes A and C without a request twice."""
    path, pcfg, directory = pipeline
    metrics = directory / "A" / "metrics.jsonl"
    with open(directory.parents[1] / "first.log", "w") as out:
        agent = subprocess.Popen(_command(path), env=_env(), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + 600
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):  # one step done: a kill loses work
            assert agent.poll() is None and time.monotonic() < deadline, "stage A did not finish a step"
            time.sleep(0.1)
        caught = _kill_rank_in_the_window(agent, directory, killed)
        assert agent.wait(timeout=120) != 0
    sent_before = [r["key"] for r in read_request_log(directory / "teacher" / "requests.log")]
    assert sent_before
    deadline = time.monotonic() + 30
    while _servers_of(directory / "judge.token") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _servers_of(directory / "judge.token") == []  # the judge servers ended with rank 0
    done = subprocess.run(_command(path), env=_env(), capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    keys = [r["key"] for r in read_request_log(directory / "teacher" / "requests.log")]
    assert keys[:len(sent_before)] == sent_before
    _check_one_writer_and_no_double_bill(directory, pcfg)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert any(r.get("reward/vlm_judge_served_from_ledger", 0) > 0 for r in rows)  # the replayed step's answers
    summary = json.loads((directory / "summary.json").read_text())
    lost = summary["teacher"]["failed_groups"]  # an answer the kill swallowed: dropped, never asked again
    assert summary["teacher"]["train_groups"] + lost == 6 and (lost >= 0 if killed == 1 or not caught else lost >= 1)
