"""flowforge compare: arms x seeds trained one after another on one budget, samples to each target with the spread
across seeds, a PNG (samples first, wall time second) + CSV + markdown table."""

import csv
import math

import pytest

from flowforge.cli import main
from flowforge.config import ConfigError
from flowforge.tools.compare import aggregate, arm_table, load_compare, summarize


@pytest.mark.slow  # end-to-end runs (minutes of CPU together): CI runs them in the slow set
def test_compare_two_arms_two_seeds_end_to_end(tiny_model_dir, tmp_path, encode_cache_dir):
    common = [f"model.path={tiny_model_dir}", f"data.cache_dir={encode_cache_dir}", "data.prompts_per_step=2",
              "data.group_size=4", "sampler.num_steps=4", "sampler.num_sde_steps=2", "train.micro_batch_size=2",
              "eval.every=1", "eval.max_prompts=2", "run.num_threads=1"]
    (tmp_path / "base.yaml").write_text("eval:\n  scorers: [digit_eval]\n")
    (tmp_path / "cmp.yaml").write_text(
        f"base: base.yaml\noutput_dir: {tmp_path / 'out'}\nbudget_samples: 16\n"
        "target: {metric: eval/digit_eval, values: [0.0, 2.0]}\nseeds: [0, 1]\n"
        "arms:\n  grpo: []\n  nft: [train.algorithm=nft, forward.sigma_mode=full_schedule]\n")
    assert main(["compare", str(tmp_path / "cmp.yaml"), *common, "--no-progress"]) == 0
    out = tmp_path / "out"
    assert (out / "compare.png").stat().st_size > 10_000
    rows = list(csv.DictReader(open(out / "compare.csv")))
    assert [(r["run"], r["arm"], r["seed"]) for r in rows] == [
        ("grpo-s0", "grpo", "0"), ("grpo-s1", "grpo", "1"), ("nft-s0", "nft", "0"), ("nft-s1", "nft", "1")]
    assert all(r["samples"] == "16" for r in rows)  # budget 16 = 2 steps x 2 prompts x 4 candidates
    assert all(r["samples_to_0"] == "0" and r["samples_to_2"] == "" for r in rows)  # 0 met by the base; 2 never
    md = (out / "compare.md").read_text()
    assert "| grpo | 2 | 0 (0-0), 2/2 | not reached | - | - | 0 ± 0 (n=2) | baseline |" in md  # no ratio to 0
    assert "| nft-s1 | nft |" in md
    s = summarize(out / "nft-s0", "eval/digit_eval", (2.0,))
    assert s["samples_to"] == {2.0: None} and [c[0] for c in s["curve"]] == [0, 8, 16] and s["arm"] == "nft"
    assert s["curve"][1][1] > 0  # wall time accumulates the logged stage times


def _run(arm, seed, hits):
    return {"run": f"{arm}-s{seed}", "arm": arm, "final_metric": 0.9, "samples_to": hits,
            "seconds_to": {v: None if h is None else h / 10 for v, h in hits.items()}}


def test_aggregate_median_range_and_ratio_across_seeds():
    runs = [_run("grpo", 0, {0.8: 1280, 0.9: 4480}), _run("grpo", 1, {0.8: 960, 0.9: None}),
            _run("nft", 0, {0.8: 800, 0.9: 1760}), _run("nft", 1, {0.8: 640, 0.9: 1920})]
    arms = aggregate(runs, (0.8, 0.9))
    g, n = arms["grpo"]["targets"], arms["nft"]["targets"]
    assert (g[0.8]["median"], g[0.8]["min"], g[0.8]["max"], g[0.8]["n_reached"]) == (1120, 960, 1280, 2)
    assert (g[0.9]["median"], g[0.9]["n_reached"]) == (4480, 1) and g[0.9]["ratio"] == 1.0
    assert n[0.8]["median"] == 720 and n[0.8]["ratio"] == pytest.approx(720 / 1120)
    assert n[0.9]["ratio"] == pytest.approx(1840 / 4480) and n[0.9]["median_seconds"] == pytest.approx(184.0)
    assert arms["nft"]["final_se"] == 0.0 and not math.isnan(arms["nft"]["final_mean"])


def _final(arm, seed, metric):
    return {**_run(arm, seed, {0.8: 100}), "final_metric": metric}


