"""flowforge.report.run: self-contained HTML from a run directory that answers first (summary, first / last grids
captioned per image); robust to missing files and killed / resumed runs."""

from __future__ import annotations

import base64
import io
import json
import math
import re
import runpy
import sys
from html.parser import HTMLParser

import pytest
import torch
from PIL import Image

from flowforge.runtime.errors import UserError
from flowforge.train.metrics import MetricsLogger, write_provenance
from flowforge.report.grids import save_grid
from flowforge.runtime.run_dir import sample_grid_path
from flowforge.report.run import main, read_jsonl, write_report
from flowforge.report.grids import read_grid_cells, save_eval_grid

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


def test_report_of_a_run_without_logs_and_refusal_of_a_foreign_dir(tmp_path):
    (tmp_path / "checkpoints").mkdir()  # a run killed before it logged a step
    page = write_report(tmp_path).read_text()
    assert "No metrics.jsonl" in page and "No eval.jsonl" in page
    assert img_tags(page) == []
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(UserError, match="not a flowforge run directory"):
        write_report(foreign)
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]  # no report.html dropped there


def test_report_missing_run_dir(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_report(tmp_path / "nope")


def test_grid_captions_without_eval_and_numeric_order(tmp_path):
    for name in ("step_10.png", "step_9.png", "step_abc.png"):
        save_grid(torch.zeros(1, 3, 2, 2), tmp_path / "samples" / name, nrow=1)
    (tmp_path / "metrics.jsonl").write_text("")
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


@pytest.mark.filterwarnings("ignore:'flowforge.report.run' found in sys.modules:RuntimeWarning")  # runpy re-executes it
def test_cli_main_and_module(full_run, capsys, monkeypatch):
    assert main([str(full_run)]) == 0
    assert capsys.readouterr().out.strip() == str(full_run / "report.html")
    (full_run / "report.html").unlink()
    monkeypatch.setattr(sys, "argv", ["flowforge.report.run", str(full_run)])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("flowforge.report.run", run_name="__main__")
    assert exit_info.value.code == 0
    assert (full_run / "report.html").is_file()
    assert main([str(full_run / "missing")]) == 2
    assert "run directory not found" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------------------
# the page answers first: summary header, first / last grids with per-image captions, folded panels, config diff


class _Page(HTMLParser):
    """Collects the page structure: ids, <img> data, <details> summaries, text of the summary table."""

    def __init__(self):
        super().__init__()
        self.ids, self.imgs, self.summaries, self.classes = [], [], [], []
        self.text, self._in_summary = [], False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.append(a["id"])
        if "class" in a:
            self.classes.append((tag, a["class"]))
        if tag == "img":
            self.imgs.append(a)
        self._in_summary = tag == "summary" or self._in_summary

    def handle_endtag(self, tag):
        if tag == "summary":
            self._in_summary = False

    def handle_data(self, data):
        self.text.append(data)
        if self._in_summary:
            self.summaries.append(data)


def parse(page):
    parser = _Page()
    parser.feed(page)
    parser.close()
    return parser


def decode_all(imgs):
    """Every <img> is a PNG data URI that Pillow decodes."""
    sizes = []
    for img in imgs:
        head, data = img["src"].split(",", 1)
        assert head == "data:image/png;base64"
        with Image.open(io.BytesIO(base64.b64decode(data, validate=True))) as im:
            im.load()
            sizes.append(im.size)
    return sizes


PROMPTS = ["a handwritten seven", "the number 3, written neatly", "a zero"]


@pytest.fixture
def captioned_run(tmp_path):
    """A run directory as the trainer writes it: config, metrics with a constant-zero metric and an eval-only
    scorer, evals at steps 0 / 2 / 4 with captioned grids, two committed checkpoints."""
    from flowforge.config import dump_config, load_config

    run = tmp_path / "digits-x"
    cfg = load_config(None, ["run.name=digits-x", "train.steps=4", "train.lr=1e-4", "eval.scorers=[digit_eval]",
                             "data.prompts_per_step=2", "data.group_size=4"])
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(cfg))
    with MetricsLogger(run, tensorboard=False) as logger:
        for step in range(1, 5):
            logger.log(step, {"reward/digit_mean": 0.4 + 0.1 * step, "reward/digit_std": 0.1,
                              "reward/digit_eval_mean": 0.5, "reward/digit_eval_std": 0.2,
                              "reward/total_mean": 0.4 + 0.1 * step, "train/loss": 0.1 * step,
                              "train/first_update_ratio_dev": 0.0, "train/skipped": 0.0, "time/sample": 2.0})
        for step in (0, 2, 4):
            logger.log_eval(step, {"eval/digit_eval": [0.5, 0.9, 0.8][step // 2], "eval/digit": 0.7,
                                   "eval/diversity": 0.2})
            images = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(step))
            save_eval_grid(images, sample_grid_path(run, step), PROMPTS,
                           {"digit_eval": torch.tensor([1.0, 0.0, float("nan")]), "digit": torch.full((3,), 0.25)},
                           step)
    write_provenance(run)
    for step in (2, 4):
        d = run / "checkpoints" / f"step_{step:06d}"
        d.mkdir(parents=True)
        (d / "COMMITTED").write_text("{}")
    return run


