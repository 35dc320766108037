"""flowforge.train.trackers: TensorBoard and W&B (offline) sinks, read back from the files they write; train.log."""

from __future__ import annotations

import io
import json
import logging
import struct
import sys
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from flowforge.train import trackers
from flowforge.train.metrics import MetricsLogger
from flowforge.runtime.run_dir import sample_grid_path
from flowforge.report.grids import save_eval_grid
from flowforge.train.trackers import build_trackers, cell_caption, progress_line, run_logging

PROMPTS = ["a handwritten seven", "a handwritten two", "a handwritten zero"]


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B offline, writing under tmp (never the network, never the user's ~/.config)."""
    pytest.importorskip("wandb")
    root = tmp_path / "wandb_root"
    root.mkdir()
    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(root), "WANDB_SILENT": "true",
                       "WANDB_CONSOLE": "off", "WANDB_CONFIG_DIR": str(root / "config")}.items():
        monkeypatch.setenv(key, value)
    return root


def _wandb_records(wandb_root: Path):
    """Every record of the one offline run under ``wandb_root``, decoded with wandb's own protobuf schema.

    The ``.wandb`` transaction log is a LevelDB-style log: a 7-byte header (``:W&B``, magic, version), then 32 KiB
    blocks of chunks ``<crc32c u32, length u16, type u8>`` + payload (type 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = wandb_root.glob("wandb/offline-run-*/run-*.wandb")
    for _ in range(100):  # wandb's service may still be appending after finish() returns: wait for the exit record
        records = _read_records(path, wandb_internal_pb2)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        time.sleep(0.1)
    return path.parent, records


def _read_records(path: Path, schema) -> list:
    """The records of a ``.wandb`` transaction log (:func:`_wandb_records`), decoded with ``schema``."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, out = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # block trailer padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = schema.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def _wandb_history(records):
    """step -> {key: json value} of the history rows (nested keys joined with '.')."""
    rows = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {".".join(i.nested_key) if i.nested_key else i.key: json.loads(i.value_json) for i in r.history.item}
            rows.setdefault(row["_step"], {}).update(row)
    return rows


def _wandb_config(records):
    cfg = {}
    for r in records:
        kind = r.WhichOneof("record_type")
        if kind in ("run", "config"):
            for u in (r.run.config if kind == "run" else r.config).update:
                cfg[u.key] = json.loads(u.value_json)
    return cfg


def _wandb_run(records):
    """(project, display name, tags) of the run record."""
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"][:1]
    return run.project, run.display_name, list(run.tags)


def test_wandb_settings_come_from_the_config_and_unset_ones_from_the_environment(tmp_path, wandb_offline,
                                                                                  monkeypatch):
    from flowforge.config import load_config

    monkeypatch.setenv("WANDB_PROJECT", "env-project")
    monkeypatch.setenv("WANDB_NAME", "env-name")
    cfg = load_config(None, ["metrics.wandb={project: cfg-project, tags: [a, b]}"])
    with MetricsLogger(tmp_path / "run", trackers=["wandb"], run_name="r", wandb=cfg.metrics.wandb) as logger:
        logger.log(1, {"train/loss": 0.5})
    assert _wandb_run(_wandb_records(wandb_offline)[1]) == ("cfg-project", "env-name", ["a", "b"])


def _tb(run_dir: Path):
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(run_dir / "tb"), size_guidance={ea.IMAGES: 0, ea.TENSORS: 0, ea.SCALARS: 0})
    acc.Reload()
    return acc


def _tb_text(acc, tag):
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]


def _write_grid(run_dir: Path, step: int) -> Path:
    images = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(step))
    scores = {"digit_eval": torch.tensor([1.0, 0.0, float("nan")]), "digit": torch.tensor([0.9, 0.25, 0.5])}
    return save_eval_grid(images, sample_grid_path(run_dir, step), PROMPTS, scores, step)


def test_cell_caption_names_prompt_and_scores():
    assert cell_caption({"prompt": "a seven", "scores": {"digit_eval": 1.0, "digit": None}}) == \
        "a seven | digit_eval=1.000, digit=nan"
    assert cell_caption({"prompt": "a seven", "scores": {}}) == "a seven"


def test_build_trackers_names(tmp_path, monkeypatch):
    assert build_trackers(["jsonl"], tmp_path, run_name="r") == []  # jsonl is the logger's own, always on
    with pytest.raises(ValueError, match="mlflow"):
        build_trackers(["mlflow"], tmp_path, run_name="r")
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(ImportError, match=r"flowforge\[wandb\]"):
        build_trackers(["wandb"], tmp_path, run_name="r")


