"""The stage trainer's audit schedule and audit file (the audits themselves run in test_stages.py)."""

from __future__ import annotations

import json

from flowforge.orchestrate.config import AuditConfig
from flowforge.orchestrate.stage_trainer import AUDIT_FILE, Auditor, read_audits


def test_audits_cover_the_first_groups_then_every_kth_step(tmp_path):
    auditor = Auditor(None, AuditConfig(first_groups=10, every=5), first_step=23, prompts_per_step=4,
                      run_dir=tmp_path)
    assert [s for s in range(23, 45) if auditor.due(s)] == [23, 24, 25, 30, 35, 40]  # 3 steps cover 10 groups
    only_first = Auditor(None, AuditConfig(first_groups=4, every=0), first_step=0, prompts_per_step=4,
                         run_dir=tmp_path)
    assert [s for s in range(0, 20) if only_first.due(s)] == [0]
    none = Auditor(None, AuditConfig(first_groups=0, every=0), first_step=0, prompts_per_step=4, run_dir=tmp_path)
    assert not any(none.due(s) for s in range(20))


def test_a_step_audited_again_after_a_resume_keeps_its_first_record(tmp_path):
    lines = [{"step": 5, "passed": True, "spearman": 0.5}, {"step": 3, "passed": True, "spearman": 0.1},
             {"step": 5, "passed": True, "spearman": 0.9}]
    (tmp_path / AUDIT_FILE).write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 7, "pas')
    assert [(a["step"], a["spearman"]) for a in read_audits(tmp_path)] == [(3, 0.1), (5, 0.5)]
    assert read_audits(tmp_path / "missing") == []
