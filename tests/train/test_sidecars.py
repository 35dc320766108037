"""Trajectory sidecars: round trip, retention, crash safety (a real SIGKILL mid-write)."""

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flowforge.rollout import Trajectory
from flowforge.train.sidecars import ROOT_MARKER, SidecarWriter, complete_steps, group_files, read_group

B, S, T = 6, 2, 4
LATENT = (1, 8, 8)


def make_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    traj = Trajectory(sigmas=torch.linspace(1, 0, T + 1), trained_steps=(0, 2),
                      final=torch.randn(B, *LATENT, generator=g), latents=torch.randn(B, S, *LATENT, generator=g),
                      next_latents=torch.randn(B, S, *LATENT, generator=g), log_probs=torch.randn(B, S, generator=g))
    group_ids = torch.tensor([5, 2, 5, 2, 5, 2])  # training order interleaves the groups
    prompts = ["a seven" if int(x) == 5 else "the number 2" for x in group_ids]
    images = torch.rand(B, 3, 8, 8, generator=g)
    return traj, group_ids, prompts, images


def test_round_trip(tmp_path):
    traj, gids, prompts, images = make_batch()
    cids = torch.arange(100, 100 + B)
    step_dir = SidecarWriter(tmp_path, keep=2).write(7, traj, gids, prompts, images, candidate_ids=cids,
                                                     extras={"rewards": torch.arange(B).float()})
    assert step_dir == tmp_path / "step_000007" and complete_steps(tmp_path) == [step_dir]
    files = group_files(step_dir)
    assert [f.name for f in files] == ["group_2.safetensors", "group_5.safetensors"]
    done = json.loads((step_dir / "DONE").read_text())
    assert done["groups"] == [2, 5] and "group_5_2.png" in done["files"]
    for f in files:
        got = read_group(f)
        rows = torch.nonzero(gids == got["group_id"]).squeeze(1)
        assert got["step"] == 7 and got["prompt"] == prompts[int(rows[0])]
        assert torch.equal(got["rows"], rows) and torch.equal(got["candidate_ids"], cids[rows])
        assert torch.equal(got["group_ids"], gids[rows])
        for name in ("final", "latents", "next_latents", "log_probs"):
            assert torch.equal(got[name], getattr(traj, name)[rows]), name
        assert torch.equal(got["sigmas"], traj.sigmas) and got["trained_steps"].tolist() == [0, 2]
        assert torch.equal(got["extra.rewards"], rows.float())
        assert "means" not in got
        assert len(got["images"]) == 3
        for k, png in enumerate(got["images"]):
            pixels = torch.tensor(np.asarray(Image.open(png))).permute(2, 0, 1).float() / 255
            assert (pixels - images[rows[k]]).abs().max() <= 0.5 / 255 + 1e-6


def test_missing_trajectory_fields_are_skipped_and_bad_input_refused(tmp_path):
    traj, gids, prompts, images = make_batch()
    lean = Trajectory(sigmas=traj.sigmas, trained_steps=(), final=traj.final, latents=None, next_latents=None,
                      log_probs=None)
    w = SidecarWriter(tmp_path, keep=1)
    got = read_group(group_files(w.write(0, lean, gids, prompts, images))[0])
    assert "latents" not in got and got["final"].shape == (3, *LATENT)
    with pytest.raises(ValueError, match="different prompts"):
        w.write(1, traj, gids, ["x"] * (B - 1) + ["y"], images)
    with pytest.raises(ValueError, match="B=6"):
        w.write(1, traj, gids[:4], prompts, images)
    with pytest.raises(ValueError, match="keep"):
        SidecarWriter(tmp_path, keep=0)


@pytest.mark.parametrize("keep", [1, 3])
def test_retention_keeps_exactly_keep(tmp_path, keep):
    batch = make_batch()
    w = SidecarWriter(tmp_path, keep=keep)
    for step in range(6):
        w.reap()  # what the trainer calls at the start of each rollout
        w.write(step, *batch)
        assert [p.name for p in complete_steps(tmp_path)] == [f"step_{s:06d}" for s in
                                                              range(max(0, step + 1 - keep), step + 1)]
    assert len([p for p in tmp_path.iterdir() if p.name != ROOT_MARKER]) == keep  # + the ownership marker
    assert (tmp_path / ROOT_MARKER).is_file()


def test_resumed_run_replaces_abandoned_future(tmp_path):
    batch = make_batch()
    w = SidecarWriter(tmp_path, keep=3)
    for step in range(5):
        w.write(step, *batch)
    assert [p.name for p in complete_steps(tmp_path)] == ["step_000002", "step_000003", "step_000004"]
    w.write(3, *batch)  # resumed from the step-3 checkpoint: the old run's steps 3 and 4 are an abandoned future
    assert [p.name for p in complete_steps(tmp_path)] == ["step_000002", "step_000003"]
    assert read_group(group_files(tmp_path / "step_000003")[0])["step"] == 3


_KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import torch
    sys.path.insert(0, {test_dir!r})
    from test_sidecars import make_batch
    from flowforge.train import sidecars

    target = sys.argv[2]

    def hook(stage, relpath):
        if stage == "tmp" and relpath.endswith(target):
            os.kill(os.getpid(), signal.SIGKILL)

    torch.set_num_threads(1)
    w = sidecars.SidecarWriter(sys.argv[1], keep=2)
    w.write(0, *make_batch())
    sidecars._test_hook = hook
    w.write(1, *make_batch(1))
""")


@pytest.mark.parametrize("target", ["group_5.safetensors", "group_5_1.png", "DONE"])  # group 2 is already final
def test_sigkill_mid_write_leaves_no_partial_final_file(tmp_path, target):
    root = tmp_path / "side"
    script = tmp_path / "kill.py"
    script.write_text(_KILL_SCRIPT.format(test_dir=str(Path(__file__).parent)))
    proc = subprocess.run([sys.executable, str(script), str(root), target], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    step_dir = root / "step_000001"
    tmps = [p for p in step_dir.iterdir() if p.name.startswith(f".{target}.tmp-")]
    assert len(tmps) == 1, sorted(p.name for p in step_dir.iterdir())  # the file was complete under its tmp name
    assert not (step_dir / target).exists()  # ... and never renamed
    assert not (step_dir / "DONE").exists()
    # readers: the step is incomplete, and no listed group file is a tmp file; every listed one reads back whole
    assert [p.name for p in complete_steps(root)] == ["step_000000"]
    for f in group_files(step_dir):
        assert not f.name.startswith(".")
        read_group(f)
    with pytest.raises(ValueError, match="tmp"):
        read_group(tmps[0])
    # the next rollout reaps the debris and keeps the complete step
    w = SidecarWriter(root, keep=2)
    removed = w.reap()
    assert step_dir in removed and not step_dir.exists()
    w.write(2, *make_batch())
    assert [p.name for p in complete_steps(root)] == ["step_000000", "step_000002"]
    assert not any(".tmp-" in p.name for p in root.rglob("*"))