def test_summary_header_first_last_grids_and_every_image_decodes(captioned_run):
    page = write_report(captioned_run).read_text()
    doc = parse(page)
    # the answer comes first: summary, then the first / last grids, then the curves
    assert doc.ids[:3] == ["summary", "first-last", "training"]
    text = "".join(doc.text)
    assert "held-out eval/digit_eval" in text
    assert re.search(r"final 0\.8 \(step 4\) · best 0\.9 \(step 2\) · start 0\.5 \(step 0\)", text)
    assert "samples seen" in text and "32 (2 prompts × 4 candidates per step)" in text  # 4 steps x 8
    assert "4 of 4" in text and "wall time" in text and "8 s in training stages" in text
    assert "2 committed, steps 2, 4" in text
    run = str(captioned_run)
    assert f"flowforge export {run} exports/digits-x --form merged --verify" in text
    assert "flowforge sample exports/digits-x --prompt 'a handwritten seven' --out grid.png" in text
    # first (step 0) and last (step 4) grids side by side, each image cropped and captioned with prompt and score
    cells = [img for img in doc.imgs if img["class"] == "cell"]
    assert [c["alt"] for c in cells] == [f"step {s}: {p}" for s in (0, 4) for p in PROMPTS]
    assert "step 0 — eval/digit_eval 0.5" in text and "step 4 — eval/digit_eval 0.8" in text
    assert "a handwritten seven — digit_eval 1 · digit 0.25" in text
    assert "a zero — digit_eval nan · digit 0.25" in text
    sizes = decode_all(doc.imgs)
    assert len(sizes) == len(doc.imgs) > 6
    assert sizes[: len(cells)] == [(16, 16)] * len(cells)  # 8x8 tiles at the grid's scale 2, padding cropped off
    # the cropped cell is exactly the tile of the grid
    grid = Image.open(sample_grid_path(captioned_run, 4))
    box = json.loads(sample_grid_path(captioned_run, 4).with_suffix(".json").read_text())["cells"][1]["box"]
    cell = Image.open(io.BytesIO(base64.b64decode(cells[4]["src"].split(",", 1)[1])))
    assert cell.tobytes() == grid.crop(tuple(box)).tobytes()


def test_folded_panels_eval_only_scorers_and_config_diff(captioned_run):
    page = write_report(captioned_run).read_text()
    doc = parse(page)
    summaries = " ".join(doc.summaries)
    # constant-zero metrics folded away, eval-only scorers kept out of the training rewards
    assert "2 metric(s) 0 at every step: train/first_update_ratio_dev, train/skipped" in summaries
    assert "Eval-only scorers on training batches (not trained on): reward/digit_eval_mean, reward/digit_eval_std" \
        in summaries
    training = page.split('id="training"')[1].split("<details>")[0]
    assert "digit_eval" not in training
    # config: the changed keys against the defaults, the full file one click away
    diff = page.split('id="config"')[1]
    rows = re.findall(r"<tr><td>([^<]*)</td><td>([^<]*)</td><td>([^<]*)</td></tr>", diff)
    assert ("train.lr", "0.0001", "0.0003") in rows and ("train.steps", "4", "60") in rows
    assert ("eval.scorers", "[digit_eval]", "[]") in rows
    assert all(not k.startswith("sampler.") for k, _, _ in rows)  # unchanged keys are not listed
    assert "Full resolved config (config.yaml)" in summaries
    # versions in provenance
    for name in ("torch", "diffusers", "transformers", "peft"):
        assert re.search(rf"<th>{name}</th><td>\d", page), name


