"""flowforge.train.report: self-contained HTML from a run directory; robust to missing files and killed / resumed runs."""

from __future__ import annotations

import base64
import json
import math
import re
import runpy
import sys

import pytest
import torch

from flowforge.train.metrics import MetricsLogger, sample_grid_path, save_grid, write_provenance
from flowforge.train.report import main, read_jsonl, write_report

CONFIG_TEXT = "run:\n  name: digits <script>alert(1)</script> & co\ntrain:\n  lr: 0.0001\n"


def img_tags(page):
    return re.findall(r'<img class="(\w+)" alt="([^"]*)" src="([^"]*)"', page)


@pytest.fixture
def full_run(tmp_path):
    run = tmp_path / "run"
    with MetricsLogger(run, tensorboard=False) as logger:
        for step in range(6):
            logger.log(step, {
                "reward/digit_mean": 0.5 + 0.05 * step, "reward/digit_std": 0.1,
                "reward/jpeg_mean": -3.0 + 0.1 * step,  # no std: no band
                "train/loss": 0.1, "train/clip_fraction": 0.02, "train/approx_kl": 1e-4,
                "train/diversity": 0.3 - 0.02 * step, "time/sample": 1.0,
            })
            if step % 2 == 0:
                logger.log_eval(step, {"eval/digit_eval": 0.6 + 0.1 * step, "eval/diversity": 0.25,
                                       "eval/jpeg<b>": -3.0})
    for step in (4, 0, 2):
        save_grid(torch.full((4, 3, 4, 4), step / 10), sample_grid_path(run, step), nrow=2)
    (run / "config.yaml").write_text(CONFIG_TEXT)
    write_provenance(run)
    return run


def test_report_full_run(full_run):
    path = write_report(full_run)
    assert path == full_run / "report.html"
    page = path.read_text()
    tags = img_tags(page)
    # every image is embedded: the page is self-contained
    assert all(src.startswith("data:image/png;base64,") for _, _, src in tags)
    assert all(base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n" for _, _, src in tags)
    alts = [alt for cls, alt, _ in tags if cls == "plot"]
    assert "training reward mean per component" in alts
    assert "training loss, clip fraction, approx KL, diversity" in alts
    assert "DigitEval and eval diversity" in alts  # digit_eval and diversity in one figure, side by side
    assert "time metrics" in alts
    assert "Not logged" not in page  # every named curve was found
    # grids in step order, captioned with that step's eval values
    grids = [alt for cls, alt, _ in tags if cls == "grid"]
    assert grids == ["samples at step 0", "samples at step 2", "samples at step 4"]
    captions = re.findall(r"<figcaption>(.*?)</figcaption>", page)
    assert captions[1].startswith("step 2 — eval/digit_eval 0.8 · eval/diversity 0.25")
    # config verbatim but escaped, provenance shown
    assert "digits &lt;script&gt;alert(1)&lt;/script&gt; &amp; co" in page
    assert "lr: 0.0001" in page
    assert "<script>" not in page
    assert "eval/jpeg&lt;b&gt;" in page and "<b>" not in page
    assert f"<th>torch</th><td>{torch.__version__}</td>" in page


def test_report_without_eval_samples_config_provenance(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(0, {"train/loss": 1.0})
        logger.log(1, {"train/loss": float("nan")})
    page = write_report(tmp_path).read_text()
    assert "No eval.jsonl in this run directory" in page
    assert "No sample grids" in page
    assert "No config.yaml" in page and "No provenance.json" in page
    assert "No reward/*_mean metrics logged." in page
    assert "Not logged: train/clip_fraction, train/approx_kl, train/diversity." in page
    assert [alt for _, alt, _ in img_tags(page)] == ["training loss, clip fraction, approx KL, diversity"]


def test_report_empty_run_dir(tmp_path):
    page = write_report(tmp_path).read_text()
    assert "No metrics.jsonl" in page and "No eval.jsonl" in page
    assert img_tags(page) == []


def test_report_missing_run_dir(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_report(tmp_path / "nope")


def test_grid_captions_without_eval_and_numeric_order(tmp_path):
    for name in ("step_10.png", "step_9.png", "step_abc.png"):
        save_grid(torch.zeros(1, 3, 2, 2), tmp_path / "samples" / name, nrow=1)
    page = write_report(tmp_path).read_text()
    assert [alt for cls, alt, _ in img_tags(page) if cls == "grid"] == ["samples at step 9", "samples at step 10"]
    assert "step 9 — no eval logged at this step" in page


def test_read_jsonl_killed_and_resumed_run(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 0, "train/loss": 1.0},
        {"step": 0, "perf/x": 5.0},  # same step logged twice: merged
        {"step": 1, "train/loss": 2.0},
        {"step": 2, "train/loss": 3.0},
        {"step": 1, "train/loss": 20.0},  # resumed from the step-1 checkpoint: steps 1, 2 superseded
        {"step": 2, "train/loss": None},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 3, "train/lo')  # cut off by a kill
    rows, problems = read_jsonl(path)
    assert [r["step"] for r in rows] == [0.0, 1.0, 2.0]
    assert rows[0] == {"step": 0.0, "train/loss": 1.0, "perf/x": 5.0}
    assert rows[1]["train/loss"] == 20.0
    assert math.isnan(rows[2]["train/loss"])
    assert len(problems) == 2
    assert "resumed" in problems[0] and "2 earlier step(s)" in problems[0]
    assert "not valid JSON" in problems[1]


def test_report_notes_skipped_lines(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "train/loss": 1.0}\n{"step": 1, "tr')
    page = write_report(tmp_path).read_text()
    assert "metrics.jsonl:2: not valid JSON (skipped)" in page


@pytest.mark.filterwarnings("ignore:'flowforge.train.report' found in sys.modules:RuntimeWarning")  # runpy re-executes it
def test_cli_main_and_module(full_run, capsys, monkeypatch):
    assert main([str(full_run)]) == 0
    assert capsys.readouterr().out.strip() == str(full_run / "report.html")
    (full_run / "report.html").unlink()
    monkeypatch.setattr(sys, "argv", ["flowforge.train.report", str(full_run)])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("flowforge.train.report", run_name="__main__")
    assert exit_info.value.code == 0
    assert (full_run / "report.html").is_file()
    assert main([str(full_run / "missing")]) == 2
    assert "run directory not found" in capsys.readouterr().err
