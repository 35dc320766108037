"""A command that fails leaves the run directory as it was (issue 24): ``train.resume=auto`` on a run whose
checkpoints are gone (deleted or all damaged) is refused instead of appending a second history; a resume that fails
after it was accepted (at its first score) puts back every file it rewrote and releases the lock; a checkpoint
rotation killed mid-removal is finished by the next resume. Through the command line (``flowforge train``) on the
tiny model, and a real SIGKILL for the rotation."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from flowforge.runtime.errors import UserError
from flowforge.runtime.lock import OWNER_FILE
from flowforge.train import checkpoint as ckpt
from tests.cli.harness import EXAMPLE, assert_one_line_error, run_cli
from tests.tools.test_export import tree_digest


def _train_args(model, out, cache, *more):
    return ["train", EXAMPLE, f"model.path={model}", f"run.output_dir={out}", "run.name=t", f"data.cache_dir={cache}",
            "data.prompts_per_step=2", "data.group_size=4", "sampler.num_steps=4", "sampler.num_sde_steps=2",
            "train.micro_batch_size=2", "train.num_updates_per_batch=2", "train.lr=1e-3", "eval.max_prompts=3",
            "eval.every=0", "eval.scorers=[digit_eval]", "checkpoint.every=1", "--no-progress", *more]


@pytest.fixture(scope="module")
def trained(tiny_model_dir, encode_cache_dir, tmp_path_factory):
    """A finished 2-step run (a checkpoint every step, the newest 3 kept): ``(run_dir, args)`` where ``args(out,
    *more)`` gives the same train command into ``out``."""
    out = tmp_path_factory.mktemp("trained")
    cwd = tmp_path_factory.mktemp("cwd")

    def args(where, *more):
        return _train_args(tiny_model_dir, where, encode_cache_dir, *more)

    rc, _, err = run_cli(args(out, "train.steps=2"), cwd, in_process=True)
    assert rc == 0, err
    return out / "t", args, cwd


def _copy(trained, tmp_path):
    run, args, cwd = trained
    out = tmp_path / "out"
    shutil.copytree(run, out / "t")
    return out / "t", lambda *more: args(out, *more), cwd


def _steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("how", ["deleted", "all-damaged"])
def test_resume_auto_without_its_checkpoints_is_refused(trained, tmp_path, how):
    """Was: training restarted at step 0 and metrics.jsonl held steps 1, 2, 1, 2, 3."""
    run, args, cwd = _copy(trained, tmp_path)
    if how == "deleted":
        shutil.rmtree(run / "checkpoints")
    else:  # every committed checkpoint fails its checksum: resume=auto falls back past all of them
        for step_dir in ckpt.committed_checkpoints(run):
            weights = step_dir / "weights" / "live.safetensors"
            data = bytearray(weights.read_bytes())
            data[-4:] = bytes(b ^ 0xFF for b in data[-4:])
            weights.write_bytes(bytes(data))
    before = tree_digest(run)
    rc, _, err = run_cli(args("train.resume=auto", "train.steps=3"), cwd, in_process=True)
    if how == "deleted":
        assert_one_line_error(rc, err, ["train.resume=auto", "logged 2 steps", "no committed checkpoint",
                                        "--overwrite"])
    else:  # the damaged checkpoints are named in warnings before the refusal
        assert rc == 2 and "Traceback" not in err and err.strip().splitlines()[-1].startswith(
            "error: train.resume=auto"), err
    assert tree_digest(run) == before and _steps(run) == [1, 2]


def test_a_history_an_interrupted_first_checkpoint_explains_still_restarts(tmp_path):
    """A kill between logging step ``every`` and committing its checkpoint leaves that step logged and no checkpoint:
    a restart from 0 replays it, so that is not refused; more steps than that, or any with every=0, are."""
    from flowforge.train.run_lifecycle import refuse_lost_history

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"ste')  # a torn last line
    refuse_lost_history(tmp_path, 2)
    with pytest.raises(UserError, match="logged 2 steps.*checkpoint.every=1"):
        refuse_lost_history(tmp_path, 1)
    with pytest.raises(UserError, match="first save was at step 1 .checkpoint.every=5"):  # train.steps=1 saves at 1
        refuse_lost_history(tmp_path, 5, steps=1)
    with pytest.raises(UserError, match="checkpoint.every=0 saves only at the end"):
        refuse_lost_history(tmp_path, 0)
    (tmp_path / "config.yaml").write_text("checkpoint: {every: 0}\n")  # the run's own cadence wins
    with pytest.raises(UserError, match="checkpoint.every=0"):
        refuse_lost_history(tmp_path, 5)
    refuse_lost_history(tmp_path / "no_such_run", 0)


def test_a_resume_that_fails_at_its_first_score_leaves_every_file_as_it_was(trained, tmp_path):
    """Was: config.yaml and provenance.json rewritten, a new TensorBoard file, train.log appended, and
    .flowforge.lock.owner left behind. The reward server refuses connections (a free loopback port nobody listens
    on): the first score fails after the command was accepted."""
    run, args, cwd = _copy(trained, tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = tree_digest(run)
    remote = f"{{remote: {{url: 'http://127.0.0.1:{port}', components: [x], retries: 0, timeout: 5, token_env: null}}}}"
    rc, _, err = run_cli(args("train.resume=auto", "train.steps=3", "reward.weights={remote: 1.0}",
                              f"reward.options={remote}"), cwd, in_process=True)
    assert rc == 2 and "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: "), err
    assert "resumed from" in err  # it failed after acceptance, not before
    assert not (run / OWNER_FILE).exists()
    assert tree_digest(run) == before
    rc, _, err = run_cli(args("train.resume=auto", "train.steps=3"), cwd, in_process=True)  # the lock is free
    assert rc == 0, err
    assert _steps(run) == [1, 2, 3]


@pytest.mark.slow  # 15-30 s of training on 2 cores: CI runs it in the slow set (the default run stays near 10 min)
def test_a_rotation_killed_after_demoting_a_checkpoint_is_finished_by_the_resume(tiny_model_dir, encode_cache_dir,
                                                                                 tmp_path):
    """checkpoint.keep=1: saving step 2 removes step 1; SIGKILL right after step 1 was demoted (its COMMITTED gone,
    its files still there). Was: the resume (nothing left to train) left checkpoints/step_000001 behind forever."""
    args = _train_args(tiny_model_dir, tmp_path, encode_cache_dir, "train.steps=2", "checkpoint.keep=1")
    script = textwrap.dedent(f"""
        import os, signal, sys
        from flowforge.train import checkpoint
        from flowforge.cli import main

        def die(stage, relpath):
            if stage == "demoted" and relpath == "step_000001":
                os.kill(os.getpid(), signal.SIGKILL)
        checkpoint.save._test_hook = die
        sys.exit(main({args!r}))
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    run = tmp_path / "t"
    left = run / "checkpoints" / "step_000001"
    assert left.is_dir() and not ckpt.is_committed(left)
    assert [p.name for p in ckpt.committed_checkpoints(run)] == ["step_000002"]
    rc, _, err = run_cli(_train_args(tiny_model_dir, tmp_path, encode_cache_dir, "train.steps=2", "checkpoint.keep=1",
                                     "train.resume=auto"), tmp_path, in_process=True)
    assert rc == 0, err
    assert not left.exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000002"]
