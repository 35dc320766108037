"""Run-directory safety: ownership before deletion, one run per directory (refusal, --overwrite, lock), nothing written
by a refused command, no writes through symlinks leading out, checkpoint checksums, the final checkpoint."""

import os
import socket
import time

import pytest
import torch

from flowforge.runtime.errors import UserError
from flowforge.runtime.lock import OWNER_FILE
from flowforge.train import checkpoint as ckpt
from flowforge.runtime.run_dir import check_artifacts_root
from flowforge.train.sidecars import SidecarWriter, complete_steps
from flowforge.train.trainer import Trainer
from tests.runtime.lock_holder import lock_holder
from tests.train.test_sidecars import make_batch
from tests.train.test_trainer import tiny_cfg
from tests.tools.test_export import tree_digest


tree_hash = tree_digest  # one tree digest for every byte-identical check


def _save(run_dir, step, keep=5):
    tensors = {"live": {"w": torch.full((4, 4), float(step))}}
    return ckpt.save_checkpoint(run_dir, step, tensors=tensors, optimizer_state=None, trainer_state={"step": step},
                                keep=keep)


@pytest.fixture(scope="module")
def trained(tiny_model_dir, encode_cache_dir, tmp_path_factory):
    """One finished run (1 step, checkpoint.every=0) and a factory of configs for the same output directory."""
    out = tmp_path_factory.mktemp("runs")

    def cfg(*extra, name="r"):
        return tiny_cfg(tiny_model_dir, out, encode_cache_dir, f"run.name={name}", "train.steps=1",
                        "checkpoint.every=0", "lora.rank=4", "lora.alpha=8", *extra)

    Trainer(cfg(), progress=False).train()
    return out / "r", cfg


# ------------------------------------------------------------------------------------------------ ownership
def test_foreign_files_in_artifacts_root_survive(tmp_path):
    foreign_root = tmp_path / "mine"
    (foreign_root / "step_000001").mkdir(parents=True)
    (foreign_root / "step_000001" / "notes.txt").write_text("a week of notes")
    (foreign_root / ".x.tmp-1").write_text("not flowforge's")
    before = tree_hash(foreign_root)
    with pytest.raises(UserError, match="not empty and was not created by flowforge"):
        SidecarWriter(foreign_root, keep=1)
    assert tree_hash(foreign_root) == before
    # a root flowforge owns: a user's files dropped into it are never reaped either
    root = tmp_path / "side"
    w = SidecarWriter(root, keep=1)
    w.write(0, *make_batch())
    (root / "step_000001").mkdir()
    (root / "step_000001" / "notes.txt").write_text("mine")
    (root / ".x.tmp-1").write_text("mine")
    w = SidecarWriter(root, keep=1)
    for step in (2, 3):
        w.write(step, *make_batch())
    w.reap()
    assert (root / "step_000001" / "notes.txt").read_text() == "mine" and (root / ".x.tmp-1").read_text() == "mine"
    assert [p.name for p in complete_steps(root)] == ["step_000003"]


def test_rotation_never_deletes_foreign_directories_and_artifacts_root_in_checkpoints_is_refused(tmp_path):
    _save(tmp_path, 1, keep=1)
    foreign = tmp_path / "checkpoints" / "step_000002"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    (tmp_path / "checkpoints" / "step_000001" / "notes.txt").write_text("mine too")
    for step in (3, 4):
        _save(tmp_path, step, keep=1)
    assert (foreign / "notes.txt").read_text() == "mine"
    assert (tmp_path / "checkpoints" / "step_000001" / "notes.txt").read_text() == "mine too"
    assert [p.name for p in ckpt.committed_checkpoints(tmp_path)] == ["step_000001", "step_000004"]
    (tmp_path / "config.yaml").write_text("run: {}\n")
    for root in (tmp_path / "checkpoints", tmp_path / "checkpoints" / "x"):
        with pytest.raises(UserError, match="artifacts.root"):
            check_artifacts_root(root, tmp_path / "other")


# ------------------------------------------------------------------------------------------------ checksums
def test_flipped_bytes_auto_falls_back_explicit_is_refused(tmp_path):
    _save(tmp_path, 1)
    step2 = _save(tmp_path, 2)
    weights = step2 / "weights" / "live.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size: only the checksum can tell
    weights.write_bytes(bytes(data))
    path, notes = ckpt.resolve_resume(tmp_path, "auto")
    assert path.name == "step_000001"
    assert any("weights/live.safetensors" in n and "sha256" in n and "step_000001" in n for n in notes)
    with pytest.raises(UserError, match=r"weights/live.safetensors: sha256 differs"):
        ckpt.resolve_resume(tmp_path, str(step2))
    with pytest.raises(UserError, match="sha256"):
        ckpt.load_checkpoint(step2)


# ------------------------------------------------------------------------------------------------ one run per dir
def test_final_checkpoint_with_checkpoint_every_0(trained):
    run_dir, _ = trained
    assert [p.name for p in ckpt.committed_checkpoints(run_dir)] == ["step_000001"]
    assert not (run_dir / OWNER_FILE).exists()  # the lock was released at the end of train()


def test_rerun_without_resume_is_refused_and_leaves_the_dir_unchanged(trained):
    run_dir, cfg = trained
    before = tree_hash(run_dir)
    with pytest.raises(UserError, match=r"already holds a run .*train.resume=auto.*--overwrite"):
        Trainer(cfg(), progress=False)
    assert tree_hash(run_dir) == before


