"""flowforge compare: arms trained one after another on one budget, then a PNG + CSV + markdown table."""

import csv

import pytest

from flowforge.cli import main
from flowforge.tools.compare import load_compare, summarize
from flowforge.config import ConfigError


def test_compare_two_arms_end_to_end(tiny_model_dir, tmp_path, encode_cache_dir):
    common = [f"model.path={tiny_model_dir}", f"data.cache_dir={encode_cache_dir}", "data.prompts_per_step=2",
              "data.group_size=4", "sampler.num_steps=4", "sampler.num_sde_steps=2", "train.micro_batch_size=2",
              "eval.every=1", "eval.max_prompts=2", "run.num_threads=1"]
    (tmp_path / "base.yaml").write_text("eval:\n  scorers: [digit_eval]\n")
    (tmp_path / "cmp.yaml").write_text(
        f"base: base.yaml\noutput_dir: {tmp_path / 'out'}\nbudget_samples: 16\n"
        "target: {metric: eval/digit_eval, value: 0.0}\nseeds: [0]\n"
        "arms:\n  grpo: []\n  nft: [train.algorithm=nft]\n")
    assert main(["compare", str(tmp_path / "cmp.yaml"), *common, "--no-progress"]) == 0
    out = tmp_path / "out"
    assert (out / "compare.png").stat().st_size > 10_000
    rows = list(csv.DictReader(open(out / "compare.csv")))
    assert [r["run"] for r in rows] == ["grpo-s0", "nft-s0"]
    assert all(r["samples"] == "16" for r in rows)  # budget 16 = 2 steps x 2 prompts x 4 candidates
    assert all(r["samples_to_target"] == "0" for r in rows)  # target 0 is met by the base eval
    assert "| grpo-s0 |" in (out / "compare.md").read_text()
    s = summarize(out / "nft-s0", "eval/digit_eval", 2.0)
    assert s["samples_to_target"] is None and [c[0] for c in s["curve"]] == [0, 8, 16]
    assert s["curve"][1][1] > 0  # wall time accumulates the logged stage times


def test_compare_file_problems_reported_together(tmp_path):
    (tmp_path / "cmp.yaml").write_text("base: missing.yaml\nbudget: 3\narms: {}\n")
    with pytest.raises(ConfigError) as err:
        load_compare(tmp_path / "cmp.yaml")
    text = str(err.value)
    assert "unknown key 'budget'" in text and "base:" in text and "arms:" in text and "budget_samples" in text
