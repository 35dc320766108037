"""flowforge.report.run: self-contained HTML from a run directory that answers first (summary, first / last grids
captioned per image); robust to missing files and killed / resumed runs."""

from __future__ import annotations

import base64
import io
import json
import math
import re
import runpy
import statistics
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
from flowforge.report.grids import read_eval_diversity, read_eval_scores, read_grid_cells, save_eval_grid

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
ALL_SCORES = {0: [0.2, 0.4, 0.5, 0.5, 0.7, 0.7],  # prompt means 0.3, 0.5, 0.7: mean 0.5, SE 0.2 / sqrt(3)
              2: [0.9] * 6,
              4: [0.7, 0.7, 0.7, 0.7, 1.0, 1.0]}  # means 0.7, 0.7, 1.0: mean 0.8; paired changes 0.4, 0.2, 0.3
"""Every eval sample's digit_eval (3 prompts x 2 samples, prompt-major), consistent with eval.jsonl's means."""


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
                           step, all_scores={"digit_eval": torch.tensor(ALL_SCORES[step])}, samples_per_prompt=2)
    write_provenance(run)
    for step in (2, 4):
        d = run / "checkpoints" / f"step_{step:06d}"
        d.mkdir(parents=True)
        (d / "COMMITTED").write_text("{}")
    return run


def test_summary_header_first_last_grids_and_every_image_decodes(captioned_run):
    page = write_report(captioned_run).read_text()
    doc = parse(page)
    # the answer comes first: the verdict, the summary, the first / last grids, then the held-out curves
    assert [i for i in doc.ids if i in SECTIONS] == list(SECTIONS)
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
    assert decode_all(cells) == [(16, 16)] * len(cells)  # 8x8 tiles at the grid's scale 2, padding cropped off
    # the cropped cell is exactly the tile of the grid
    grid = Image.open(sample_grid_path(captioned_run, 4))
    box = json.loads(sample_grid_path(captioned_run, 4).with_suffix(".json").read_text())["cells"][1]["box"]
    cell = Image.open(io.BytesIO(base64.b64decode(cells[4]["src"].split(",", 1)[1])))
    assert cell.tobytes() == grid.crop(tuple(box)).tobytes()


SECTIONS = ("verdict", "summary", "first-last", "evaluation", "training", "samples", "config", "provenance")


def _verdict(page):
    return page.split('id="verdict"')[1].split("</section>")[0]


def test_verdict_leads_with_the_change_and_its_standard_error(captioned_run):
    """Issue 27: the page opens with the headline metric start -> end, its standard error from every eval sample's
    score (over prompts, the change paired by prompt) and whether the change exceeds 2 SE; the held-out curve with
    ± 1 SE bars beside it, before anything else."""
    page = write_report(captioned_run).read_text()
    assert page.index('id="verdict"') < page.index('id="summary"') < page.index("<details>")
    verdict = _verdict(page)
    text = "".join(parse(verdict).text)
    se_start = statistics.stdev([0.3, 0.5, 0.7]) / math.sqrt(3)  # 0.1155
    se_end = statistics.stdev([0.7, 0.7, 1.0]) / math.sqrt(3)  # 0.1
    se_change = statistics.stdev([0.4, 0.2, 0.3]) / math.sqrt(3)  # 0.05774: paired, smaller than unpaired
    assert f"eval/digit_eval 0.5 → 0.8 (step 0 → 4): +0.3 ± {se_change:.4g}" in text
    assert f"start 0.5 ± {se_start:.4g}, end 0.8 ± {se_end:.4g}: standard errors over 3 held-out prompts x 2 " \
           "samples, the change paired by prompt" in text
    assert f"{0.3 / se_change:.1f} standard errors: an improvement beyond evaluation noise" in text
    assert 'class="good"' in verdict
    assert "best 0.9 at step 2 (± 0)" in text
    assert "within-prompt diversity (eval/diversity) 0.2 → 0.2" in text and "4 of 4 steps" in text
    (curve,) = parse(verdict).imgs
    assert curve["alt"] == "held-out eval/digit_eval over steps"
    decode_all([curve])


def test_verdict_within_noise_and_without_per_sample_scores(captioned_run):
    from flowforge.report.verdict import eval_points

    # end scores that move by +/-0.4 per prompt around a +0.05 mean change: not beyond 2 SE
    scores = [0.6, 0.6, 0.1, 0.1, 1.0, 1.0]  # means 0.6, 0.1, 1.0 (mean 0.5667); changes +0.3, -0.4, +0.3
    save_eval_grid(torch.rand(3, 3, 8, 8), sample_grid_path(captioned_run, 4), PROMPTS,
                   {"digit_eval": torch.zeros(3)}, 4, all_scores={"digit_eval": torch.tensor(scores)},
                   samples_per_prompt=2)
    points = eval_points([(0, sample_grid_path(captioned_run, 0)), (4, sample_grid_path(captioned_run, 4))],
                         "eval/digit_eval")
    assert points[4].mean == pytest.approx(sum(scores) / 6) and points[4].prompt_means == pytest.approx((.6, .1, 1.))
    text = "".join(parse(_verdict(write_report(captioned_run).read_text())).text)
    se = statistics.stdev([0.3, -0.4, 0.3]) / math.sqrt(3)
    assert f"+0.3 ± {se:.4g}" in text  # eval.jsonl's 0.5 -> 0.8 with this sidecar's paired SE
    assert f"{0.3 / se:.1f} standard errors: within evaluation noise" in text
    # grids written before per-sample scores were kept: the change without an error bar, and why
    for step in (0, 2, 4):
        sidecar = sample_grid_path(captioned_run, step).with_suffix(".json")
        data = json.loads(sidecar.read_text())
        del data["eval_scores"]
        sidecar.write_text(json.dumps(data))
    text = "".join(parse(_verdict(write_report(captioned_run).read_text())).text)
    assert "eval/digit_eval 0.5 → 0.8 (step 0 → 4): +0.3" in text and "±" not in text.split("best")[0]
    assert "no standard error: this run's eval grids keep no per-sample scores" in text


