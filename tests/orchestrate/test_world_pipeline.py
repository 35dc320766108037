"""``examples/stages/world.yaml`` end to end at a tiny size: the world model trained with the world judge as a real
teacher server (stage A), a clip student on its judged groups split by episode (B), and stage C on the served
student under the teacher's audits -- every teacher request billed once, none for evaluation, the gate record with
its baselines (the student before B, a constant, action_idm)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowforge.orchestrate.config import check_pipeline, load_pipeline
from flowforge.orchestrate.stages import run_pipeline
from flowforge.rewards.judge.ledger import RequestLedger
from flowforge.rewards.judge.protocol import billed_per_group, read_request_log

ROOT = Path(__file__).resolve().parents[2]
TINY = ["run.num_threads=1", "stages.n_a=16", "stages.c_steps=1", "sampler.num_steps=4", "eval.max_prompts=2",
        "eval.samples_per_prompt=1", "student.epochs=1",
        # the mechanics, not the result: thresholds any ranking meets, at the few test groups 16 conditions give
        "student.gate.min_groups=1", "student.gate.max_null_pass=1.0", "student.gate.min_spearman=-1.0",
        "student.gate.min_pairwise_accuracy=0.0", "student.gate.max_mae=1.0", "student.gate.fail_on_shortcuts=false",
        "audit.pool_groups=4", "audit.max_null_pass=1.0", "audit.min_spearman=-1.0",
        "audit.min_pairwise_accuracy=0.0", "audit.min_power=0"]


@pytest.mark.slow  # the world model's stages A and C plus two judge servers: minutes on one thread
def test_the_world_pipeline_runs_a_b_c_billing_each_teacher_request_once(tmp_path, monkeypatch, encode_cache_dir):
    pytest.importorskip("ale_py")
    monkeypatch.chdir(ROOT)  # the example's prompt, reference and template paths start at the repository root
    pcfg = load_pipeline(ROOT / "examples" / "stages" / "world.yaml",
                         [*TINY, f"run.output_dir={tmp_path}", f"data.cache_dir={encode_cache_dir}"])
    check_pipeline(pcfg)
    outcome = run_pipeline(pcfg, progress=False)
    assert outcome.status == "done", outcome.reason
    directory = tmp_path / pcfg.run.name

    records = read_request_log(directory / "teacher" / "requests.log")
    assert set(billed_per_group(records).values()) == {1}  # the teacher's own log: no group billed twice
    assert all(len(r["reference"]) == 1 and len(r["examples"]) == 3 for r in records)  # real future + examples
    audited = [json.loads(line) for line in (directory / "C" / "audit.jsonl").read_text().splitlines()]
    assert len(records) == 16 + sum(a["groups"] for a in audited)  # A's groups and the audits, nothing else
    book = RequestLedger(directory / "A" / "judge" / "ledger.sqlite")
    assert {e.slot.purpose for e in book.entries()} == {"train"}  # evaluation never asked the teacher

    gate = json.loads((directory / "B" / "attempt_0" / "gate.json").read_text())
    assert set(gate["baselines"]) == {"init", "constant", "action_idm"}
    if gate["split_sizes"]["test"]:
        assert gate["baselines"]["constant"]["spearman"] in (0.0, None) or gate["baselines"]["constant"]["groups"]
        # the independent eval judges beside the gate read each condition's real clip and actions: none failed
        assert set(gate["eval_judges"]) == set(pcfg.eval.scorers)
        assert all("error" not in v and v["groups"] >= 1 for v in gate["eval_judges"].values()), gate["eval_judges"]
