"""Issue 14: a world model's eval grid in the report -- each video as its frames side by side, with the action of
each frame written under that frame (the sidecar lists the frames' boxes and labels; report.html renders them) --
and sample commands that give the model its first frames."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from flowforge.config import dump_config, load_config
from flowforge.train.metrics import MetricsLogger
from flowforge.runtime.run_dir import sample_grid_path
from flowforge.report.run import write_report
from flowforge.report.grids import read_grid_cells, save_eval_grid
from tests.report.test_run import parse

ACTIONS = ["LEFT NOOP RIGHT RIGHT LEFT", "NOOP NOOP LEFT RIGHT NOOP"]


def _colours(image):
    """The set of RGB colours of ``image``."""
    return {tuple(int(c) for c in p) for p in np.asarray(image.convert("RGB")).reshape(-1, 3)}


def _video_run(tmp_path):
    run = tmp_path / "world"
    with MetricsLogger(run, tensorboard=False) as logger:
        logger.log(1, {"reward/action_following_mean": 0.5, "train/loss": 0.1})
        logger.log_eval(1, {"eval/action_following": 0.5})
    # frame f of video i is a flat grey of its own level, so every frame's crop is recognisable
    levels = torch.arange(10.0).view(2, 5) * 25 / 255  # 255 * level is a whole number: no rounding ties
    video = levels.view(2, 1, 5, 1, 1).expand(2, 3, 5, 4, 6).contiguous()
    save_eval_grid(video, sample_grid_path(run, 1), ACTIONS, {"action_following": torch.tensor([1.0, 0.0])}, 1,
                   [a.split() for a in ACTIONS])
    cfg = load_config(None, ["run.name=world", "model.adapter=world_model", "model.path=demo:world",
                             "model.task=i2v", "model.frames=5", "data.prompts=demo:world-train",
                             "data.eval_prompts=demo:world-eval"])
    (run / "config.yaml").write_text(dump_config(cfg))
    return run


def test_sidecar_lists_each_frame_with_its_action(tmp_path):
    run = _video_run(tmp_path)
    png = sample_grid_path(run, 1)
    cells = read_grid_cells(png)
    grid = Image.open(png)
    for i, cell in enumerate(cells):
        assert [f["label"] for f in cell["frames"]] == ACTIONS[i].split()
        lefts = [f["box"][0] for f in cell["frames"]]
        assert lefts == sorted(lefts) and cell["frames"][0]["box"][0] == cell["box"][0]
        assert cell["frames"][-1]["box"][2] == cell["box"][2]
        for f, frame in enumerate(cell["frames"]):
            assert _colours(grid.crop(tuple(frame["box"]))) == {(25 * (5 * i + f),) * 3}  # the box is exactly frame f of video i
    # a text-to-video prompt of one word per frame is not split into labels: only explicit labels are written
    save_eval_grid(torch.rand(1, 3, 5, 4, 4), tmp_path / "v.png", ["a cat sleeps on sofa"], {}, 0)
    assert "frames" not in read_grid_cells(tmp_path / "v.png")[0]
    data = json.loads((tmp_path / "v.json").read_text())
    data["cells"][0]["frames"] = [{"box": [0, 0], "label": 3}]  # malformed: dropped, the cell kept
    (tmp_path / "v.json").write_text(json.dumps(data))
    assert read_grid_cells(tmp_path / "v.png")[0]["prompt"] == "a cat sleeps on sofa"
    with pytest.raises(ValueError, match="frame_labels"):
        save_eval_grid(torch.rand(1, 3, 5, 4, 4), tmp_path / "w.png", ["LEFT"], {}, 0, [["LEFT"]])


def test_report_writes_each_action_under_its_frame(tmp_path):
    run = _video_run(tmp_path)
    page = write_report(run).read_text()
    body = page.split('id="first-last"')[1].split('id="training"')[0]
    doc = parse(body)
    frames = [img for img in doc.imgs if img["class"] == "frame"]
    assert [img["alt"] for img in frames] == [f"step 1: frame {f} generated, commanded {a}" for actions in ACTIONS
                                               for f, a in enumerate(actions.split())]
    # each frame's <img> is followed by its label, in frame order, inside the frame's own box
    strips = body.split('<div class="strip">')[1:]
    assert len(strips) == len(ACTIONS)
    for i, strip in enumerate(strips):
        units = strip.split('<div class="frame" ')[1:]
        assert len(units) == 5
        for f, unit in enumerate(units):
            label = unit.split('<div class="act">')[1].split("</div>")[0]
            arrow = {"LEFT": "\u2190", "RIGHT": "\u2192", "NOOP": "\u00b7"}[ACTIONS[i].split()[f]]
            assert label == f'<span class="arrow">{arrow}</span> {ACTIONS[i].split()[f]}'
            assert unit.startswith(f'data-frame="{f}" data-action="{ACTIONS[i].split()[f]}"')
            src = unit.split('src="')[1].split('"')[0]
            crop = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1])))
            assert _colours(crop) == {(25 * (5 * i + f),) * 3}
            # enlarged so that a paddle of one source pixel shows: nearest neighbour by a whole factor (the 6x4
            # frame is 12x8 in the grid at scale 2, x11 here: 132x88, every source pixel an 22x22 square)
            assert crop.size == (132, 88)
    assert "action_following 1" in body and "action_following 0" in body  # the scores stay under the strip
    # a world model samples from first frames: the summary's sample commands name the run's eval prompts
    text = "".join(parse(page).text)
    assert "flowforge sample exports/world --prompt-file demo:world-eval --out grid.png" in text
    assert "--prompt '" not in text
