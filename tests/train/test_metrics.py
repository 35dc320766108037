"""flowforge.train.metrics: scalar reduction, JSONL / TensorBoard sinks, stage timer, group diversity, grids, provenance."""

from __future__ import annotations

import itertools
import json
import math
import subprocess

import numpy as np
import pytest
import torch
from PIL import Image

from flowforge.train import metrics
from flowforge.report.grids import save_grid
from flowforge.train.metrics import (MetricsLogger, StageTimer, run_provenance, to_scalars, within_group_diversity,
                                     write_provenance)
from flowforge.runtime.run_dir import sample_grid_path


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------------------------------- to_scalars


def test_to_scalars_converts_tensors_and_numbers_in_order():
    out = to_scalars({
        "train/loss": torch.tensor(0.25),
        "train/count": torch.tensor(16_777_217),  # not exact in float32: checks the float64 path
        "train/flag": torch.tensor(True),
        "reward/nan": torch.tensor(float("nan")),
        "perf/x": 3,
        "perf/y": 1.5,
        "perf/np": np.float32(2.0),
    })
    assert list(out) == ["train/loss", "train/count", "train/flag", "reward/nan", "perf/x", "perf/y", "perf/np"]
    assert out["train/loss"] == 0.25
    assert out["train/count"] == 16_777_217.0
    assert out["train/flag"] == 1.0
    assert math.isnan(out["reward/nan"])
    assert out["perf/x"] == 3.0 and out["perf/y"] == 1.5 and out["perf/np"] == 2.0
    assert all(type(v) is float for v in out.values())


def test_to_scalars_detaches_grad_tensors():
    w = torch.tensor(2.0, requires_grad=True)
    assert to_scalars({"train/loss": w * 3}) == {"train/loss": 6.0}


@pytest.mark.parametrize("bad", [torch.tensor([1.0]), torch.zeros(2, 2)])
def test_to_scalars_rejects_non_0d_tensor_naming_the_key(bad):
    with pytest.raises(ValueError, match="train/per_sample.*0-d"):
        to_scalars({"train/ok": torch.tensor(1.0), "train/per_sample": bad})


def test_to_scalars_rejects_non_numbers():
    with pytest.raises(ValueError, match="reward/name"):
        to_scalars({"reward/name": "high"})


# ---------------------------------------------------------------------------------------------------------- logger


def test_logger_appends_parseable_lines_flushed_each_call(tmp_path):
    logger = MetricsLogger(tmp_path / "run", tensorboard=False)
    logger.log(0, {"train/loss": 1.0, "reward/digit_mean": 0.5})
    # Readable before close: a killed run keeps what was logged.
    assert read_lines(tmp_path / "run" / "metrics.jsonl") == [{"step": 0, "train/loss": 1.0, "reward/digit_mean": 0.5}]
    logger.log(1, {"train/loss": float("nan"), "train/kl": float("inf")})
    logger.close()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    assert json.loads(lines[1]) == {"step": 1, "train/loss": None, "train/kl": None}  # strict JSON: null
    assert "NaN" not in lines[1] and "Infinity" not in lines[1]
    assert not (tmp_path / "run" / "eval.jsonl").exists()
    assert not (tmp_path / "run" / "tb").exists()


