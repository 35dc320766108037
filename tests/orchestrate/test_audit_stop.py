"""A random student swapped in mid-C is stopped by the audits (thresholds a random student passes with p < 0.01 at
the groups one verdict is taken on: one audited step's 4 groups of 8, or 8 audited groups when audits are pooled)
within two audits, at the last checkpoint an audit passed; the student it replaced passed every audit before the
swap. The power against a student at the gate's bar is not this test's subject (min_power 0: its small student sits
near such thresholds)."""

from __future__ import annotations

import json

import pytest
import torch

from flowforge.orchestrate.config import check_pipeline, load_pipeline
from flowforge.orchestrate.stages import run_pipeline
from flowforge.reward_model import scalar_head
from tests.orchestrate.support import write_pipeline

SWAP_AFTER = 3  # student calls (one per C step) before the random student takes over


AUDITS = {  # (audit section, C steps): one step's groups alone; pooled over the last 8 audited groups
    "per_step": ({"first_groups": 4, "every": 2, "pool_groups": 0, "min_spearman": 0.45,
                  "min_pairwise_accuracy": 0.67}, 6),
    "pooled": ({"first_groups": 4, "every": 2, "pool_groups": 8, "min_spearman": 0.35,
                "min_pairwise_accuracy": 0.63}, 8),  # C steps 4..11: audits 4 (pending), 6 | swap | 8 (pending), 10
}


@pytest.mark.parametrize("audit", sorted(AUDITS))
def test_a_random_student_swapped_in_mid_c_is_stopped_within_two_audits(tiny_model_dir, tmp_path,
                                                                        encode_cache_dir, monkeypatch, audit):
    section, c_steps = AUDITS[audit]
    path = write_pipeline(
        tmp_path / "p.yaml", tiny_model_dir, tmp_path / "runs", encode_cache_dir,
        data={"prompts_per_step": 4, "group_size": 8},
        train={"micro_batch_size": 8},
        stages={"n_a": 16, "c_steps": c_steps, "student_serving": "in_process"},
        # a teacher a small CNN can learn from 16 groups: the candidates' brightness
        teacher={"scorer": "tests.serve.judge_support:Brightness"},
        student={"epochs": 15, "lr": 3e-3, "split": [0.5, 0.25, 0.25]},
        audit={**section, "max_null_pass": 0.01, "min_power": 0.0},
        checkpoint={"keep": 2})  # fewer than C's checkpoints: the last good one is pinned against rotation
    pcfg = load_pipeline(path)
    check_pipeline(pcfg)  # the audit thresholds pass the null check at their group count
    real_call = scalar_head.ScalarHeadScorer.__call__
    calls = []
    generator = torch.Generator().manual_seed(0)

    def swapped(self, media, prompts, metadata):
        calls.append(len(prompts))
        if len(calls) <= SWAP_AFTER:
            return real_call(self, media, prompts, metadata)
        return torch.rand(len(prompts), generator=generator)  # a random student

    monkeypatch.setattr(scalar_head.ScalarHeadScorer, "__call__", swapped)
    outcome = run_pipeline(pcfg, progress=False)
    directory = tmp_path / "runs" / "p"
    audits = [json.loads(line) for line in (directory / "C" / "audit.jsonl").read_text().splitlines()]
    first_c = 4
    swap_step = first_c + SWAP_AFTER
    before = [a for a in audits if a["step"] < swap_step]
    after = [a for a in audits if a["step"] >= swap_step]
    # the trained student passed its audits (a pooled one pending until 8 groups were audited: no verdict yet)
    assert any(a["passed"] for a in before) and all(a["passed"] is not False for a in before), before
    assert [a["step"] for a in before if a["passed"] is None] == ([4] if section.get("pool_groups") else [])
    assert outcome.status == "audit_stopped", outcome
    assert 1 <= len(after) <= 2 and after[-1]["passed"] is False  # stopped within two audits of the swap
    last_passed = max(a["step"] for a in before if a["passed"])
    assert outcome.last_good.endswith(f"step_{last_passed:06d}") and "/C/" in outcome.last_good
    # the policy the pipeline hands on, evaluated as every stage's end is: the last good checkpoint's held-out eval
    good_run = directory / "last_good" / f"step_{last_passed:06d}" / "C"
    evaluated = [json.loads(line) for line in (good_run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evaluated] == [last_passed]
    summary = json.loads((directory / "summary.json").read_text())
    assert summary["C"]["last_good_eval"]["step"] == last_passed
    from flowforge.orchestrate.arms import arm_table

    student = arm_table(pcfg)["student"]
    assert (student["source"], student["step"]) == ("last_good", last_passed)
    assert student["metrics"] == {k: v for k, v in evaluated[0].items() if k.startswith("eval/")}
    again = run_pipeline(pcfg, progress=False)  # a rerun: the same stop, its evaluation read, not repeated
    assert (again.status, again.last_good) == (outcome.status, outcome.last_good)
    assert len((good_run / "eval.jsonl").read_text().splitlines()) == 1
