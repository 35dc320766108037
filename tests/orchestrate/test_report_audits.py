"""The pipeline report says what each audit record says: passed, failed, or pending (never a pending one as failed),
with the pairs it compared and its values without the tie margin (issue 39)."""

from __future__ import annotations

import json
from pathlib import Path

from flowforge.orchestrate.config import load_pipeline
from flowforge.orchestrate.report import write_pipeline_report
from flowforge.orchestrate.stages import Outcome, open_ledger
from tests.orchestrate.support import read_report

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "stages" / "digits.yaml"


def _record(step, verdict, **extra):
    return {"step": step, "policy_version": step, "groups": 4, "spearman": 0.61, "pairwise_accuracy": 0.75,
            "mae": 0.1, "spearman_raw": 0.58, "pairwise_accuracy_raw": 0.73, "pairs_compared": 100,
            "pairs_tied": 12, "pooled_groups": 4, "verdict": verdict,
            "passed": None if verdict == "pending" else verdict == "passed", "pending": verdict == "pending",
            "unaudited": False, "reasons": [], "scores": [], **extra}


def test_a_pending_audit_is_reported_pending_never_failed(tmp_path):
    pcfg = load_pipeline(EXAMPLE, [f"run.output_dir={tmp_path}"])
    ledger = open_ledger(pcfg)
    run_dir = tmp_path / "digits-stages" / "C"
    run_dir.mkdir(parents=True)
    records = [_record(24, "pending"), _record(25, "passed", pooled_groups=8, pairs_compared=200),
               _record(28, "pending", unaudited=True, pooled_groups=0)]
    (run_dir / "audit.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = write_pipeline_report(pcfg, ledger, Outcome("partial", "ran stage C only"))
    _, text = read_report(tmp_path / "digits-stages")
    assert "failed" not in text, text
    assert [p["verdict"] for p in summary["agreement"]] == ["pending", "passed", "pending"]
    assert ("teacher-student agreement, latest (audit at C step 28): Spearman 0.61, pairwise accuracy 0.75 on 4 "
            "groups (pending: the teacher could not order the audited groups)") in text
    assert "pending: 4 groups gathered, no verdict yet" in text and "100 (12)" in text and "0.58 / 0.73" in text


def test_a_closing_verdict_is_named_with_its_size(tmp_path):
    pcfg = load_pipeline(EXAMPLE, [f"run.output_dir={tmp_path}"])
    ledger = open_ledger(pcfg)
    run_dir = tmp_path / "digits-stages" / "C"
    run_dir.mkdir(parents=True)
    records = [_record(28, "pending"), _record(29, "passed", pooled_groups=6, closing=True)]
    (run_dir / "audit.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = write_pipeline_report(pcfg, ledger, Outcome("done"))
    _, text = read_report(tmp_path / "digits-stages")
    assert [(p["verdict"], p["closing"]) for p in summary["agreement"]] == [("pending", False), ("passed", True)]
    assert "passed (closing verdict, 6 groups)" in text


def test_the_report_prints_the_baselines_and_eval_judges_beside_the_gate(tmp_path):
    pcfg = load_pipeline(EXAMPLE, [f"run.output_dir={tmp_path}"])
    ledger = open_ledger(pcfg)
    attempt = tmp_path / "digits-stages" / "B" / "attempt_0"
    attempt.mkdir(parents=True)
    gate = {"attempt": 0, "passed": True, "reasons": [], "groups": 96, "budget_a": 96,
            "held_out": {"spearman": 0.61, "pairwise_accuracy": 0.75, "mae": 0.1, "groups": 12},
            "baselines": {"init": {"spearman": 0.15}, "constant": {"spearman": 0.0}},
            "eval_judges": {"digit_eval": {"spearman": 0.42}, "broken": {"error": "KeyError: 'x'"}}}
    (attempt / "gate.json").write_text(json.dumps(gate))
    write_pipeline_report(pcfg, ledger, Outcome("partial", "ran stage B only"))
    _, text = read_report(tmp_path / "digits-stages")
    assert ("on 12 test groups · baselines: init 0.15, constant 0 · eval judges (for reference): digit_eval 0.42, "
            "broken not scored") in text