def test_final_metric_standard_errors_and_the_difference_to_the_first_arm():
    """Issue 43 item 8: SE of the mean over seeds; each arm against the first by Welch's SE; one seed says so."""
    runs = [_final("grpo", 0, 0.80), _final("grpo", 1, 0.82), _final("grpo", 2, 0.84),
            _final("nft", 0, 0.90), _final("nft", 1, 0.91), _final("nft", 2, 0.92),
            _final("awm", 0, 0.81), _final("awm", 1, 0.85),
            _final("dpo", 0, 0.95)]
    arms = aggregate(runs, (0.8,))
    se_grpo, se_nft = 0.02 / math.sqrt(3), 0.01 / math.sqrt(3)  # sample stdev 0.02 / 0.01 over 3 seeds
    assert arms["grpo"]["final_se"] == pytest.approx(se_grpo) and arms["grpo"]["vs_first"] is None
    nft = arms["nft"]["vs_first"]
    assert nft["diff"] == pytest.approx(0.09) and nft["se"] == pytest.approx(math.hypot(se_grpo, se_nft))
    assert nft["significant"] is True  # 0.09 > 2 * 0.0129
    awm = arms["awm"]["vs_first"]  # 0.83 vs 0.82, SE sqrt(0.02^2 + 0.0115^2) = 0.023
    assert awm["diff"] == pytest.approx(0.01) and awm["significant"] is False
    assert arms["dpo"]["final_se"] is None and arms["dpo"]["vs_first"]["se"] is None
    table = "\n".join(arm_table(arms, "eval/x", (0.8,)))
    assert "| final metric | vs grpo |" in table and "Welch" in table
    assert "| 0.82 ± 0.012 (n=3) | baseline |" in table
    assert "| 0.91 ± 0.0058 (n=3) | +0.09 ± 0.013 (> 2 SE) |" in table
    assert "| 0.83 ± 0.02 (n=2) | +0.01 ± 0.023 (< 2 SE, not significant) |" in table
    assert "| 0.95 (n=1, no SE) | +0.13 (no SE: needs 2+ seeds per arm) |" in table
    assert "± 0 " not in table


def test_one_seed_per_arm_prints_no_se():
    arms = aggregate([_final("grpo", 0, 0.8), _final("nft", 0, 0.9)], (0.8,))
    rows = arm_table(arms, "eval/x", (0.8,))[-2:]
    assert "| 0.8 (n=1, no SE) | baseline |" in rows[0] and "±" not in rows[0]
    assert "| 0.9 (n=1, no SE) | +0.1 (no SE: needs 2+ seeds per arm) |" in rows[1]


def test_compare_file_problems_reported_together(tmp_path):
    (tmp_path / "cmp.yaml").write_text("base: missing.yaml\nbudget: 3\narms: {}\ntarget: {values: [x]}\n"
                                       "seeds: [0, 0]\n")
    with pytest.raises(ConfigError) as err:
        load_compare(tmp_path / "cmp.yaml")
    text = str(err.value)
    assert "unknown key 'budget'" in text and "base:" in text and "arms:" in text and "budget_samples" in text
    assert "target.values: expected a non-empty list of numbers" in text and "distinct ints" in text
    (tmp_path / "base.yaml").write_text("")
    (tmp_path / "one.yaml").write_text("base: base.yaml\nbudget_samples: 8\narms: {a: []}\n"
                                       "target: {metric: eval/x, value: 0.7}\n")
    assert load_compare(tmp_path / "one.yaml").target_values == (0.7,)


def test_a_float32_mean_exactly_at_the_target_counts_as_reached(tmp_path):
    """216 of 240 correct is logged as the float32 mean 0.8999999761581421: that reaches 0.9; one fewer does not."""
    import json

    import torch

    from flowforge.config import dump_config, load_config

    run = tmp_path / "grpo-s0"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(load_config(None, [])))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "time/optimize": 1.0}) + "\n" for s in (1, 2)))
    at = float(torch.cat([torch.ones(216), torch.zeros(24)]).mean())
    below = float(torch.cat([torch.ones(215), torch.zeros(25)]).mean())
    assert at < 0.9
    (run / "eval.jsonl").write_text(json.dumps({"step": 1, "eval/digit_eval": below}) + "\n"
                                    + json.dumps({"step": 2, "eval/digit_eval": at}) + "\n")
    out = summarize(run, "eval/digit_eval", (0.9,))
    per_step = load_config(None, []).data.prompts_per_step * load_config(None, []).data.group_size
    assert out["samples_to"][0.9] == 2 * per_step