def test_diversity_without_a_second_sample_is_explained(captioned_run):
    """eval.samples_per_prompt=1: eval/diversity is NaN at every eval; the verdict, the summary, its panel and the
    Evaluation section say why instead of 'no finite values'."""
    from flowforge.config import dump_config, load_config

    cfg = load_config(captioned_run / "config.yaml", ["eval.samples_per_prompt=1"])
    (captioned_run / "config.yaml").write_text(dump_config(cfg))
    rows = [json.loads(line) for line in (captioned_run / "eval.jsonl").read_text().splitlines()]
    (captioned_run / "eval.jsonl").write_text("".join(json.dumps({**r, "eval/diversity": None}) + "\n" for r in rows))
    page = write_report(captioned_run).read_text()
    why = "eval/diversity compares samples of the same prompt, so it needs eval.samples_per_prompt >= 2 (this run: 1)"
    assert why in "".join(parse(_verdict(page)).text)
    summary = page.split('id="summary"')[1].split('id="first-last"')[0]
    assert f"held-out eval/diversitynot measured: {why}" in "".join(parse(summary).text)
    evaluation = page.split('id="evaluation"')[1].split('id="training"')[0]
    assert f"eval/diversity: not measured: {why}." in "".join(parse(evaluation).text)
    assert "no finite values" not in page


def test_plot_titles_clear_of_offset_labels():
    """Values that need an offset (1.0003 + tiny steps) or a multiplier (1e-7): matplotlib would draw '1e-7' /
    '+1.0003' above the axes' top-left corner over the title; the panels write tick labels in full and put a
    multiplier in the y label, so no visible offset text overlaps a title."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from flowforge.report.plots import plot_panels

    rows = [{"step": float(s), "a/offset": 1.0003 + 1e-6 * s, "a/tiny": 1e-7 * (1 + s), "a/plain": s / 3}
            for s in range(6)]
    fig = plot_panels(rows, ["a/offset", "a/tiny", "a/plain"], per_step=8)
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert set(axes) == {"a/offset", "a/tiny", "a/plain"}
    for title, ax in axes.items():
        offset = ax.yaxis.get_offset_text()
        if offset.get_visible() and offset.get_text():
            assert not offset.get_window_extent(renderer).overlaps(ax.title.get_window_extent(renderer)), title
    assert not axes["a/offset"].yaxis.get_offset_text().get_text()  # no '+1.0003' offset: full tick labels
    assert "1e" in axes["a/tiny"].get_ylabel() or "10^{" in axes["a/tiny"].get_ylabel()


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
    # every eval sample's score, prompt-major, NaN kept as null
    every = torch.tensor([0.1, 0.2, float("nan"), 0.4])
    path = save_eval_grid(video, tmp_path / "e.png", ["a", "b"], {"s": every[::2]}, 0, all_scores={"s": every},
                          samples_per_prompt=2)
    k, scores = read_eval_scores(path)
    assert k == 2 and scores["s"][:2] == pytest.approx([0.1, 0.2]) and math.isnan(scores["s"][2])
    with pytest.raises(ValueError, match="all_scores need 2 x 3 entries"):
        save_eval_grid(video, tmp_path / "e.png", ["a", "b"], {}, 0, all_scores={"s": every}, samples_per_prompt=3)
    assert read_eval_scores(tmp_path / "v.png") is None


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
    # the sidecar keeps every eval sample's score (3 prompts x 2): their mean is eval.jsonl's value
    from flowforge.report.verdict import eval_points

    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    points = eval_points([(s, sample_grid_path(run, s)) for s in (0, 2)], "eval/digit")
    for record in evals:
        point = points[record["step"]]
        assert point.samples_per_prompt == 2 and len(point.prompt_means) == 3
        assert point.mean == pytest.approx(record["eval/digit"], rel=1e-6)
        # and each prompt's diversity (the diversity curve's SE bars): their mean is eval.jsonl's eval/diversity
        per_prompt = read_eval_diversity(sample_grid_path(run, record["step"]))
        assert len(per_prompt) == 3 and statistics.fmean(per_prompt) == pytest.approx(record["eval/diversity"])
    assert "held-out eval/digit_eval" in "".join(parse((run / "report.html").read_text().split("</section>")[0]).text)


def _eval_records(n):
    from flowforge.data.prompts import load_prompts

    return [{"prompt": r.prompt} for r in load_prompts("demo:eval")[:n]]
