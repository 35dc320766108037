"""Issue 43 item 8: the held-out diversity curve carries ± 1 SE bars over prompts (from each eval's per-prompt
diversities in the grid sidecar) and its y axis starts at 0, so a 9 % drop looks like 9 %, not like a collapse."""

import math
import statistics

import pytest
import torch
from matplotlib.container import ErrorbarContainer

from flowforge.config import dump_config, load_config
from flowforge.report import verdict
from flowforge.report.grids import read_eval_diversity, save_eval_grid
from flowforge.report.plots import plot_eval_curves
from flowforge.report.run import write_report
from flowforge.runtime.run_dir import sample_grid_path
from flowforge.train.metrics import MetricsLogger, group_diversities, within_group_diversity, write_provenance

PROMPTS = ["a handwritten seven", "the number 3", "a neat two"]
# per-prompt diversities of the two evals: mean 0.22 -> 0.20 (a 9 % drop)
PER_PROMPT = {0: [0.20, 0.22, 0.24], 4: [0.17, 0.20, 0.23]}


def test_group_diversities_average_to_the_pooled_diversity():
    images = torch.rand(6, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([2, 2, 0, 0, 1, 1])
    per_group = group_diversities(images, ids)
    assert per_group.shape == (3,) and per_group.dtype == torch.float32
    assert per_group[0] == within_group_diversity(images[:2], ids[:2])  # first-seen order: group 2 first
    assert per_group.mean() == pytest.approx(float(within_group_diversity(images, ids)), rel=1e-6)
    assert math.isnan(float(group_diversities(images[:3], torch.tensor([0, 0, 1]))[1]))  # a group of one


@pytest.fixture
def run(tmp_path):
    run = tmp_path / "digits-d"
    cfg = load_config(None, ["run.name=digits-d", "train.steps=4", "eval.scorers=[digit_eval]",
                             "eval.samples_per_prompt=2"])
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(cfg))
    with MetricsLogger(run, tensorboard=False) as logger:
        for step in range(1, 5):
            logger.log(step, {"reward/total_mean": 0.5, "train/loss": 0.1, "time/sample": 1.0})
        for step, per_prompt in PER_PROMPT.items():
            logger.log_eval(step, {"eval/digit_eval": 0.8, "eval/diversity": statistics.fmean(per_prompt)})
            scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
            save_eval_grid(torch.rand(3, 3, 8, 8), sample_grid_path(run, step), PROMPTS, {"digit_eval": scores[::2]},
                           step, all_scores={"digit_eval": scores}, samples_per_prompt=2,
                           diversity=torch.tensor(per_prompt))
    write_provenance(run)
    return run


def test_the_report_draws_diversity_with_se_bars_from_zero(run, monkeypatch, tmp_path):
    figures = []

    def keep(*args, **kwargs):
        figures.append(plot_eval_curves(*args, **kwargs))
        return figures[-1]

    monkeypatch.setattr(verdict, "plot_eval_curves", keep)
    write_report(run)
    (fig,) = figures
    headline, diversity = fig.axes[:2]
    assert diversity.get_title() == "eval/diversity" and headline.get_title() == "eval/digit_eval"
    assert diversity.get_ylim()[0] == 0.0  # from 0: 0.22 -> 0.20 is a small step on the panel
    assert headline.get_ylim()[0] != 0.0  # other metrics keep their automatic range
    (bars,) = [c for c in diversity.containers if isinstance(c, ErrorbarContainer)]
    (segments,) = bars.lines[2]
    half_widths = [(seg[1][1] - seg[0][1]) / 2 for seg in segments.get_segments()]
    expected = [statistics.stdev(PER_PROMPT[s]) / math.sqrt(3) for s in (0, 4)]  # SE over the 3 prompts
    assert half_widths == pytest.approx(expected)
    assert read_eval_diversity(sample_grid_path(run, 4)) == pytest.approx(PER_PROMPT[4])
    fig.savefig(tmp_path / "curves.png")  # rendered: looked at once by eye when this test was written


def test_without_per_prompt_diversities_no_bars_but_the_axis_still_from_zero():
    fig = plot_eval_curves([("eval/diversity", [0, 4], [0.22, 0.20], {}, None)], from_zero=("eval/diversity",))
    (ax,) = fig.axes[:1]
    assert ax.get_ylim()[0] == 0.0 and not [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