def test_best_in_budget_leaves_the_base_out_and_diversity_is_read_from_the_evaluations(tmp_path):
    """The step-0 evaluation is the base's score, not an algorithm's best; diversity at the end over the first
    evaluation's; the logged reward_wait (a part of time/reward) is not counted twice in the wall time."""
    import json

    from flowforge.config import dump_config, load_config

    run = tmp_path / "awm-s0"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(load_config(None, [])))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "time/reward": 2.0, "time/reward_wait": 1.5})
                                               + "\n" for s in (1, 2)))
    evals = [(0, 0.83, 0.25), (1, 0.80, 0.24), (2, 0.82, 0.20)]
    (run / "eval.jsonl").write_text("".join(json.dumps({"step": s, "eval/digit_eval": m, "eval/diversity": d})
                                            + "\n" for s, m, d in evals))
    out = summarize(run, "eval/digit_eval", (0.9,))
    assert out["best_metric"] == 0.82 and out["final_metric"] == 0.82  # not the base's 0.83
    assert (out["base_diversity"], out["final_diversity"]) == (0.25, 0.20)
    assert out["diversity_ratio"] == pytest.approx(0.8)
    assert [c[1] for c in out["curve"]] == [0.0, 2.0, 4.0]


def test_arms_must_share_the_model_prompts_and_evaluation():
    from flowforge.config import load_config
    from flowforge.tools.compare.run import comparability_problems

    same = {"grpo": load_config(None, []), "nft": load_config(None, ["train.algorithm=nft", "train.lr=3e-4"])}
    assert comparability_problems(same) == []
    other = {**same, "x": load_config(None, ["eval.samples_per_prompt=4", "model.height=64"])}
    problems = comparability_problems(other)
    assert len(problems) == 2 and problems[0].startswith("model.height differs between arms")
    assert "eval.samples_per_prompt differs" in problems[1]


def test_arms_with_their_own_configs_best_and_diversity_columns(tmp_path):
    """Issue 45's ranking table: an arm may name its own run config (a shipped recipe, run as shipped) and the table
    adds wall time to each target, the best evaluation in the budget and the diversity at the end (also as a ratio
    to the run's step-0 evaluation), each a mean over seeds with its SE."""
    (tmp_path / "a.yaml").write_text("train:\n  algorithm: nft\n")
    (tmp_path / "cmp.yaml").write_text("budget_samples: 64\narms:\n  nft: {config: a.yaml}\n"
                                       "  refl: {config: a.yaml, overrides: [train.lr=1e-3]}\n")
    cc = load_compare(tmp_path / "cmp.yaml")
    assert cc.config_of("nft") == tmp_path / "a.yaml" and cc.arms == {"nft": (), "refl": ("train.lr=1e-3",)}
    (tmp_path / "bad.yaml").write_text("budget_samples: 8\narms:\n  x: {config: nope.yaml}\n  y: {overrides: []}\n"
                                       "  z: []\n")
    with pytest.raises(ConfigError) as err:
        load_compare(tmp_path / "bad.yaml")
    text = str(err.value)
    assert "arms.x.config: no run config" in text and "arms.y: expected {config: FILE" in text
    assert "base: a run config file is required unless every arm names its config" in text  # z needs a base

    def run(arm, seed, final, best, div0, div):
        return {**_final(arm, seed, final), "algorithm": arm, "best_metric": best, "base_diversity": div0,
                "final_diversity": div, "diversity_ratio": div / div0}

    arms = aggregate([run("grpo", 1, 0.95, 0.96, 0.25, 0.225), run("grpo", 2, 0.93, 0.95, 0.25, 0.20),
                      run("nft", 1, 0.97, 0.97, 0.25, 0.25)], (0.8,))
    assert arms["grpo"]["best"] == pytest.approx((0.955, 0.005)) and arms["nft"]["best"] == (0.97, None)
    assert arms["grpo"]["diversity_ratio"][0] == pytest.approx(0.85)
    table = "\n".join(arm_table(arms, "eval/x", (0.8,)))
    assert "| wall s to 0.8 | best in budget | diversity at the end | diversity / step 0's | algorithm |" in table
    assert "| 10 | 0.955 ± 0.005 | 0.213 ± 0.012 | 0.85 ± 0.05 | grpo |" in table
    assert "| 10 | 0.970 | 0.250 | 1.00 | nft |" in table  # one seed: no SE
