"""SIGTERM / SIGINT during ``flowforge train`` (issue 43, item 4): the step finishes, its checkpoint is committed, one
line names it and the command that continues, exit 143 / 130; the resume logs every step once and ends with the
weights of an uninterrupted run, bit for bit. Also: a second signal stops at once; a resume cuts ``metrics.jsonl`` /
``eval.jsonl`` back (torn last line included) and TensorBoard purges the replayed steps; ``train.resume=must``; a
mistyped ``run.name`` under ``auto``; a run killed before its first checkpoint restarts without a second step-0 eval
row; a run that fails at its first step (remote reward server down) leaves no run behind (item 6)."""

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load_file

from flowforge.runtime.run_dir import committed_checkpoints
from tests.cli.harness import EXAMPLE, assert_one_line_error, run_cli

RESUME_LINE = "train.resume=auto"


def _args(model, out, cache, *more, name="t"):
    return ["train", EXAMPLE, f"model.path={model}", f"run.output_dir={out}", f"run.name={name}",
            f"data.cache_dir={cache}", "data.prompts_per_step=2", "data.group_size=4", "sampler.num_steps=4",
            "sampler.num_sde_steps=2", "train.micro_batch_size=2", "train.num_updates_per_batch=2", "train.lr=1e-3",
            "eval.max_prompts=3", "eval.every=0", "eval.scorers=[digit_eval]", "run.num_threads=1", "train.steps=3",
            "--no-progress", *more]


def _steps(run_dir, name="metrics.jsonl"):
    return [json.loads(line)["step"] for line in (run_dir / name).read_text().splitlines()]


def _weights(run_dir, step):
    folder = run_dir / "checkpoints" / f"step_{step:06d}" / "weights"
    return {p.name: load_file(str(p)) for p in sorted(folder.glob("*.safetensors"))}


def _assert_same_weights(a, b):
    assert a.keys() == b.keys() and a
    for name in a:
        assert a[name].keys() == b[name].keys()
        for key in a[name]:
            assert torch.equal(a[name][key], b[name][key]), (name, key)


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, encode_cache_dir, tmp_path_factory):
    """A 3-step run without interruption (checkpoint.every=0: one checkpoint, at its end): its run directory."""
    out = tmp_path_factory.mktemp("uninterrupted")
    rc, _, err = run_cli(_args(tiny_model_dir, out, encode_cache_dir, "checkpoint.every=0"), out, in_process=True)
    assert rc == 0, err
    return out / "t"


@pytest.mark.slow  # end-to-end runs (minutes of CPU together): CI runs them in the slow set
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_commits_the_step_and_the_resume_ends_as_an_uninterrupted_run(uninterrupted, tiny_model_dir,
                                                                              encode_cache_dir, tmp_path, sig, code):
    """Was: SIGINT printed a ~25-line traceback naming no checkpoint, SIGTERM killed the run (everything since the
    last scheduled checkpoint lost: with checkpoint.every=0 everything)."""
    args = _args(tiny_model_dir, tmp_path, encode_cache_dir, "checkpoint.every=0")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-m", "flowforge.cli", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "t" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 1) and proc.poll() is None:
        assert time.monotonic() < deadline, "no step was logged"
        time.sleep(0.02)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    run = tmp_path / "t"
    done = _steps(run)
    stopped = done[-1]
    assert done == list(range(1, stopped + 1)) and stopped < 3
    ckpt = run / "checkpoints" / f"step_{stopped:06d}"
    assert committed_checkpoints(run) == [ckpt]
    assert last.startswith(f"interrupted by {sig.name}: finished step {stopped} of 3 and committed its checkpoint "
                           f"{ckpt}; continue with: flowforge train {EXAMPLE} "), last
    assert last.endswith(f"--no-progress {RESUME_LINE}"), last
    resume_args = shlex.split(last.split("continue with: flowforge ")[1])
    rc, _, err = run_cli(resume_args, tmp_path, in_process=True)  # the printed command, as printed
    assert rc == 0, err
    assert _steps(run) == [1, 2, 3] and _steps(run, "eval.jsonl") == [0, 3]
    _assert_same_weights(_weights(uninterrupted, 3), _weights(run, 3))