def test_samples_axis_and_smoothing(captioned_run, monkeypatch):
    from flowforge.report import plots as report_plots

    calls = []
    real = report_plots.plot_panels

    def spy(rows, keys, **kw):
        calls.append((tuple(keys), kw.get("per_step"), kw.get("smoothing")))
        return real(rows, keys, **kw)

    monkeypatch.setattr("flowforge.report.run.plot_panels", spy)
    write_report(captioned_run, smoothing=0.6)
    train_calls = [c for c in calls if c[2] is not None]
    assert train_calls and all(per_step == 8 and s == 0.6 for _, per_step, s in train_calls)
    assert report_plots.smooth([1.0, float("nan"), 3.0], 0.5)[0] == 1.0  # debiased: starts at the first value
    s = report_plots.smooth([1.0, float("nan"), 3.0], 0.5)
    assert math.isnan(s[1]) and s[2] == pytest.approx((0.25 * 1 + 0.5 * 3) / 0.75)
    with pytest.raises(ValueError):
        write_report(captioned_run, smoothing=1.0)
    fig = real([{"step": 1.0, "a": 1.0}, {"step": 2.0, "a": 2.0}], ["a"], per_step=8)
    (ax,) = [a for a in fig.axes if a.get_title() == "a"]
    assert ax.child_axes and ax.child_axes[0].get_xlabel() == "samples seen"


def test_grid_sidecar_matches_the_grid(tmp_path):
    images = torch.rand(12, 3, 4, 6)
    path = save_eval_grid(images, tmp_path / "step_000003.png", [f"p{i}" for i in range(12)],
                          {"s": torch.arange(12.0)}, 3)
    cells = read_grid_cells(path)
    grid = Image.open(path).convert("RGB")
    for i, cell in enumerate(cells):
        assert cell["prompt"] == f"p{i}" and cell["scores"] == {"s": float(i)}
        tile = grid.crop(tuple(cell["box"])).resize((6, 4), Image.Resampling.NEAREST)
        expected = (images[i].clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0)
        assert torch.equal(torch.frombuffer(bytearray(tile.tobytes()), dtype=torch.uint8).view(4, 6, 3), expected)
    # video: one cell per row of frames
    video = torch.rand(2, 3, 5, 4, 4)
    path = save_eval_grid(video, tmp_path / "v.png", ["a", "b"], {}, 0)
    boxes = [c["box"] for c in read_grid_cells(path)]
    assert boxes == [[4, 4, 2 * (2 + 5 * 6) - 4, 12], [4, 16, 2 * (2 + 5 * 6) - 4, 24]]
    with pytest.raises(ValueError, match="need 2 prompts"):
        save_eval_grid(video, tmp_path / "w.png", ["a"], {}, 0)
    (tmp_path / "v.json").write_text("{not json")
    assert read_grid_cells(path) is None


def test_trainer_eval_writes_captioned_grids(tiny_model_dir, encode_cache_dir, tmp_path):
    """A real 2-step run: every eval grid has its sidecar (prompt and score of each cell), and the report shows
    them captioned."""
    from tests.train.test_trainer import tiny_cfg
    from flowforge.train.trainer import Trainer

    run = Trainer(tiny_cfg(tiny_model_dir, tmp_path, encode_cache_dir, "eval.samples_per_prompt=2"),
                  progress=False).train()
    for step in (0, 2):
        cells = read_grid_cells(sample_grid_path(run, step))
        assert [c["prompt"] for c in cells] == [r["prompt"] for r in _eval_records(3)]
        assert set(cells[0]["scores"]) == {"digit", "digit_eval"}
    doc = parse((run / "report.html").read_text())
    assert [i["alt"] for i in doc.imgs if i["class"] == "cell"] == [f"step {s}: {r['prompt']}" for s in (0, 2)
                                                                   for r in _eval_records(3)]
    decode_all(doc.imgs)


def _eval_records(n):
    from flowforge.data.prompts import load_prompts

    return [{"prompt": r.prompt} for r in load_prompts("demo:eval")[:n]]
