"""``reward.overlap``: a tiny training run judged by ``vlm_judge`` against flowforge's judge server on loopback logs
the same metrics and evaluations and saves the same checkpoints with the groups scored during the rollout as after
it; ``perf/mfu`` and the reward-overlap metrics are logged every step and shown in the report; preflight refuses
overlap where it cannot work."""

import json

import pytest
import torch
from safetensors.torch import load_file

from flowforge.config import load_config
from flowforge.train.preflight import PreflightError, preflight
from flowforge.train.trainer import Trainer
from tests.rewards import loopback
from tests.train.test_trainer import tiny_cfg


def _run(cfg):
    run_dir = Trainer(cfg, progress=False).train()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    return run_dir, rows, evals


def _comparable(row):
    return {k: v for k, v in row.items() if not k.startswith(("time/", "perf/")) and not k.endswith(("_time",
                                                                                                    "_latency_s"))}


def _checkpoint(run_dir):
    newest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    return {f"{p.name}/{k}": v for p in sorted(newest.rglob("*.safetensors")) for k, v in load_file(p).items()}


@pytest.mark.slow  # a few short runs (10-15 s each on 2 cores): CI runs it in the slow set
@pytest.mark.parametrize("algorithm", ["grpo", "nft"])
def test_overlap_on_and_off_give_the_same_metrics_evals_and_checkpoints(tiny_model_dir, tmp_path, encode_cache_dir,
                                                                         monkeypatch, algorithm):
    monkeypatch.setenv(loopback.TOKEN_ENV, loopback.TOKEN)
    with loopback.judge_server() as (url, server):
        judge = (f"reward.options={{vlm_judge: {{model: loopback, base_url: '{url}', api_key_env: "
                 f"{loopback.TOKEN_ENV}, frames: 1, max_side: 16, max_concurrency: 4}}}}")
        runs = {}
        for overlap in (False, True):
            cfg = tiny_cfg(tiny_model_dir, tmp_path, encode_cache_dir, f"run.name={algorithm}-{overlap}",
                           f"train.algorithm={algorithm}", "reward.weights={vlm_judge: 1.0}",
                           "reward.required=[vlm_judge]", judge, "eval.scorers=[]", "eval.max_prompts=2",
                           "checkpoint.every=1", f"reward.overlap={str(overlap).lower()}")
            runs[overlap] = _run(cfg)
    (off_dir, off_rows, off_evals), (on_dir, on_rows, on_evals) = runs[False], runs[True]
    assert [_comparable(r) for r in on_rows] == [_comparable(r) for r in off_rows]
    assert on_evals == off_evals
    assert off_rows[0]["reward/vlm_judge_requests_sent"] == 2  # 2 groups per step, each judged once
    a, b = _checkpoint(off_dir), _checkpoint(on_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for row in on_rows + off_rows:
        assert row["perf/mfu"] > 0 and row["perf/tflops"] > 0 and row["perf/peak_tflops"] > 0
        assert row["time/reward_wait"] >= 0
    assert all(r["perf/reward_overlap"] == 0.0 for r in off_rows)
    assert all(0.0 <= r["perf/reward_overlap"] <= 1.0 for r in on_rows)
    report = (on_dir / "report.html").read_text()
    assert "perf/mfu" in report
    log = (on_dir / "train.log").read_text()
    assert "measured by a float32 matrix product at start-up, not a datasheet number" in log


def test_preflight_refuses_overlap_under_torchrun_and_with_rollout_workers(tiny_model_dir, tmp_path,
                                                                          encode_cache_dir):
    cfg = tiny_cfg(tiny_model_dir, tmp_path, encode_cache_dir, "reward.overlap=true")
    with pytest.raises(PreflightError, match="reward.overlap needs one process"):
        preflight(cfg, world_size=2, this_machine=False)
    workers = tiny_cfg(tiny_model_dir, tmp_path, encode_cache_dir, "reward.overlap=true", "rollout.engine=workers")
    with pytest.raises(PreflightError, match="reward.overlap needs rollout.engine='local'"):
        preflight(workers, this_machine=False)
    assert any("nothing overlaps" in w for w in preflight(cfg, this_machine=False).warnings)
    with pytest.raises(Exception, match=r"reward.options.digit.max_concurrency=0 must be an int >= 1"):
        load_config(None, ["reward.options={digit: {max_concurrency: 0}}"])