def test_logger_reopened_appends(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(0, {"train/loss": 1.0})
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(1, {"train/loss": 2.0})
    assert [r["step"] for r in read_lines(tmp_path / "metrics.jsonl")] == [0, 1]


def test_logger_eval_goes_to_eval_jsonl(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(3, {"train/loss": 1.0})
        logger.log_eval(3, {"eval/digit_eval": 0.75, "eval/diversity": 0.2})
    assert read_lines(tmp_path / "eval.jsonl") == [{"step": 3, "eval/digit_eval": 0.75, "eval/diversity": 0.2}]
    assert read_lines(tmp_path / "metrics.jsonl") == [{"step": 3, "train/loss": 1.0}]


def test_logger_validates_input_and_state(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    with pytest.raises(ValueError, match="must start with 'eval/'"):
        logger.log_eval(0, {"digit_eval": 0.5})
    with pytest.raises(ValueError, match="to_scalars"):
        logger.log(0, {"train/loss": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="reserved"):
        logger.log(0, {"step": 1.0})
    with pytest.raises(ValueError, match="step"):
        logger.log(-1, {"train/loss": 1.0})
    logger.close()
    logger.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        logger.log(0, {"train/loss": 1.0})
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing invalid was written


def test_logger_writes_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path) as logger:
        logger.log(0, {"train/loss": 1.5, "reward/digit_mean": 0.25})
        logger.log(1, {"train/loss": 0.5})
        logger.log_eval(1, {"eval/digit_eval": 0.75})
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"train/loss", "reward/digit_mean", "eval/digit_eval"}
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(0, 1.5), (1, 0.5)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/digit_eval")] == [(1, 0.75)]


# ---------------------------------------------------------------------------------------------------------- timer


def test_stage_timer_accumulates_and_resets():
    ticks = iter([0.0, 1.0, 10.0, 10.5, 20.0, 22.0, 30.0, 33.0])
    timer = StageTimer(clock=lambda: next(ticks))
    with timer("sample"):
        pass
    with timer("optimize"):
        pass
    with timer("sample"):
        pass
    assert timer.scalars() == {"time/sample": 3.0, "time/optimize": 0.5}
    assert timer.scalars() == {}
    with pytest.raises(KeyError), timer("reward"):  # an exception inside still counts the time
        raise KeyError
    assert timer.scalars() == {"time/reward": 3.0}


def test_stage_timer_sync_and_nesting():
    calls = []
    timer = StageTimer(sync=lambda: calls.append("sync"), clock=lambda: 0.0)
    with timer("outer"):
        with pytest.raises(ValueError, match="already being timed"):
            with timer("outer"):
                pass
        with timer("inner"):
            pass
    assert calls == ["sync"] * 4
    assert set(timer.scalars()) == {"time/outer", "time/inner"}


# ---------------------------------------------------------------------------------------------------------- diversity


def reference_diversity(images, group_ids):
    """Slow loop over pairs: the definition written out."""
    flat = images.reshape(images.shape[0], -1).double()
    dists = [
        (flat[i] - flat[j]).norm().item() / math.sqrt(flat.shape[1])
        for i, j in itertools.combinations(range(len(flat)), 2)
        if group_ids[i] == group_ids[j]
    ]
    return sum(dists) / len(dists)


def test_diversity_hand_computed():
    base = torch.rand(1, 3, 4, 4) * 0.5
    # group 0: two identical images -> 0; group 1: two images differing by 0.3 everywhere -> 0.3
    images = torch.cat([base, base, base, base + 0.3])
    out = within_group_diversity(images, torch.tensor([0, 0, 1, 1]))
    assert out.shape == () and out.dtype == torch.float32
    assert out.item() == pytest.approx((0.0 + 0.3) / 2, abs=1e-6)
    identical = within_group_diversity(images[:2], torch.tensor([7, 7]))
    assert identical.item() == 0.0
    differ = within_group_diversity(images[2:], torch.tensor([1, 1]))
    assert differ.item() == pytest.approx(0.3, abs=1e-6)


def test_diversity_unequal_groups_pairs_pooled():
    # group 5: {0, 0.2, 0.6} -> pairs 0.2, 0.6, 0.4; group 2: {1, 0.5} -> 0.5; group 9: singleton -> nothing
    levels = [(5, 0.0), (2, 1.0), (5, 0.2), (9, 0.9), (5, 0.6), (2, 0.5)]
    images = torch.stack([torch.full((3, 2, 2), v) for _, v in levels])
    ids = torch.tensor([g for g, _ in levels])
    expected = (0.2 + 0.6 + 0.4 + 0.5) / 4
    assert within_group_diversity(images, ids).item() == pytest.approx(expected, abs=1e-6)


def test_diversity_matches_loop_reference_random():
    gen = torch.Generator().manual_seed(0)
    images = torch.rand(11, 3, 5, 6, generator=gen)
    ids = torch.tensor([3, 1, 3, 3, 0, 1, 4, 0, 0, 0, 3], dtype=torch.int64)
    out = within_group_diversity(images, ids)
    assert out.item() == pytest.approx(reference_diversity(images, ids), rel=1e-5)
    perm = torch.randperm(11, generator=gen)
    assert within_group_diversity(images[perm], ids[perm]).item() == pytest.approx(out.item(), rel=1e-5)


def test_diversity_collapsed_large_batch_is_exactly_zero():
    # B > 25 is where cdist's default switches to the matmul form, which gives identical images a small positive
    # distance by cancellation; a collapsed group must read exactly 0.
    gen = torch.Generator().manual_seed(1)
    prototypes = torch.rand(8, 3, 32, 32, generator=gen)
    images = prototypes.repeat_interleave(6, dim=0)  # 8 groups x 6 identical candidates, B = 48
    ids = torch.arange(8).repeat_interleave(6)
    assert within_group_diversity(images, ids).item() == 0.0


def test_diversity_video_and_bf16():
    images = torch.zeros(2, 3, 2, 4, 4, dtype=torch.bfloat16)
    images[1] += 0.5
    out = within_group_diversity(images, torch.tensor([0, 0]))
    assert out.dtype == torch.float32 and out.item() == pytest.approx(0.5)


def test_diversity_no_pairs_is_nan():
    assert math.isnan(within_group_diversity(torch.rand(3, 3, 2, 2), torch.arange(3)).item())


def test_diversity_rejects_bad_inputs():
    with pytest.raises(ValueError, match="group_ids"):
        within_group_diversity(torch.rand(4, 3, 2, 2), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="integer"):
        within_group_diversity(torch.rand(4, 3, 2, 2), torch.zeros(4))
    with pytest.raises(ValueError, match="float"):
        within_group_diversity(torch.zeros(4, 3, 2, 2, dtype=torch.uint8), torch.zeros(4, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------------------- grids


def test_save_grid_size_layout_and_scale(tmp_path):
    b, h, w = 5, 4, 6
    images = torch.zeros(b, 3, h, w)
    for k in range(b):
        images[k, 0] = k / 10  # red channel encodes the index
    images[0, 1] = 1.0
    path = save_grid(images, tmp_path / "samples" / "step_000010.png", nrow=3, scale=2, padding=1)
    assert path == tmp_path / "samples" / "step_000010.png"
    img = Image.open(path)
    assert img.format == "PNG" and img.mode == "RGB"
    cols, rows = 3, 2
    assert img.size == (2 * (cols * (w + 1) + 1), 2 * (rows * (h + 1) + 1))  # (40, 22)
    px = np.asarray(img)
    # tile k sits at row k // 3, column k % 3 (1-pixel padding, then everything x2)
    for k in range(b):
        r, c = divmod(k, 3)
        top, left = 2 * (1 + r * (h + 1)), 2 * (1 + c * (w + 1))
        tile = px[top:top + 2 * h, left:left + 2 * w]
        assert (tile[..., 0] == round(255 * k / 10)).all()
    assert (px[0, 0] == 128).all()  # padding is mid-grey
    assert (px[2:10, 2:14, 1] == 255).all()  # tile 0's green, upscaled
    assert (px[2 + 2 * (h + 1):, 2 + 2 * 2 * (w + 1):] == 128).all()  # the empty 6th cell stays padding colour
    assert [p.name for p in (tmp_path / "samples").iterdir()] == ["step_000010.png"]  # no temporary left behind


def test_save_grid_grey_and_clamp(tmp_path):
    images = torch.tensor([-0.5, 0.5, 1.5]).reshape(3, 1, 1, 1).expand(3, 1, 2, 2)
    img = Image.open(save_grid(images, tmp_path / "g.png", nrow=3, padding=0))
    assert img.mode == "L" and img.size == (6, 2)
    assert np.asarray(img)[0].tolist() == [0, 0, 128, 128, 255, 255]


def test_save_grid_overwrites_atomically(tmp_path):
    path = tmp_path / "g.png"
    save_grid(torch.zeros(1, 3, 2, 2), path, nrow=1, padding=0)
    save_grid(torch.ones(2, 3, 2, 2), path, nrow=1, padding=0)
    assert Image.open(path).size == (2, 4)
    assert [p.name for p in tmp_path.iterdir()] == ["g.png"]


def test_save_grid_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="shape"):
        save_grid(torch.zeros(3, 4, 4), tmp_path / "g.png", nrow=1)
    with pytest.raises(ValueError, match="nrow"):
        save_grid(torch.zeros(1, 3, 4, 4), tmp_path / "g.png", nrow=0)
    with pytest.raises(ValueError, match="NaN"):
        save_grid(torch.full((1, 3, 4, 4), float("nan")), tmp_path / "g.png", nrow=1)
    assert not list(tmp_path.iterdir())


def test_sample_grid_path(tmp_path):
    assert sample_grid_path(tmp_path, 10) == tmp_path / "samples" / "step_000010.png"


# ---------------------------------------------------------------------------------------------------------- provenance


def test_run_provenance_fields(tmp_path):
    import flowforge

    prov = run_provenance()
    json.dumps(prov)  # serialisable
    assert prov["flowforge"] == flowforge.__version__
    assert prov["torch"] == torch.__version__
    assert {"diffusers", "git_commit", "git_dirty", "hostname", "time_utc", "python"} <= set(prov)
    assert prov["time_utc"].endswith("+00:00")
    path = write_provenance(tmp_path)
    assert json.loads(path.read_text())["torch"] == torch.__version__


def test_run_provenance_without_git(monkeypatch):
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(metrics.subprocess, "run", no_git)
    prov = run_provenance()
    assert prov["git_commit"] is None and prov["git_dirty"] is None


def test_run_provenance_git_failure(monkeypatch):
    def failing(*args, **kwargs):
        return subprocess.CompletedProcess(args, returncode=128, stdout="", stderr="not a git repository")

    monkeypatch.setattr(metrics.subprocess, "run", failing)
    assert run_provenance()["git_commit"] is None
