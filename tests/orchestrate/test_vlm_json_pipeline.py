"""A ``vlm_json`` student through the whole pipeline (issue 26): stage A judged by a real teacher server, stage B
trains a LoRA on a tiny random Qwen2-VL built from a config (the JSON tokenizer of
:func:`tests.reward_model.support.save_tiny_json_qwen2_vl`) and gates it, the pipeline serves the saved student with
a real ``flowforge serve judge --student`` on loopback (random free port), and stage C trains on the student's
answers, audited by the teacher. Nothing is stubbed: every judge call is HTTP to a server the pipeline started.

The gate is the mechanics gate of :mod:`tests.orchestrate.support` (``max_null_pass: 1``, the thresholds any ranking
passes): a tiny random VLM trained for seconds cannot rank digits like the teacher, and what this test proves is the
route -- the student's JSON answers are parsed by the judge's strict parser at the gate (failure rate 0) and in
stage C (no group dropped), and the server answers C with exactly what the reloaded student generates.
"""

from __future__ import annotations

import json
import math

import pytest

from flowforge.orchestrate.config import check_pipeline, load_pipeline
from flowforge.orchestrate.stages import newest_step, run_pipeline
from flowforge.rewards.judge.protocol import billed_per_group, read_request_log
from tests.orchestrate.support import write_pipeline
from tests.reward_model import support

VLM_STUDENT = {"kind": "vlm_json", "epochs": 20, "lr": 0.02, "batch_size": 2, "split": [0.7, 0.0, 0.3],
               "vlm_json": {"lora_rank": 8, "lora_alpha": 16.0, "lora_dropout": 0.0, "max_new_tokens": 48}}


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    return support.save_tiny_json_qwen2_vl(tmp_path_factory.mktemp("tiny-json-qwen2-vl"))


@pytest.mark.slow  # stages A and C on the tiny SD3 plus three server processes: over a minute on one thread
def test_vlm_json_student_trains_gates_serves_and_carries_stage_c(tiny_model_dir, tiny_vlm, tmp_path,
                                                                  encode_cache_dir):
    from flowforge.reward_model.data import read_judged_groups
    from flowforge.reward_model.students import load_student
    from flowforge.rewards.judge.ledger import RequestLedger

    student_cfg = {**VLM_STUDENT, "vlm_json": {**VLM_STUDENT["vlm_json"], "base": str(tiny_vlm)}}
    path = write_pipeline(tmp_path / "pipeline.yaml", tiny_model_dir, tmp_path / "runs", encode_cache_dir,
                          stages={"n_a": 8, "c_steps": 2, "student_serving": "server"},
                          teacher={"judge": {"frames": 1, "max_side": 16, "max_concurrency": 2, "timeout_s": 120.0}},
                          student=student_cfg)
    pcfg = load_pipeline(path)
    check_pipeline(pcfg)
    directory = tmp_path / "runs" / "p"

    outcome = run_pipeline(pcfg, progress=False)
    assert outcome.status == "done", outcome.reason

    # stage B: a vlm_json student on A's judged groups, its answers read by the strict parser on every test group
    gate = json.loads((directory / "B" / "attempt_0" / "gate.json").read_text())
    assert gate["passed"] and gate["groups"] == 8
    assert gate["split_sizes"]["test"] >= 1 and gate["test"]["failure_rate"] == 0.0
    assert all(math.isfinite(gate["test"][k]) for k in ("mae", "groups"))
    student_dir = directory / "B" / "attempt_0" / "student"
    assert gate["student"] == "B/attempt_0/student"  # relative to the pipeline directory (issue 42)
    meta = json.loads((student_dir / "meta.json").read_text())
    assert meta["kind"] == "vlm_json" and meta["base"] == str(tiny_vlm)
    assert meta["targets"] and all(t.startswith("model.language_model.") for t in meta["targets"])

    # stage C: every training group of its 2 steps was sent to the student's server, answered, and parsed
    m = pcfg.data.prompts_per_step
    assert newest_step(directory / "C") == 4 + 2
    rows = [json.loads(line) for line in (directory / "C" / "metrics.jsonl").read_text().splitlines()]
    c_rows = [r for r in rows if r.get("step", 0) >= 4]
    assert len(c_rows) == 2 and all(r.get("reward/judge_failed_groups", 0.0) == 0.0 for r in c_rows)
    assert all(math.isfinite(r["reward/vlm_judge/mean"]) for r in c_rows if "reward/vlm_judge/mean" in r)
    student_log = read_request_log(directory / "student" / "requests.log")
    assert len(student_log) >= 2 * m and set(billed_per_group(student_log).values()) == {1}
    book = RequestLedger(directory / "C" / "judge" / "ledger.sqlite")
    entries = [e for e in book.entries() if e.slot.purpose == "train"]
    assert len(entries) == 2 * m and {e.status for e in entries} == {"ok"}

    # the server answered with the reloaded student's own greedy answer to the same message (the stored frames)
    student = load_student(student_dir)
    train_keys = {e.key for e in entries}  # C's evaluation asked the student too (purpose "eval")
    groups = [g for g in read_judged_groups(directory / "C" / "judge" / "ledger.sqlite") if g.key in train_keys]
    assert len(groups) == 2 * m
    assert {e.slot.purpose for e in book.entries()} <= {"train", "eval"}
    for group, predicted in zip(groups[:2], student.predict(groups[:2]), strict=True):
        assert predicted.tolist() == pytest.approx(list(group.scores), abs=1e-6)

    # audits: the teacher re-judged C's first groups; the student's reward never asked the teacher
    audits = [json.loads(line) for line in (directory / "C" / "audit.jsonl").read_text().splitlines()]
    assert audits and audits[0]["passed"]
    teacher_log = read_request_log(directory / "teacher" / "requests.log")
    assert len(teacher_log) == 8 + pcfg.audit.first_groups
    summary = json.loads((directory / "summary.json").read_text())
    assert summary["status"] == "done"

