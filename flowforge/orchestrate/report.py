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
``teacher.max_requests``          the pipeline's teacher budget (0: no cap)
``status`` / ``stages_run``      ``done`` (stage C finished), ``partial`` (``--stage A`` / ``B`` finished: the
                                  later stages have not run) or why it stopped; the stages this invocation ran
``A.headline`` / ``C.headline``   the stage's headline eval metric start → end with its standard error, as its own
                                  report's verdict writes it (:func:`flowforge.report.run.run_headline`), as plain
                                  text (the HTML is in ``report.html`` only)
``C.last_good_eval``              after an audit stop, the held-out evaluation of the last good checkpoint of C (the
                                  policy handed on; ``last_good/step_<n>/C/eval.jsonl``); ``{}`` without a stop,
                                  when that checkpoint is A's (the hand-off) or when it was not evaluated
``timeline``                      the stages in the order they ran with their start and end (:func:`timeline`)
``agreement``                     student vs teacher at every gate attempt and audit (:func:`agreement_points`)
================================  ====================================================================================

``report.html`` has the run reports' style (:mod:`flowforge.report.page`): the verdict (status and reason, teacher
budget spent, each stage's headline, the latest agreement, savings) with the agreement plot beside it; then the
stages, each with its headline and a link to its own ``report.html`` / ``gate.json`` only when that file exists;
the stage timeline; the agreement table; the teacher's bill; the condition ledger. Numbers are written as words
and tables, never as Python dicts or JSON (``summary.json`` holds them for programs).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from flowforge.orchestrate.directory import PipelineLayout, record_path
from flowforge.orchestrate.evals import last_eval, last_good_eval
from flowforge.report.page import esc, kv_table, note, plain_text, render_page, verdict_block
from flowforge.report.plots import figure_tag
from flowforge.report.run import REPORT_FILE as RUN_REPORT_FILE, run_headline
from flowforge.orchestrate.ledger import ConditionLedger
from flowforge.runtime.durable import write_bytes

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


def _attempts(layout: PipelineLayout) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in layout.gate_files()]


def _plain_headline(run_dir: Path) -> str | None:
    """:func:`~flowforge.report.run.run_headline` as plain text (``summary.json`` is read by programs; the HTML
    stays in the report)."""
    head = run_headline(run_dir)
    return None if head is None else plain_text(head)


def summarize(pcfg: Any, ledger: ConditionLedger, outcome: Any) -> dict[str, Any]:
    """The pipeline summary (module table) as a JSON-ready dict."""
    from flowforge.orchestrate.stage_trainer import read_audits

    layout = PipelineLayout.of(pcfg)
    conditions = {c.id for c in ledger.order}
    a = _ledger_rows(layout.a_judge_ledger, conditions)
    audit = _ledger_rows(layout.audit_judge_ledger, conditions)
    audit_groups = audit["train_groups"] + audit["eval_groups"]
    c_groups = len(ledger.with_state("trained_on", "C"))
    teacher = {"train_groups": a["train_groups"], "eval_groups": a["eval_groups"], "audit_groups": audit_groups,
               "total_groups": a["train_groups"] + a["eval_groups"] + audit_groups,
               "http_requests": a["http_requests"] + audit["http_requests"],
               "failed_groups": a["failed_groups"] + audit["failed_groups"],
               "server_log": _server_log(layout.request_log("teacher"))}
    attempts, audits = _attempts(layout), read_audits(layout.c_run)
    teacher["max_requests"] = pcfg.teacher.max_requests
    return {
        "status": outcome.status, "reason": outcome.reason,
        "last_good_checkpoint": record_path(layout.root, outcome.last_good) if outcome.last_good else None,
        "stages_run": list(outcome.stages_run),
        "ledger": ledger.summary(),
        "A": {"run_dir": layout.relative(layout.a_run).as_posix(), "eval": last_eval(layout.a_run),
              "headline": _plain_headline(layout.a_run)},
        "B": {"attempts": attempts},
        "C": {"run_dir": layout.relative(layout.c_run).as_posix(), "eval": last_eval(layout.c_run), "audits": audits,
              "headline": _plain_headline(layout.c_run), "audit_design": _audit_design(layout.c_run),
              "last_good_eval": last_good_eval(layout, outcome.last_good)},
        "timeline": timeline(layout.root, attempts),
        "agreement": agreement_points(ledger, attempts, audits),
        "teacher": teacher,
        "savings": {"c_groups": c_groups, "teacher_requests_if_A": c_groups, "audit_groups": audit_groups,
                    "teacher_requests_saved": c_groups - audit_groups},
    }