def test_tensorboard_and_wandb_hold_images_captions_and_config(tmp_path, wandb_offline):
    run = tmp_path / "run"
    config = {"run": {"name": "r", "seed": 3}, "metrics": {"trackers": ["jsonl", "tensorboard", "wandb"]}}
    with MetricsLogger(run, trackers=["jsonl", "tensorboard", "wandb"], run_name="r") as logger:
        logger.log_config(config, "run:\n  name: r\n  seed: 3\n")
        logger.log(1, {"train/loss": 0.5})
        png = _write_grid(run, 2)
        logger.log_eval(2, {"eval/digit_eval": 0.5})
        logger.log_grid(2, png)
    assert (run / "metrics.jsonl").exists() and (run / "eval.jsonl").exists()
    grid = Image.open(png).convert("RGB")
    cells = json.loads(png.with_suffix(".json").read_text())["cells"]

    acc = _tb(run)
    (event,) = acc.Images("eval/samples")
    assert event.step == 2
    tb_image = Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB")
    assert tb_image.size == grid.size and tb_image.tobytes() == grid.tobytes()  # PNG: lossless
    ((step, captions),) = _tb_text(acc, "eval/samples_captions/text_summary")
    assert step == 2 and "1. a handwritten seven | digit_eval=1.000, digit=0.900" in captions
    assert "3. a handwritten zero | digit_eval=nan, digit=0.500" in captions
    ((_, yaml_text),) = _tb_text(acc, "config/text_summary")
    assert "name: r" in yaml_text and "seed: 3" in yaml_text
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 0.5)]

    run_files, records = _wandb_records(wandb_offline)
    assert _wandb_config(records)["run"] == {"name": "r", "seed": 3}
    history = _wandb_history(records)
    assert history[1]["train/loss"] == 0.5 and history[2]["eval/digit_eval"] == 0.5
    row = history[2]
    assert row["eval/samples._type"] == "images/separated"
    assert row["eval/samples.captions"] == [cell_caption(c) for c in cells]
    assert "a handwritten two | digit_eval=0.000, digit=0.250" in row["eval/samples.captions"]
    for name, cell in zip(row["eval/samples.filenames"], cells):  # each cell cropped out of the grid
        image = Image.open(run_files / "files" / name).convert("RGB")
        assert image.tobytes() == grid.crop(tuple(cell["box"])).tobytes()
    assert (run / trackers.WANDB_ID_FILE).read_text().strip() == run_files.name.rsplit("-", 1)[1]


def test_run_logging_writes_the_file_and_undoes_itself(tmp_path):
    flowforge_log = logging.getLogger("flowforge")
    before = (list(flowforge_log.handlers), flowforge_log.level)
    with run_logging(tmp_path / "train.log"):
        logging.getLogger("flowforge.x").info("eval step %d: a=1", 0)
        logging.getLogger("flowforge").debug("not kept")
    assert (list(flowforge_log.handlers), flowforge_log.level) == before
    text = (tmp_path / "train.log").read_text()
    assert "INFO flowforge.x: eval step 0: a=1" in text and "not kept" not in text
    with run_logging(None):  # other ranks: no file
        logging.getLogger("flowforge").info("x")
    assert progress_line(3, 10, {"reward/total_mean": 0.41234, "train/skipped": 0.0, "train/loss": 1e-5}) == \
        "step 3/10: reward/total_mean=0.4123, train/loss=1e-05"


def test_tiny_run_logs_to_every_tracker_and_train_log(tiny_model_dir, tmp_path, encode_cache_dir, wandb_offline):
    from flowforge.train.trainer import Trainer
    from tests.train.test_trainer import tiny_cfg

    cfg = tiny_cfg(tiny_model_dir, tmp_path, encode_cache_dir, "metrics.trackers=[jsonl,tensorboard,wandb]",
                   "metrics.log_every=1", "metrics.wandb={project: ff-tiny, name: tiny-run, tags: [rl, digits]}")
    trainer = Trainer(cfg, progress=False)
    run = trainer.train()
    assert not any(isinstance(h, logging.FileHandler) for h in logging.getLogger("flowforge").handlers)

    log_text = (run / "train.log").read_text()
    assert "eval step 0:" in log_text and "eval step 2:" in log_text  # evaluations before the first / after last
    assert "step 1/2: reward/total_mean=" in log_text and "step 2/2: reward/total_mean=" in log_text

    acc = _tb(run)
    assert [e.step for e in acc.Images("eval/samples")] == [0, 2]
    ((_, yaml_text),) = _tb_text(acc, "config/text_summary")
    assert "trackers:" in yaml_text and "wandb" in yaml_text

    _, records = _wandb_records(wandb_offline)
    config = _wandb_config(records)
    assert config["metrics"]["trackers"] == ["jsonl", "tensorboard", "wandb"] and config["train"]["steps"] == 2
    assert _wandb_run(records) == ("ff-tiny", "tiny-run", ["rl", "digits"])  # metrics.wandb reached wandb.init
    history = _wandb_history(records)
    prompts = [c["prompt"] for c in json.loads(sample_grid_path(run, 2).with_suffix(".json").read_text())["cells"]]
    for step in (0, 2):
        captions = history[step]["eval/samples.captions"]
        assert len(captions) == len(prompts) and all(c.startswith(p + " | digit") for c, p in zip(captions, prompts))
    assert "reward/total_mean" in history[1] and "eval/digit_eval" in history[2]


def test_cli_summary_only_on_rank_zero(monkeypatch, tmp_path, capsys):
    import flowforge.train.trainer as trainer_mod
    from flowforge.cli import train as cli_train

    class FakeTrainer:
        def __init__(self, cfg, *, progress, overwrite):
            self.dist = type("D", (), {"is_main": is_main})()

        def train(self, signals=None):
            return tmp_path

    monkeypatch.setattr(trainer_mod, "Trainer", FakeTrainer)
    args = type("A", (), {"config": None, "overrides": [], "no_progress": True, "overwrite": False})()
    for is_main in (True, False):
        assert cli_train.run(args) == 0
        assert ("run directory:" in capsys.readouterr().out) == is_main