def test_failed_command_leaves_the_run_dir_byte_identical(trained):
    run_dir, cfg = trained
    before = tree_hash(run_dir)
    with pytest.raises(ValueError, match="resume refused"):  # contract mismatch, found after the model loaded
        Trainer(cfg("lora.alpha=16", "train.resume=auto"), progress=False)
    assert tree_hash(run_dir) == before
    new_dir = run_dir.parent / "never"
    with pytest.raises(ValueError):
        Trainer(cfg("train.resume=" + str(run_dir / "checkpoints" / "step_000009"), name="never"), progress=False)
    assert not new_dir.exists()


def test_symlinks_leading_out_of_the_run_dir_are_refused(trained, tmp_path):
    run_dir, cfg = trained
    outside = tmp_path / "elsewhere.txt"
    outside.write_text("precious")
    for name, run in (("config.yaml", "r"), ("metrics.jsonl", "fresh")):
        target = run_dir.parent / run / name
        target.parent.mkdir(exist_ok=True)
        saved = target.with_name(name + ".saved")
        if target.exists():
            os.replace(target, saved)
        target.symlink_to(outside)
        try:
            with pytest.raises(UserError, match=f"{name}: is a symlink to .* outside the run directory"):
                Trainer(cfg("train.resume=auto", name=run), progress=False)
        finally:
            target.unlink()
            if saved.exists():
                os.replace(saved, target)
    assert outside.read_text() == "precious"
    outside_dir = tmp_path / "elsewhere"  # samples/: a directory whose files have fixed names
    outside_dir.mkdir()
    (outside_dir / "step_000000.png").write_text("precious")
    link = run_dir.parent / "fresh" / "samples"
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(outside_dir, target_is_directory=True)
    try:
        with pytest.raises(UserError, match="samples: is a symlink to .* outside the run directory"):
            Trainer(cfg("train.resume=auto", name="fresh"), progress=False)
    finally:
        link.unlink()
    assert [p.name for p in outside_dir.iterdir()] == ["step_000000.png"]
    assert (outside_dir / "step_000000.png").read_text() == "precious"


def test_concurrent_second_trainer_is_refused_naming_pid_and_host(trained):
    run_dir, cfg = trained
    with lock_holder(run_dir) as holder:
        with pytest.raises(UserError, match=rf"is locked by PID {holder.pid} on host {socket.gethostname()} "
                                            r"\(running since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\)"):
            Trainer(cfg("train.resume=auto"), progress=False)
    time.sleep(0.1)


def test_overwrite_moves_the_old_run_aside(trained, caplog):
    run_dir, cfg = trained
    before = tree_hash(run_dir)
    with caplog.at_level("WARNING", logger="flowforge"):
        Trainer(cfg("train.steps=1"), progress=False, overwrite=True).train()
    aside = run_dir.with_name("r.old-1")
    assert any("moving the old run" in r.getMessage() and "r.old-1" in r.getMessage() for r in caplog.records)
    assert tree_hash(aside) == before
    assert [p.name for p in ckpt.committed_checkpoints(run_dir)] == ["step_000001"]


def test_resume_with_fewer_steps_than_the_checkpoint_is_refused_before_anything_is_written(trained):
    """Issue 24: ``train.resume=auto train.steps=4`` on a run whose newest checkpoint is step 6 is refused (it exited
    0, trained nothing and rewrote config.yaml to ``steps: 4``); the run directory stays byte-identical."""
    import shutil

    run_dir, cfg = trained
    six = run_dir.parent / "r6"
    shutil.copytree(run_dir, six)
    (six / "checkpoints" / "step_000001").rename(six / "checkpoints" / "step_000006")
    before = tree_hash(six)
    with pytest.raises(UserError, match=r"train.steps=4: is below the step 6 of the checkpoint step_000006"):
        Trainer(cfg("train.resume=auto", "train.steps=4", name="r6"), progress=False)
    assert tree_hash(six) == before


def test_resume_from_another_run_s_checkpoint_into_an_existing_run_is_refused(trained, caplog):
    """Issue 42: ``train.resume=<run r's checkpoint> run.name=vx``, with ``vx`` an existing, different run, replaced
    vx's checkpoints and config.yaml (exit 0, one warning). Refused before anything is written, naming the run the
    checkpoint belongs to, the run it would overwrite and how to start a new run; a fresh run.name starts one, and
    --overwrite moves vx aside first (nothing deleted)."""
    import shutil

    run_dir, cfg = trained
    runs = run_dir.parent
    vx = runs / "vx"
    shutil.copytree(run_dir, vx)  # a run of its own: its checkpoint, config.yaml, metrics
    resume = f"train.resume={run_dir / 'checkpoints' / 'step_000001'}"
    before, vx_before = tree_hash(runs), tree_hash(vx)
    with pytest.raises(UserError) as info:
        Trainer(cfg(resume, "train.steps=2", name="vx"), progress=False)
    message = str(info.value)
    assert "\n" not in message
    for said in (f"belongs to the run {run_dir}", f"names the existing run {vx}", "choose a fresh run.name",
                 "train.resume=auto", "--overwrite"):
        assert said in message, (said, message)
    assert tree_hash(runs) == before
    Trainer(cfg(resume, "train.steps=2", name="vx-from-r"), progress=False).train()  # a new run from it
    assert [p.name for p in ckpt.committed_checkpoints(runs / "vx-from-r")] == ["step_000002"]
    with caplog.at_level("WARNING", logger="flowforge"):
        Trainer(cfg(resume, "train.steps=2", name="vx"), progress=False, overwrite=True).train()
    assert tree_hash(runs / "vx.old-1") == vx_before
    assert [p.name for p in ckpt.committed_checkpoints(vx)] == ["step_000002"]
