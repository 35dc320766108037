"""kill -9 of a real ``flowforge stages --stage B`` after at least one of the student's epoch checkpoints; the rerun
ends with the student, the per-epoch history and the gate's metrics of an uninterrupted stage B, bit for bit
(issue 24 item 4: the student's MiniLM cache held batch-padded embeddings, so a resumed run differed in every
tensor)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.orchestrate.support import write_pipeline

EPOCHS = 16
SECTIONS = {
    # 12 conditions in 2 steps of A: 12 judged groups; split_seed 3 puts 5 in train (batches of 3 prompts of
    # different lengths, regrouped every epoch), 2 in val (which picks a middle epoch) and 5 in test
    "stages": {"n_a": 12, "seed": 0},
    "data": {"prompts_per_step": 6},
    "student": {"epochs": EPOCHS, "batch_size": 3, "split": [0.5, 0.25, 0.25], "split_seed": 3,
                "scalar_head": {"image_size": 16, "channels": [4, 8], "hidden": 8, "text_encoder": "minilm"}},
}


def _committed_epochs(checkpoints: Path) -> list[int]:
    if not checkpoints.is_dir():
        return []
    return sorted(int(p.name.split("_")[1]) for p in checkpoints.glob("step_*") if (p / "COMMITTED").is_file())


def _kill_after_a_checkpoint(proc: subprocess.Popen, attempt: Path) -> int:
    """SIGKILL ``proc`` (frozen with SIGSTOP to look) once a student checkpoint is committed and epochs remain;
    returns the newest committed epoch at the kill."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"stage B exited ({proc.returncode}) before a checkpoint was caught"
        os.kill(proc.pid, signal.SIGSTOP)
        done = _committed_epochs(attempt / "checkpoints")
        if done and done[-1] < EPOCHS:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            return done[-1]
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.005)
    raise AssertionError("no student checkpoint within 600 s")


def _stages(config: Path, stage: str, log: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "flowforge.cli", "stages", str(config), "--stage", stage, "--no-progress"]
    with open(log, "w") as out:
        done = subprocess.run(command, env=_env(), stdout=out, stderr=subprocess.STDOUT, timeout=900)
    assert done.returncode == 0, log.read_text()[-3000:]
    return done


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.mark.slow  # stage A, then stage B three times in subprocesses (about a minute on one core)
def test_kill_9_in_stage_b_resumes_the_student_bit_for_bit(tiny_model_dir, tmp_path, encode_cache_dir):
    straight = write_pipeline(tmp_path / "straight.yaml", tiny_model_dir, tmp_path / "straight", encode_cache_dir,
                              **SECTIONS)
    killed = write_pipeline(tmp_path / "killed.yaml", tiny_model_dir, tmp_path / "killed", encode_cache_dir,
                            **SECTIONS)
    _stages(straight, "A", tmp_path / "a.log")
    # the same stage A for both: its directory copied (stage B reads A's judged groups and the condition ledger)
    shutil.copytree(tmp_path / "straight" / "p", tmp_path / "killed" / "p")
    _stages(straight, "B", tmp_path / "b_straight.log")

    attempt = tmp_path / "killed" / "p" / "B" / "attempt_0"
    command = [sys.executable, "-m", "flowforge.cli", "stages", str(killed), "--stage", "B", "--no-progress"]
    with open(tmp_path / "b_killed.log", "w") as out:
        proc = subprocess.Popen(command, env=_env(), stdout=out, stderr=subprocess.STDOUT)
        at = _kill_after_a_checkpoint(proc, attempt)
    assert proc.returncode == -signal.SIGKILL and not (attempt / "gate.json").exists()
    _stages(killed, "B", tmp_path / "b_resumed.log")
    assert f"student: resuming after epoch {at} from" in (tmp_path / "b_resumed.log").read_text()

    reference = tmp_path / "straight" / "p" / "B" / "attempt_0"
    a = load_file(str(reference / "student" / "model.safetensors"))
    b = load_file(str(attempt / "student" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []  # tensor by tensor, bit for bit
    gate_a, gate_b = (json.loads((d / "gate.json").read_text()) for d in (reference, attempt))
    assert gate_a["split_sizes"] == {"train": 5, "val": 2, "test": 5}
    for key in ("best_epoch", "val", "test", "null", "probes", "passed", "reasons"):
        assert gate_b[key] == gate_a[key], key  # exactly: the verdict and every metric it was judged on
    history_a, history_b = (json.loads((d / "metrics.json").read_text())["history"] for d in (reference, attempt))
    assert len(history_a) == EPOCHS and history_b == history_a
    last_a, last_b = (torch.load(d / "checkpoints" / f"step_{EPOCHS:06d}" / "trainable.pt", weights_only=True)
                      for d in (reference, attempt))  # the last epoch's weights too (the student is the best epoch's)
    assert sorted(last_a) == sorted(last_b) and [k for k in last_a if not torch.equal(last_a[k], last_b[k])] == []
