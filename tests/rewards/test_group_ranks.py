"""Group scorers under torchrun (2 processes, gloo): every group is scored whole although the ranks' shares split
it, scores land on the rank and row of each candidate, and every rank reports the step's number of groups."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowforge.rewards import RewardProcessor
from flowforge.rewards.registry import build_scorer
from tests.rewards.group_worker import LAYOUTS, canonical_batch

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
SPEC = "tests.rewards.byo_scorers:PromptGroupRank"


def _torchrun(*args, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *map(str, args)]
    proc = subprocess.run(cmd, env=env, capture_output=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]


def test_group_scorer_sees_groups_split_across_ranks_whole(tmp_path):
    _torchrun(ROOT / "tests" / "rewards" / "group_worker.py", tmp_path / "rec")
    ranks = [torch.load(tmp_path / f"rec.rank{r}", weights_only=False) for r in range(2)]
    for name, (group_ids, _) in LAYOUTS.items():
        media, prompts, meta = canonical_batch(group_ids)
        gids = torch.tensor(group_ids)
        expected, _ = RewardProcessor({"rank": build_scorer("tests.rewards.byo_scorers:GroupRank")}, {"rank": 1.0})(
            media, prompts, meta, gids)
        calls = [c for r in ranks for c in r[name]["calls"]]
        assert sorted(map(sorted, calls)) == sorted(list(range(s)) for s in torch.bincount(gids).tolist())
        assert len(ranks[0][name]["calls"]) >= 1 and len(ranks[1][name]["calls"]) >= 1  # the work is shared
        for r in ranks:
            share = r[name]["share"]
            assert torch.equal(r[name]["components"]["rank"], expected["rank"][share]), name
            assert torch.equal(r[name]["components"]["brightness"], media[share].mean(dim=(1, 2, 3)))
            assert r[name]["groups_scored"] == 3.0
            firsts = sum(1 for i in share.tolist() if meta[i]["member"] == 0)
            assert r[name]["first_fraction"] == pytest.approx(firsts / len(share))
            assert torch.equal(r[name]["single"]["components"]["rank"], expected["rank"][share]), name
        # a single_client scorer (the vlm_judge: one writer of its ledger) is called on rank 0 only, every group
        # whole and once
        single = ranks[0][name]["single"]["calls"]
        assert ranks[1][name]["single"]["calls"] == [] and len(single) == 3
        assert [r[name]["raised"] for r in ranks] == ["BudgetExhausted: teacher budget spent"] * 2
        assert sorted(map(sorted, single)) == sorted(list(range(s)) for s in torch.bincount(gids).tolist())


@pytest.mark.slow  # a multi-process end-to-end run (tens of seconds): CI runs it after the default set
def test_training_under_torchrun_scores_whole_groups(tiny_model_dir, tmp_path, encode_cache_dir):
    # 3 prompts x 2 candidates on 2 ranks: each rank holds 3 candidates, so the middle group is split
    overrides = [f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path}", "run.name=g",
                 f"data.cache_dir={encode_cache_dir}", "data.prompts_per_step=3", "data.group_size=2",
                 "sampler.num_steps=4", "sampler.num_sde_steps=2", "train.micro_batch_size=1",
                 "train.num_updates_per_batch=1", "train.allow_unit_ratio=true", "train.steps=1",
                 "eval.every=0", "eval.max_prompts=1", "eval.samples_per_prompt=2", "eval.scorers=[]",
                 "run.num_threads=1", f"reward.weights={{'{SPEC}': 1.0}}",
                 f"reward.options={{'{SPEC}': {{group_size: 2}}}}"]
    _torchrun(ROOT / "tests" / "dist_worker.py", tmp_path / "rec", 0, *overrides)
    rows = [json.loads(line) for line in (tmp_path / "g" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0][f"reward/{SPEC}_groups_scored"] == 3.0
    assert rows[0][f"reward/{SPEC}_nan_fraction"] == 0.0