def test_a_second_signal_while_finishing_stops_at_once(tiny_model_dir, encode_cache_dir, tmp_path):
    """The first SIGTERM after step 1 is logged; the second arrives while the step's checkpoint is written: the
    command stops at once, saying a resume goes back to step 0 (no checkpoint was committed; every=3 restarts)."""
    args = _args(tiny_model_dir, tmp_path, encode_cache_dir, "checkpoint.every=3")
    script = textwrap.dedent(f"""
        import os, signal, sys
        from flowforge.cli import main
        from flowforge.train.checkpoint.manager import CheckpointManager
        from flowforge.train.metrics import MetricsLogger

        log = MetricsLogger.log
        def logged(self, step, scalars):
            log(self, step, scalars)
            os.kill(os.getpid(), signal.SIGTERM)
        def save(self):
            os.kill(os.getpid(), signal.SIGTERM)
        MetricsLogger.log = logged
        CheckpointManager.save = save
        sys.exit(main({args!r}))
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("interrupted by SIGTERM: stopped at once with no committed checkpoint: a resume starts "
                           "again from step 0; continue with: flowforge train "), last
    assert last.endswith(RESUME_LINE)
    assert _steps(tmp_path / "t") == [1] and not committed_checkpoints(tmp_path / "t")


def test_nested_stop_signal_blocks_restore_the_handlers_they_found():
    """The command line's block around the trainer's: leaving the outer one puts the original handlers back and
    disarms (was: the inner exit cleared what the outer had saved, so Ctrl-C stayed caught after training)."""
    from flowforge.runtime.interrupt import StopSignals

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signals = StopSignals()
    with signals:
        with signals:
            signals.armed = True
            assert signal.getsignal(signal.SIGINT) == signals._handle
        assert signal.getsignal(signal.SIGINT) == signals._handle  # still inside the outer block
    assert {s: signal.getsignal(s) for s in before} == before and not signals.armed

def test_cut_rows_keeps_complete_rows_up_to_the_step(tmp_path):
    from flowforge.train.history import cut_rows

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1}\n{"step": 2}\nnot json\n{"step": 3}\n{"step": 2, "b": 2}\n{"step": 4, "a')
    data, notes = cut_rows(path, 2)
    assert data == b'{"step": 1, "a": 1}\n{"step": 2}\n{"step": 2, "b": 2}\n'
    assert notes == ["1 rows of steps after 2 (trained again now)", "1 lines that are not a row",
                     "a torn last line (a write cut by a kill)"]
    path.write_text('{"step": 1}\n{"step": 2}\n')
    assert cut_rows(path, 2) is None and cut_rows(tmp_path / "missing.jsonl", 2) is None
    assert cut_rows(path, -1) == (b"", ["2 rows of steps after -1 (trained again now)"])


def test_a_resume_logs_each_step_once_and_tensorboard_purges_the_replayed_ones(tiny_model_dir, encode_cache_dir,
                                                                               tmp_path):
    """A run that logged steps 1-2 but whose newest checkpoint is step 1 (step 2's lost), its metrics.jsonl ending in a
    torn line. Was: metrics.jsonl steps 1, 2, 2 (and the torn line glued to a row), TensorBoard step 2 twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = _args(tiny_model_dir, tmp_path, encode_cache_dir, "checkpoint.every=1", "train.steps=2")
    rc, _, err = run_cli(args, tmp_path, in_process=True)
    assert rc == 0, err
    run = tmp_path / "t"
    shutil.rmtree(run / "checkpoints" / "step_000002")
    (run / "checkpoints" / "latest").unlink()
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward/total_')
    rc, _, err = run_cli([*args, RESUME_LINE], tmp_path, in_process=True)
    assert rc == 0, err
    assert _steps(run) == [1, 2] and _steps(run, "eval.jsonl") == [0, 2]
    said = [line.split("flowforge: ", 1)[1] for line in err.splitlines() if "resuming at step 1: " in line]
    assert said == ["resuming at step 1: metrics.jsonl: dropped 1 rows of steps after 1 (trained again now); a torn "
                    "last line (a write cut by a kill)",
                    "resuming at step 1: eval.jsonl: dropped 1 rows of steps after 1 (trained again now)"], said
    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/total_mean")] == [1, 2]
    assert [e.step for e in events.Scalars("eval/digit_eval")] == [0, 2]


def test_resume_must_refuses_when_there_is_nothing_and_names_close_runs(tiny_model_dir, encode_cache_dir, tmp_path):
    (tmp_path / "digits-grpo").mkdir()
    (tmp_path / "digits-grpo" / "config.yaml").write_text("run: {}\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    rc, _, err = run_cli(_args(tiny_model_dir, tmp_path, encode_cache_dir, "train.resume=must", name="digits-grpp"),
                         tmp_path, in_process=True)
    assert_one_line_error(rc, err, ["train.resume=must", f"{tmp_path / 'digits-grpp'} does not exist",
                                    "did you mean run.name=digits-grpo?"])
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_resume_auto_with_a_mistyped_run_name_warns_before_starting_from_scratch(tmp_path, caplog):
    from flowforge.train.run_lifecycle import nothing_to_resume

    for name in ("digits-grpo", "digits-nft", "world"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("")
    nothing_to_resume(tmp_path / "digits-grpp", "auto")
    assert [r.getMessage() for r in caplog.records] == [
        f"train.resume=auto: the run directory {tmp_path / 'digits-grpp'} does not exist; did you mean "
        "run.name=digits-grpo or run.name=digits-nft? starting from scratch"]  # closest first
    caplog.clear()
    nothing_to_resume(tmp_path / "other", "auto")  # no close name: the usual INFO line of the restore says it
    assert not caplog.records


def test_a_restart_before_the_first_checkpoint_says_so_and_logs_step_0_once(tiny_model_dir, encode_cache_dir,
                                                                            tmp_path):
    """checkpoint.every=3, stopped after step 1 without a checkpoint. Was: 'rerun it with checkpoint.every > 0 ...
    and --overwrite' while restarting anyway, and eval.jsonl got a second step-0 row (metrics 1, 1, 2, 3)."""
    from flowforge.config import load_config
    from flowforge.train.trainer import Trainer

    args = _args(tiny_model_dir, tmp_path, encode_cache_dir, "checkpoint.every=3")
    Trainer(load_config(EXAMPLE, [a for a in args[2:] if not a.startswith("--")]), progress=False).train(stop_at=1)
    run = tmp_path / "t"
    assert _steps(run) == [1] and not committed_checkpoints(run)
    rc, _, err = run_cli([*args, RESUME_LINE], tmp_path, in_process=True)
    assert rc == 0, err
    assert "checkpoint.every > 0" not in err and "--overwrite" not in err
    assert ("the run was interrupted at step 1 of 3 before any checkpoint (checkpoint.every=3): nothing to resume, "
            "starting from step 0 (its logged rows are replaced)") in err
    assert _steps(run) == [1, 2, 3] and _steps(run, "eval.jsonl") == [0, 3]


def test_a_first_run_that_fails_at_its_first_score_leaves_no_run_behind(tiny_model_dir, encode_cache_dir, tmp_path):
    """Item 6: the remote reward server is down (a free loopback port nobody listens on). Was: config.yaml,
    eval.jsonl, samples/ and tb/ stayed and the plain rerun was refused ('already holds a run')."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    remote = f"{{remote: {{url: 'http://127.0.0.1:{port}', components: [x], retries: 0, timeout: 5, token_env: null}}}}"
    args = _args(tiny_model_dir, tmp_path, encode_cache_dir, "train.steps=1")
    rc, _, err = run_cli([*args, "reward.weights={remote: 1.0}", f"reward.options={remote}"], tmp_path,
                         in_process=True)
    assert rc == 2 and "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: "), err
    assert not (tmp_path / "t").exists(), sorted(p.name for p in (tmp_path / "t").rglob("*"))
    rc, _, err = run_cli(args, tmp_path, in_process=True)  # the same run, its reward server back: not refused
    assert rc == 0, err
    assert _steps(tmp_path / "t") == [1]


@pytest.mark.slow  # two torchrun ranks (tens of seconds)
@pytest.mark.distributed
def test_under_torchrun_a_signal_to_one_rank_stops_both_after_the_same_step(tiny_model_dir, encode_cache_dir,
                                                                            tmp_path):
    """Only rank 1 gets SIGTERM, after its first step: the step-boundary all-reduce stops rank 0 too, the checkpoint
    of step 1 is written by both (a collective), both exit 143 and rank 0 prints the line. Without the agreement
    rank 0 would wait in step 2's collectives for a rank that left."""
    args = _args(tiny_model_dir, tmp_path, encode_cache_dir, "checkpoint.every=0", "eval.max_prompts=2",
                 "eval.samples_per_prompt=2")
    script = tmp_path / "rank_script.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys
        from flowforge.cli import main
        from flowforge.train.trainer import Trainer

        finish = Trainer.finish_step
        def finish_step(self, step, *rest):
            out = finish(self, step, *rest)
            if self.dist.rank == 1 and step == 0:
                os.kill(os.getpid(), signal.SIGTERM)
            return out
        Trainer.finish_step = finish_step
        sys.exit(main({args!r}))
    """))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.getcwd()}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script)], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode != 0  # torchrun reports its workers' 143 as a failure
    run = tmp_path / "t"
    lines = [line for line in proc.stderr.splitlines() if line.startswith("interrupted by SIGTERM: ")]
    assert len(lines) == 1, proc.stderr[-4000:]
    assert lines[0].startswith(f"interrupted by SIGTERM: finished step 1 of 3 and committed its checkpoint "
                               f"{run / 'checkpoints' / 'step_000001'}; continue with: "), lines
    codes = re.findall(r"rank\s+: (\d) \(local_rank: \d\)\n\s+exitcode\s+: (\d+)", proc.stderr)
    assert sorted(codes) == [("0", "143"), ("1", "143")], proc.stderr[-3000:]  # torchrun's summary of its workers
    assert _steps(run) == [1] and [p.name for p in committed_checkpoints(run)] == ["step_000001"]