# ------------------------------------------------------------------------------------------------ the page
def _audit_design(run_dir: Path) -> dict[str, Any] | None:
    """``C/audit_design.json`` (the audits' size and power on stage A's marks), or None."""
    try:
        return json.loads((run_dir / "audit_design.json").read_text())
    except (OSError, ValueError):
        return None


def _saved(savings: dict) -> str:
    """The savings in words: a C stopped early can have audited more groups than it trained on, which is a cost,
    not a negative saving."""
    saved, audits = savings["teacher_requests_saved"], savings["audit_groups"]
    if saved >= 0:
        return f"{saved} teacher requests saved after {audits} audit groups"
    return f"none: its {audits} audit groups cost {-saved} teacher requests more than judging C's groups would have"


_STATUS = {"done": ("good", "finished"), "partial": ("flat", "partly run"),
           "gate_failed": ("bad", "stopped at the quality gate"),
           "audit_stopped": ("bad", "stopped by a teacher audit"),
           "unaudited_stopped": ("bad", "stopped: the teacher could not order the audited groups"),
           "budget_exhausted": ("bad", "stopped: the teacher budget would be exceeded")}


def _file_time(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _run_span(run_dir: Path) -> tuple[float, float] | None:
    """``(start, end)`` POSIX seconds of a stage's run directory: its last (re)start (``provenance.json``) to its
    last log line; None when it never started."""
    try:
        start = _dt.datetime.fromisoformat(json.loads((run_dir / "provenance.json").read_text())["time_utc"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    ends = [t for t in (_file_time(run_dir / f) for f in ("metrics.jsonl", "eval.jsonl", "audit.jsonl")) if t]
    return start.timestamp(), max(ends, default=start.timestamp())


def timeline(directory: Path, attempts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stages in the order they ran, each ``{"stage", "start", "end"}`` (POSIX seconds, from the files'
    times: a run directory from its last start to its last log line; a gate attempt, which runs right after
    stage A, from the end of the stage before it to its last file, ``gate.json``), sorted by start."""
    layout = PipelineLayout(Path(directory))
    rows = []
    for stage in ("A", "C"):
        span = _run_span(layout.stage(stage))
        if span is not None:
            rows.append({"stage": stage, "start": span[0], "end": span[1]})
    for record in attempts:
        folder = layout.attempt(record["attempt"])
        times = [t for t in (_file_time(p) for p in folder.rglob("*") if p.is_file()) if t]
        if times:
            before = [r["end"] for r in rows if r["end"] <= min(times)]  # the student writes its first file late
            rows.append({"stage": f"B{record['attempt']}", "start": max(before, default=min(times)),
                         "end": max(times)})
    return sorted(rows, key=lambda r: r["start"])


def agreement_points(ledger: ConditionLedger, attempts: list[dict[str, Any]],
                     audits: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Teacher-student agreement over the pipeline: each gate attempt (on B's test split) and each audit of C (on
    the audited groups), at ``position`` = conditions of the pass handed out when it was measured (the
    pipeline's clock: A's budget at a gate; A's use plus C's conditions up to the audited step at an audit)."""
    out = []
    for record in attempts:
        test = record.get("held_out") or {}
        out.append({"kind": "gate", "label": f"gate {record['attempt']}", "position": record.get("budget_a"),
                    "groups": test.get("groups"), "spearman": test.get("spearman"),
                    "pairwise_accuracy": test.get("pairwise_accuracy"), "mae": test.get("mae"),
                    "passed": record.get("passed"), "verdict": "passed" if record.get("passed") else "failed"})
    c_takes = sorted((step, len(t.get("ids") or [])) for (stage, step), t in ledger.takes.items() if stage == "C")
    for audit in audits:
        used_c = sum(n for step, n in c_takes if step <= audit["step"])
        out.append({"kind": "audit", "label": f"audit at C step {audit['step']}",
                    "position": ledger.used["A"] + used_c, "groups": audit.get("groups"),
                    "spearman": audit.get("spearman"), "pairwise_accuracy": audit.get("pairwise_accuracy"),
                    "mae": audit.get("mae"), "passed": audit.get("passed"), "verdict": audit_verdict(audit),
                    "unaudited": bool(audit.get("unaudited")), "pooled_groups": audit.get("pooled_groups"),
                    "closing": bool(audit.get("closing")),
                    "pairs_compared": audit.get("pairs_compared"), "pairs_tied": audit.get("pairs_tied"),
                    "spearman_raw": audit.get("spearman_raw"),
                    "pairwise_accuracy_raw": audit.get("pairwise_accuracy_raw")})
    return out


def audit_verdict(record: dict[str, Any]) -> str:
    """``passed``, ``failed`` or ``pending`` of an ``audit.jsonl`` record (its ``verdict``; records written before
    it existed: ``passed`` true / false / null)."""
    if record.get("verdict") in ("passed", "failed", "pending"):
        return record["verdict"]
    passed = record.get("passed")
    return "pending" if passed is None else "passed" if passed else "failed"


def verdict_words(point: dict[str, Any]) -> str:
    """A point's verdict as the report says it: a pending audit is never called failed."""
    verdict = point.get("verdict") or ("passed" if point.get("passed") else "failed")
    if verdict == "pending":
        return ("pending: the teacher could not order the audited groups" if point.get("unaudited")
                else f"pending: {_num(point.get('pooled_groups'))} groups gathered, no verdict yet")
    closing = f" (closing verdict, {_num(point.get('pooled_groups'))} groups)" if point.get("closing") else ""
    return verdict + closing


def beside_gate(record: dict[str, Any]) -> str:
    """The Spearman with the teacher, on the gate's test groups, of its baselines and of the eval judges (reference
    only) in a ``gate.json`` ``record``, as the report prints them ('' when it has neither)."""
    def row(entries: dict[str, Any]) -> str:
        return ", ".join(f"{k} {'not scored' if 'error' in v else _num(v.get('spearman'))}" for k, v in entries.items())
    base, judges = record.get("baselines") or {}, record.get("eval_judges") or {}
    return (f" · baselines: {row(base)}" if base else "") + (f" · eval judges (for reference): {row(judges)}"
                                                            if judges else "")


def _num(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _pairs(point: dict[str, Any]) -> str:
    if point.get("pairs_compared") is None:
        return "–"
    return f"{point['pairs_compared']} ({_num(point.get('pairs_tied'))})"


def _raw(point: dict[str, Any]) -> str:
    if point.get("spearman_raw") is None:
        return "–"
    return f"{_num(point['spearman_raw'])} / {_num(point.get('pairwise_accuracy_raw'))}"


def _plot_agreement(points: list[dict[str, Any]], pcfg: Any) -> Figure:
    """Spearman and pairwise accuracy of the student against the teacher at each gate (squares) and audit
    (circles) over the pass, with the gate's and the audits' thresholds."""
    fig = Figure(figsize=(8.4, 3.1), dpi=90)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.17, top=0.86, wspace=0.28)
    for i, (metric, gate_min, audit_min) in enumerate([
            ("spearman", pcfg.student.gate.min_spearman, pcfg.audit.min_spearman),
            ("pairwise_accuracy", pcfg.student.gate.min_pairwise_accuracy, pcfg.audit.min_pairwise_accuracy)]):
        ax = fig.add_subplot(1, 2, i + 1)
        for kind, marker in (("gate", "s"), ("audit", "o")):
            pts = [p for p in points if p["kind"] == kind and p["position"] is not None
                   and isinstance(p[metric], (int, float)) and math.isfinite(p[metric])]
            ax.scatter([p["position"] for p in pts], [p[metric] for p in pts], marker=marker, s=36, zorder=3,
                       c=["C7" if p["passed"] is None else "C2" if p["passed"] else "C3" for p in pts])
        ax.axhline(gate_min, color="C0", linestyle="--", linewidth=1)
        ax.axhline(audit_min, color="C1", linestyle=":", linewidth=1.2)
        # the legend names shapes in grey: the colour of a point is its verdict, not its kind
        handles = [Line2D([], [], marker="s", color="grey", linestyle="", label="gate"),
                   Line2D([], [], marker="o", color="grey", linestyle="", label="audit"),
                   Line2D([], [], marker="o", color="C2", linestyle="", label="passed"),
                   Line2D([], [], marker="o", color="C3", linestyle="", label="failed"),
                   Line2D([], [], marker="o", color="C7", linestyle="", label="pending"),
                   Line2D([], [], color="C0", linestyle="--", label=f"gate min {gate_min:g}"),
                   Line2D([], [], color="C1", linestyle=":", label=f"audit min {audit_min:g}")]
        ax.margins(x=0.12, y=0.1)  # points at the first / last position stay inside the frame
        ax.set_title(f"student vs teacher: {metric}", fontsize=10)
        ax.set_xlabel("conditions of the pass handed out", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(handles=handles, fontsize=6.5, loc="best")
    return fig


def _plot_timeline(rows: list[dict[str, Any]]) -> Figure:
    """One bar per stage on the wall clock, minutes since the first stage started."""
    t0 = min(r["start"] for r in rows)
    fig = Figure(figsize=(8.4, 0.5 + 0.36 * len(rows)), dpi=90)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.5 / (0.5 + 0.36 * len(rows)) + 0.05, top=0.97)
    ax = fig.add_subplot(1, 1, 1)
    colours = {"A": "C0", "B": "C4", "C": "C1"}
    for i, r in enumerate(rows):
        ax.barh(i, max((r["end"] - r["start"]) / 60, 0.02), left=(r["start"] - t0) / 60,
                color=colours[r["stage"][0]], height=0.6)
    ax.set_yticks(range(len(rows)), [r["stage"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("minutes since the first stage started", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(True, axis="x", alpha=0.3)
    return fig


def _link(directory: Path, rel: str, text: str) -> str:
    """A link to ``rel`` when that file exists beside the page, else the text and '(not written)'."""
    if (directory / rel).is_file():
        return f'<a href="{esc(rel)}">{esc(text)}</a>'
    return f'{esc(text)} <span class="note">(not written)</span>'


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    m, s = divmod(seconds, 60)
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min" if h else (f"{m} min {s:02d} s" if m else f"{s} s")


def _stage_rows(summary: dict[str, Any], directory: Path) -> list[str]:
    """The stages section: each stage's headline and its link (a link only to a file that exists)."""
    ledger = summary["ledger"]
    layout = PipelineLayout(Path(directory))
    parts = ['<h2 id="stages">Stages</h2>', "<table><tr><th>stage</th><th>what it did</th><th>headline</th>"
             "<th>details</th></tr>"]

    def run_row(stage: str, what: str) -> str:
        ran = layout.stage(stage).is_dir()
        used = f"{ledger['used'][stage]} of {ledger['budget'][stage]} conditions"
        head = run_headline(layout.stage(stage)) or ("no held-out evaluation logged" if ran else "did not run")
        report = layout.relative(layout.stage(stage) / RUN_REPORT_FILE).as_posix()
        link = _link(directory, report, report) if ran else "–"
        return f"<tr><td>{stage}</td><td>{esc(what)}; {esc(used)}</td><td>{head}</td><td>{link}</td></tr>"

    parts.append(run_row("A", "RL with the teacher judge"))
    attempts = summary["B"]["attempts"]
    for r in attempts:
        test = r.get("held_out") or {}
        verdict = "passed" if r.get("passed") else "failed: " + "; ".join(r.get("reasons") or [])
        head = esc(f"gate {verdict} · Spearman {_num(test.get('spearman'))}, pairwise accuracy "
                   f"{_num(test.get('pairwise_accuracy'))}, MAE {_num(test.get('mae'))} on "
                   f"{_num(test.get('groups'))} test groups" + beside_gate(r))
        gate = layout.relative(layout.gate_file(r["attempt"])).as_posix()
        what = esc(f"student trained on {r.get('groups')} judged groups of A")
        css = "good" if r.get("passed") else "bad"
        parts.append(f'<tr><td>B{r["attempt"]}</td><td>{what}</td><td><span class="{css}">{head}</span></td>'
                     f"<td>{_link(directory, gate, gate)}</td></tr>")
    if not attempts:
        parts.append("<tr><td>B</td><td>student on A's judged groups</td><td>did not run</td><td>–</td></tr>")
    parts.append(run_row("C", "RL with the student's reward"))
    parts.append("</table>")
    return parts


def _html(summary: dict[str, Any], title: str, directory: Path, pcfg: Any) -> str:
    """The pipeline report (:mod:`flowforge.report.page`'s style, like a run's ``report.html``)."""
    css, words = _STATUS.get(summary["status"], ("flat", summary["status"]))
    head = f'pipeline <span class="{css}">{esc(words)}</span>' + (
        f": {esc(summary['reason'])}" if summary["reason"] else "")
    t = summary["teacher"]
    cap = t.get("max_requests") or 0
    spent = (f"{t['http_requests']} of {cap} billed requests ({t['http_requests'] / cap:.0%})" if cap
             else f"{t['http_requests']} billed requests (no cap: teacher.max_requests is 0)")
    facts = [esc(f"teacher budget spent: {spent}; {t['total_groups']} groups judged "
                 f"({t['train_groups']} for A's training, {t['eval_groups']} for evaluations, {t['audit_groups']} "
                 f"in C's audits), {t['failed_groups']} dropped without scores")]
    ran = summary.get("stages_run") or []
    facts.append(esc(f"this run: stage{'s' * (len(ran) != 1)} {', '.join(ran)}" if ran else "this run: no stage"))
    for stage in ("A", "C"):
        if summary[stage].get("headline"):
            facts.append(f"stage {stage}: {run_headline(PipelineLayout(Path(directory)).stage(stage))}")
    points = summary.get("agreement") or []
    if points:
        last = points[-1]
        facts.append(esc(f"teacher-student agreement, latest ({last['label']}): Spearman {_num(last['spearman'])}, "
                         f"pairwise accuracy {_num(last['pairwise_accuracy'])} on {_num(last['groups'])} groups "
                         f"({verdict_words(last)})"))
    design = summary["C"].get("audit_design")
    if design:
        facts.append(esc(f"audits, simulated from {design['source']}: a random student passes "
                         f"{100 * design['size']:.2f} % of verdicts, a student at the gate's bar is stopped "
                         f"{100 * design['power']:.1f} % ({design['groups']} groups per verdict)"))
    sv = summary["savings"]
    facts.append(esc(f"C trained on {sv['c_groups']} groups with the student's reward: {_saved(sv)}"))
    if summary["last_good_checkpoint"]:
        facts.append(esc(f"last good checkpoint: {summary['last_good_checkpoint']}"))
        good = summary["C"].get("last_good_eval") or {}
        shown = [f"{k.removeprefix('eval/')} {v:.4g}" for k, v in good.items()
                 if k.startswith("eval/") and isinstance(v, (int, float))]
        if shown:
            facts.append(esc(f"its held-out eval (step {good.get('step')}): " + ", ".join(shown)))
    figure = figure_tag(_plot_agreement(points, pcfg), "teacher-student agreement over the pass") if points else ""
    sections = [verdict_block(head, facts, figure)]
    sections += _stage_rows(summary, directory)

    sections.append('<h2 id="timeline">Timeline</h2>')
    rows = summary.get("timeline") or []
    if rows:
        sections.append(figure_tag(_plot_timeline(rows), "stage timeline"))
        t0 = rows[0]["start"]
        body = "".join(f"<tr><td>{esc(r['stage'])}</td><td class=\"num\">{esc(_duration(r['start'] - t0))}</td>"
                       f"<td class=\"num\">{esc(_duration(r['end'] - r['start']))}</td></tr>" for r in rows)
        sections.append(f"<table><tr><th>stage</th><th>started after</th><th>took</th></tr>{body}</table>")
        sections.append(note("From the files' times: a stage's run directory from its last (re)start to its last log "
                             "line, a gate attempt from the end of the stage before it to its gate.json."))
    else:
        sections.append(note("No stage has started."))

    sections.append('<h2 id="agreement">Teacher–student agreement</h2>')
    if points:
        body = "".join(
            f"<tr><td>{esc(p['label'])}</td><td class=\"num\">{esc(_num(p['position']))}</td>"
            f"<td class=\"num\">{esc(_num(p['groups']))}</td><td class=\"num\">{esc(_num(p['spearman']))}</td>"
            f"<td class=\"num\">{esc(_num(p['pairwise_accuracy']))}</td><td class=\"num\">{esc(_num(p['mae']))}"
            f"</td><td class=\"num\">{esc(_pairs(p))}</td><td class=\"num\">{esc(_raw(p))}</td>"
            f"<td>{esc(verdict_words(p))}</td></tr>" for p in points)
        sections.append("<table><tr><th>measured at</th><th>conditions handed out</th><th>groups</th>"
                        "<th>Spearman</th><th>pairwise accuracy</th><th>MAE</th><th>pairs compared (tied)</th>"
                        f"<th>without the tie margin</th><th>verdict</th></tr>{body}</table>")
        sections.append(note("An audit's Spearman and pairwise accuracy are those of the groups its verdict is (or "
                             "will be) taken on: those gathered since the last verdict; pairs the teacher's tie "
                             "margin ties are not compared (the raw values compare every pair)."))
    else:
        sections.append(note("No gate or audit has run yet."))

    sections.append('<h2 id="teacher">Teacher budget</h2>')
    log_ = t.get("server_log")
    budget_rows = [("billed HTTP requests", esc(spent)),
                   ("groups judged for A's training", esc(t["train_groups"])),
                   ("groups judged for evaluations", esc(t["eval_groups"])),
                   ("groups judged in C's audits", esc(t["audit_groups"])),
                   ("groups dropped without scores", esc(t["failed_groups"])),
                   ("groups C trained on with the student", esc(sv["c_groups"])),
                   ("teacher requests saved (C's groups minus its audits)", esc(_saved(sv)))]
    if log_:
        budget_rows.append(("teacher server's own log", esc(
            f"{log_['requests']} requests received for {log_['groups']} groups; most billed for one group: "
            f"{log_['max_per_group']}; received twice: {log_['duplicates']}")))
    sections.append(kv_table(budget_rows))
    led = summary["ledger"]
    sections.append('<h2 id="ledger">Condition ledger</h2>')
    ledger_rows = [("conditions in the pass", esc(f"{led['conditions']} ({led['handed_out']} handed out"
                                                  + (", pass exhausted)" if led["exhausted"] else ")"))),
                   *((f"stage {s}", esc(f"used {led['used'][s]} of {led['budget'][s]}, {led['remaining'][s]} left"))
                     for s in led["budget"]),
                   ("conditions per state", esc(", ".join(f"{k} {v}" for k, v in led["states"].items())))]
    if led.get("extensions"):
        ledger_rows.append(("extensions of A", esc(", ".join(f"{k}: +{v}" for k, v in led["extensions"].items()))))
    sections.append(kv_table(ledger_rows))
    sections.append(f"<details><summary>How the stages fit together</summary><pre>{esc(DIAGRAM)}</pre></details>")
    nav = [("verdict", "Verdict"), ("stages", "Stages"), ("timeline", "Timeline"), ("agreement", "Agreement"),
           ("teacher", "Teacher budget"), ("ledger", "Ledger")]
    return render_page(f"flowforge pipeline — {title}", str(directory), nav, sections)


def write_pipeline_report(pcfg: Any, ledger: ConditionLedger, outcome: Any) -> dict[str, Any]:
    """Write ``summary.json`` and ``report.html`` into the pipeline directory (atomically); the summary."""
    summary = summarize(pcfg, ledger, outcome)
    layout = PipelineLayout.of(pcfg)
    write_bytes(layout.summary, json.dumps(summary, indent=1, default=float).encode())
    write_bytes(layout.report, _html(summary, pcfg.run.name, layout.root, pcfg).encode())
    return summary
