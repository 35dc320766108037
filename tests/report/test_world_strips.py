"""Issue 22: the report's world-model eval strips show, frame by frame, the generated frame, the action commanded at
that frame and the real frame of the recorded clip -- read back from report.html of a real demo:world eval."""

from __future__ import annotations

import base64
import io
import pathlib
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from flowforge.config import load_config
from flowforge.report.grids import read_grid_cells
from flowforge.report.run import write_report
from flowforge.report.world_strips import ACTION_GLYPHS, write_real_strips
from flowforge.rewards.scorers.world_eval import load_real_clip
from flowforge.runtime.run_dir import sample_grid_path
from flowforge.train.trainer import Trainer
from tests.report.test_run import parse

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "worldmodel" / "nft.yaml"


def _pixels(src: str) -> np.ndarray:
    """The grey pixels ``[H, W]`` uint8 of an embedded PNG data URI."""
    with Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))) as image:
        return np.asarray(image.convert("L"))


def _shrink(pixels: np.ndarray, size: int) -> np.ndarray:
    """A square picture enlarged by a whole factor (nearest neighbour) back to ``size x size``."""
    factor = pixels.shape[1] // size
    assert pixels.shape == (size * factor, size * factor)
    return pixels[factor // 2::factor, factor // 2::factor]


@pytest.fixture(scope="module")
def world_eval(tmp_path_factory, encode_cache_dir):
    """A demo:world eval of the example's first 3 held-out clips (4 sampler steps: fast, the strips do not care)
    and the report written from it."""
    tmp = tmp_path_factory.mktemp("world_strip")
    cfg = load_config(EXAMPLE, [f"run.output_dir={tmp}", "run.name=strip", f"data.cache_dir={encode_cache_dir}",
                                "sampler.num_steps=4", "sampler.num_sde_steps=2", "eval.max_prompts=3",
                                "eval.samples_per_prompt=1", "eval.scorers=[world_psnr]",
                                # no anchor: it would record 64 Atari episodes (13 s) that an eval never reads
                                "anchor.fm_weight=0", "anchor.trans_weight=0"])
    trainer = Trainer(cfg, progress=False)
    trainer.evaluate(0)
    rows = [r.metadata for r in trainer.eval_prompts]
    run_dir = trainer.run_dir
    trainer.close()
    return run_dir, rows, write_report(run_dir).read_text()


def test_strip_labels_every_frame_with_its_commanded_action_beside_the_real_frame(world_eval):
    run_dir, rows, page = world_eval
    body = page.split('id="first-last"')[1].split('id="evaluation"')[0]
    strips = body.split('<div class="strip">')[1:]
    assert len(strips) == len(rows) == 3
    grid = np.asarray(Image.open(sample_grid_path(run_dir, 0)).convert("L"))
    cells = read_grid_cells(sample_grid_path(run_dir, 0))
    for strip, meta, cell in zip(strips, rows, cells):
        actions = [str(a).upper() for a in meta["actions"]]
        assert len(actions) == 8
        units = strip.split('<div class="frame" ')[1:]
        doc = [parse('<div class="frame" ' + u) for u in units]
        # one column per frame, in order, each labelled with the action the eval row commanded at that frame
        assert [u.split('data-action="')[1].split('"')[0] for u in units] == actions
        assert [int(u.split('data-frame="')[1].split('"')[0]) for u in units] == list(range(8))
        real = load_real_clip(meta, 8)
        for f, (unit, d) in enumerate(zip(units, doc)):
            label = unit.split('<div class="act">')[1].split("</div>")[0]
            assert label == f'<span class="arrow">{ACTION_GLYPHS[actions[f]]}</span> {actions[f]}'
            generated, recorded = d.imgs  # the generated frame above its action, the real frame below it
            assert generated["alt"] == f"step 0: frame {f} generated, commanded {actions[f]}"
            assert recorded["alt"] == f"step 0: frame {f} real, recorded {actions[f]}"
            left, top, right, bottom = cell["frames"][f]["box"]
            gen = _pixels(generated["src"])
            assert np.array_equal(_shrink(gen, right - left), grid[top:bottom, left:right])  # frame f of this clip
            want = (real[f] * 255).round().to(torch.uint8).numpy()
            assert np.array_equal(_shrink(_pixels(recorded["src"]), 64)[::2, ::2], want)  # the recorded frame f
            assert gen.shape[1] >= 128  # enlarged: the paddle is visible
    # frame 0 is the given real first frame: generated and real are the same picture
    assert 'frame 0 (given)' in strips[0]


def test_a_missing_real_strip_leaves_the_labels_and_says_so(world_eval, tmp_path):
    source, rows, _ = world_eval
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)  # the module's run stays whole for the other test
    cells = read_grid_cells(sample_grid_path(run_dir, 0))
    (run_dir / "samples" / cells[1]["real"]["image"]).unlink()
    body = write_report(run_dir).read_text().split('id="first-last"')[1].split('id="evaluation"')[0]
    strips = body.split('<div class="cell video">')[1:]
    assert "real, recorded" in strips[0] and "real, recorded" not in strips[1]
    assert "(no real clip in this eval row)" in strips[1]
    assert [u.split('"')[0] for u in strips[1].split('data-action="')[1:]] == [str(a).upper()
                                                                               for a in rows[1]["actions"]]
    with pytest.raises(ValueError, match="real clip must be"):
        write_real_strips(tmp_path / "step_000001.png", [torch.rand(8, 32)])
