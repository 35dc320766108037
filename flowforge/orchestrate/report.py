"""The pipeline report: ``<pipeline>/summary.json`` and ``<pipeline>/report.html``, linking the three stages.

What it counts (every number read from the pipeline's own files):

================================  ====================================================================================
``teacher.train_groups``          answered teacher requests of stage A for conditions of the pass (A's request
                                  ledger rows whose ``sample_ids`` are conditions)
``teacher.eval_groups``           answered teacher requests of A's held-out evaluations (the other rows)
``teacher.audit_groups``          answered teacher requests of stage C's audits (``C/audit/judge/ledger.sqlite``)
``teacher.http_requests``         billed HTTP attempts in the teacher's ledgers (first sends, retries after timeouts,
                                  repairs of malformed replies; attempts lost in a crash included)
``teacher.failed_groups``         requests that ended without scores (malformed, failed, lost): dropped groups
``teacher.server_log``            the auto-started teacher's own request log: ``requests`` received, ``groups``,
                                  ``max_per_group`` (billed attempts of the most-billed group: 1 without timeouts,
                                  repairs or retries) and ``duplicates`` (requests received twice with the same
                                  body); absent with ``teacher.url``
``savings.c_groups``              groups stage C trained on with the student's reward (its ``trained_on``
                                  conditions)
``savings.teacher_requests_saved``  ``c_groups - audit_groups``: what running A for C's steps would have cost in
                                  teacher requests, minus what the audits spent
================================  ====================================================================================
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from flowforge.orchestrate.config import pipeline_dir
from flowforge.orchestrate.ledger import ConditionLedger
from flowforge.runtime.durable import write_bytes

SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.html"
DIAGRAM = """\
 conditions.jsonl: one seeded pass over data.prompts, no epoch
 [ A: budget_A ............ | C: the rest ............................ ]
      |                        |
  A  RL + teacher judge     C  RL + student reward  --audits-->  teacher
      | request ledger         |  (first n groups, then every k steps;
      v                        |   below threshold: stop at last good ckpt)
  B  student on A's groups --gate--> pass: C  |  fail: stop, or extend A by delta (up to cap)
"""


def _ledger_rows(path: Path, conditions: set[str]) -> dict[str, int]:
    """``{"train_groups", "eval_groups", "http_requests", "failed_groups"}`` of a judge request ledger (zeros when
    absent): answered requests by whether they judged a condition of the pass, billed attempts, requests without
    scores."""
    out = {"train_groups": 0, "eval_groups": 0, "http_requests": 0, "failed_groups": 0}
    if not path.is_file():
        return out
    from flowforge.rewards.judge.ledger import RequestLedger

    ledger = RequestLedger(path)
    try:
        for entry in ledger.entries():
            ids = {i for i in entry.request.get("sample_ids") or [] if i is not None}
            if entry.status in ("ok", "malformed"):
                out["train_groups" if ids & conditions else "eval_groups"] += 1
            out["failed_groups"] += int(entry.status != "ok")
        out["http_requests"] = ledger.billed()
    finally:
        ledger.close()
    return out


def _server_log(path: Path) -> dict[str, int] | None:
    from flowforge.rewards.judge.protocol import billed_per_group, read_request_log

    if not path.is_file():
        return None
    records = read_request_log(path)
    per_group = billed_per_group(records)
    keys = [r["key"] for r in records]
    return {"requests": len(records), "groups": len(per_group), "max_per_group": max(per_group.values(), default=0),
            "duplicates": len(keys) - len(set(keys))}


def last_eval(run_dir: Path) -> dict[str, float]:
    """The last held-out evaluation of a run directory (``eval.jsonl``), ``{}`` when there is none."""
    from flowforge.report.run import read_jsonl

    path = run_dir / "eval.jsonl"
    if not path.is_file():
        return {}
    rows, _ = read_jsonl(path)
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in rows[-1].items()} if rows else {}


def _attempts(directory: Path) -> list[dict[str, Any]]:
    paths = sorted((directory / "B").glob("attempt_*/gate.json"), key=lambda p: int(p.parent.name.split("_")[1]))
    return [json.loads(p.read_text()) for p in paths]


def summarize(pcfg: Any, ledger: ConditionLedger, outcome: Any) -> dict[str, Any]:
    """The pipeline summary (module table) as a JSON-ready dict."""
    from flowforge.orchestrate.stage_trainer import read_audits

    directory = pipeline_dir(pcfg)
    conditions = {c.id for c in ledger.order}
    a = _ledger_rows(directory / "A" / "judge" / "ledger.sqlite", conditions)
    audit = _ledger_rows(directory / "C" / "audit" / "judge" / "ledger.sqlite", conditions)
    audit_groups = audit["train_groups"] + audit["eval_groups"]
    c_groups = len(ledger.with_state("trained_on", "C"))
    teacher = {"train_groups": a["train_groups"], "eval_groups": a["eval_groups"], "audit_groups": audit_groups,
               "total_groups": a["train_groups"] + a["eval_groups"] + audit_groups,
               "http_requests": a["http_requests"] + audit["http_requests"],
               "failed_groups": a["failed_groups"] + audit["failed_groups"],
               "server_log": _server_log(directory / "teacher" / "requests.log")}
    return {
        "status": outcome.status, "reason": outcome.reason, "last_good_checkpoint": outcome.last_good,
        "ledger": ledger.summary(),
        "A": {"run_dir": "A", "eval": last_eval(directory / "A")},
        "B": {"attempts": _attempts(directory)},
        "C": {"run_dir": "C", "eval": last_eval(directory / "C"), "audits": read_audits(directory / "C")},
        "teacher": teacher,
        "savings": {"c_groups": c_groups, "teacher_requests_if_A": c_groups, "audit_groups": audit_groups,
                    "teacher_requests_saved": c_groups - audit_groups},
    }


def _html(summary: dict[str, Any], title: str) -> str:
    def link(path: str, text: str) -> str:
        return f'<a href="{html.escape(path)}">{html.escape(text)}</a>'

    b = summary["B"]["attempts"]
    rows = [("status", html.escape(f"{summary['status']} {summary['reason']}".strip())),
            ("stage A", link("A/report.html", "A/report.html") + " eval " + html.escape(
                json.dumps(summary["A"]["eval"]))),
            ("stage B", "<br>".join(link(f"B/attempt_{r['attempt']}/gate.json", f"attempt {r['attempt']}")
                                    + html.escape(f" passed={r['passed']} held-out={json.dumps(r['held_out'])}")
                                    for r in b) or "not run"),
            ("stage C", link("C/report.html", "C/report.html") + " eval " + html.escape(
                json.dumps(summary["C"]["eval"]))),
            ("audits", html.escape(json.dumps([{k: a[k] for k in ("step", "spearman", "pairwise_accuracy",
                                                                    "passed")} for a in summary["C"]["audits"]]))),
            ("teacher", html.escape(json.dumps(summary["teacher"]))),
            ("savings", html.escape(json.dumps(summary["savings"]))),
            ("last good checkpoint", html.escape(str(summary["last_good_checkpoint"])))]
    body = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>flowforge pipeline — '
            f"{html.escape(title)}</title></head><body><h1>{html.escape(title)}</h1><pre>{html.escape(DIAGRAM)}"
            f"</pre><table>{body}</table></body></html>\n")


def write_pipeline_report(pcfg: Any, ledger: ConditionLedger, outcome: Any) -> dict[str, Any]:
    """Write ``summary.json`` and ``report.html`` into the pipeline directory (atomically); the summary."""
    summary = summarize(pcfg, ledger, outcome)
    directory = pipeline_dir(pcfg)
    write_bytes(directory / SUMMARY_FILE, json.dumps(summary, indent=1, default=float).encode())
    write_bytes(directory / REPORT_FILE, _html(summary, pcfg.run.name).encode())
    return summary
