"""Control arms of the three-stage pipeline: what stage C would have given with another reward than the student.

A distilled student is worth having only if RL with it beats RL with what a user has without it. ``flowforge stages
CONFIG --arm NAME`` runs one arm beside the pipeline (same config, same seeds, same stage A):

===========  =====================================================================================================
arm          stage C's reward (from A's last checkpoint, on the same conditions as the student's stage C)
===========  =====================================================================================================
``student``  the distilled student, audited by the teacher: the pipeline itself (A -> B -> C)
``teacher``  the teacher for C's budget too ("A only": the teacher for the whole budget), billed against
             ``teacher.max_requests`` with everything else the pipeline billed
``proxy``    ``stages.proxy_reward`` (a reward scorer that never saw a teacher mark, e.g. ``action_idm`` for a world
             model, or ``scalar_head`` with the student's own initialisation), with ``stages.proxy_options``
===========  =====================================================================================================

The base (no training) is stage A's step-0 evaluation and the hand-off is A's last one: both are read from A's run
directory, not run again. An arm has no stage B and no audits (the audits guard the student's agreement with the
teacher; an arm is a control to compare against, not a policy to ship).

Layout: ``<pipeline>/arms/<arm>/`` holds the arm's condition ledger and its stage C run directory ``C/`` (with the
teacher arm's request ledger ``C/judge/ledger.sqlite``). The arm's ledger starts as the pipeline ledger's records of
stages A and B (:func:`handoff_records`), so the arm's C draws exactly the conditions the student's C draws, in the
same order. If stage A later changes (the gate extended it), a rerun of the arm is refused (its hand-off is stale),
and so is a rerun under another ``stages.c_overrides`` or proxy reward than the arm ran with (``arm.json``).

``arms.json`` (:func:`arm_table`) puts the independent evaluation of each arm beside the base and the hand-off: the
comparison a user reads to see whether distillation helped. Every evaluation scores the same held-out prompts with
the same fixed noise, so each gain over the hand-off (``gain_se``) and the student's difference from the proxy and
the teacher arms (the student row's ``versus``) carries its standard error paired over the prompts
(:func:`flowforge.report.verdict.change_se`, from the per-sample scores each evaluation keeps beside its grid).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from flowforge.orchestrate.budget import teacher_cap
from flowforge.orchestrate.config import JUDGE, stage_config
from flowforge.orchestrate.directory import CONDITIONS_FILE, PipelineLayout
from flowforge.orchestrate.ledger import ConditionLedger
from flowforge.orchestrate.stages import (_train, a_steps, c_steps, is_main, newest_step, on_main, open_ledger_at,
                                          pipeline_session, run_stage_a, stage_c_changes)
from flowforge.rewards.judge.ledger import adopt_answers
from flowforge.runtime.durable import write_bytes
from flowforge.runtime.errors import UserError

log = logging.getLogger("flowforge")

ARMS = ("student", "teacher", "proxy")
"""The arms ``flowforge stages --arm`` runs (module table); ``student`` is the pipeline itself."""
ARMS_DIR = "arms"
PROXY_NEEDED = "--arm proxy needs stages.proxy_reward (a reward scorer that never saw a teacher mark, e.g. action_idm)"
ARM_TABLE_FILE = "arms.json"
ARM_SETTINGS_FILE = "arm.json"


def arm_dir(pcfg: Any, arm: str) -> Path:
    """``<pipeline>/arms/<arm>``: the arm's condition ledger and its stage C run directory."""
    return PipelineLayout.of(pcfg).arm_dir(arm)


def handoff_records(lines: list[str]) -> list[str]:
    """The lines of a condition ledger (JSON Lines) that stage C did not write: the header, stage A's takes and
    marks, stage B's marks and the extensions -- the state stage C starts from."""
    kept = []
    for line in lines:
        if not line.strip():
            continue
        record = json.loads(line)
        if record.get("stage") != "C":
            kept.append(line)
    return kept


def _a_takes(lines: list[str]) -> list[str]:
    """The records that fix stage A's conditions (its takes and the extensions), for the staleness check."""
    out = []
    for line in handoff_records(lines):
        record = json.loads(line)
        if record.get("kind") == "extend" or (record.get("kind") == "take" and record.get("stage") == "A"):
            out.append(line)
    return out


def open_arm_ledger(pcfg: Any, arm: str, pipeline_ledger: ConditionLedger) -> ConditionLedger:
    """The arm's condition ledger: created from the pipeline ledger's hand-off records on the arm's first run,
    reopened after that. Under torchrun rank 0 writes it and the other ranks hold a read-only mirror (as the
    pipeline's own ledger).

    Raises:
        UserError: stage A's conditions changed since the arm started (the gate extended A).
    """
    path = arm_dir(pcfg, arm) / CONDITIONS_FILE

    def create() -> None:
        source = pipeline_ledger.path.read_text(encoding="utf-8").splitlines()
        if path.is_file():
            if _a_takes(path.read_text(encoding="utf-8").splitlines()) != _a_takes(source):
                raise UserError(f"--arm {arm}", f"stage A changed since this arm started ({path} holds an older "
                                                "hand-off: the quality gate extended A)",
                                f"move {path.parent} aside (mv {path.parent} {path.parent}.stale) and rerun the arm")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_bytes(path, ("\n".join(handoff_records(source)) + "\n").encode("utf-8"))

    on_main(create)
    return open_ledger_at(pcfg, path, writer=is_main())


def arm_settings(pcfg: Any, arm: str) -> dict[str, Any]:
    """What makes arm ``arm``'s stage C differ from the pipeline's beyond stage A: ``stages.c_overrides`` and, for the
    proxy arm, ``stages.proxy_reward`` / ``stages.proxy_options`` (dotted key -> value, as loaded from YAML)."""
    settings: dict[str, Any] = {"stages.c_overrides": list(pcfg.stages.c_overrides)}
    if arm == "proxy":
        settings["stages.proxy_reward"] = pcfg.stages.proxy_reward
        settings["stages.proxy_options"] = dict(pcfg.stages.proxy_options)
    return settings


def check_arm_settings(pcfg: Any, arm: str, *, trained: bool) -> None:
    """Record :func:`arm_settings` in ``<pipeline>/arms/<arm>/arm.json``; once the arm has ``trained`` (its C holds a
    checkpoint past stage A's), refuse settings that differ from the recorded ones. Without this, a rerun with another
    ``stages.proxy_reward`` or ``stages.c_overrides`` would resume (or, when finished, return) the arm trained under
    the old ones, and ``arms.json`` would show it as this config's row. Before the arm has trained, the record is
    rewritten (nothing was computed under it). An arm made before this record existed gets the current settings.

    Raises:
        UserError: a recorded setting differs (names the key, the recorded and the current value).
    """
    path = arm_dir(pcfg, arm) / ARM_SETTINGS_FILE
    current = json.loads(json.dumps(arm_settings(pcfg, arm)))  # tuples as lists, as read back from JSON

    def check() -> None:
        if not path.is_file() or not trained:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_bytes(path, (json.dumps(current, indent=1, sort_keys=True) + "\n").encode("utf-8"))
            return
        recorded = json.loads(path.read_text(encoding="utf-8"))
        for key in sorted(set(recorded) | set(current)):
            if recorded.get(key) != current.get(key):
                raise UserError(key, f"arm {arm} ran with {json.dumps(recorded.get(key))}, this config gives "
                                     f"{json.dumps(current.get(key))} (its row in arms.json would not be this "
                                     "config's)",
                                f"rerun with the recorded value, or move {path.parent} aside (mv {path.parent} "
                                f"{path.parent}.old) to run the arm afresh")

    on_main(check)


def arm_reward(pcfg: Any, arm: str, endpoints: Any) -> tuple[dict[str, Any], str]:
    """``(reward section, the component whose NaN drops a group)`` of an arm's stage C.

    Raises:
        ValueError: an unknown arm; ``proxy`` without ``stages.proxy_reward``.
    """
    if arm == "teacher":
        own = PipelineLayout.of(pcfg).arm_judge_ledger("teacher")

        def cap() -> int:  # rank 0: the one writer of the request ledgers
            adopt_answers(own, PipelineLayout.of(pcfg).audit_judge_ledger)  # a group both judged is paid once
            return teacher_cap(pcfg, own, "the teacher arm")

        teacher = {**endpoints.teacher(), "max_billed": on_main(cap)}
        return {"weights": {JUDGE: 1.0}, "options": {JUDGE: teacher}}, JUDGE
    if arm == "proxy":
        name = pcfg.stages.proxy_reward
        if not name:
            raise ValueError(PROXY_NEEDED)
        return {"weights": {name: 1.0}, "options": {name: dict(pcfg.stages.proxy_options)}}, name
    raise ValueError(f"--arm must be one of {list(ARMS)}, got {arm!r}")


def run_arm(pcfg: Any, arm: str, pipeline_ledger: ConditionLedger, endpoints: Any, *, progress: bool = True) -> Path:
    """Run the control arm ``arm`` (``teacher`` / ``proxy``) after stage A: its stage C from A's last checkpoint on
    the hand-off's conditions (module docstring). Returns the arm's C run directory.

    Raises:
        ValueError: stage A has not finished; an unknown arm.
        UserError: the hand-off is stale; the arm ran under other settings (:func:`check_arm_settings`).
        BudgetExhausted: the teacher arm finds ``teacher.max_requests`` spent by the rest of the pipeline.
    """
    from flowforge.orchestrate.stage_trainer import stage_trainer

    layout = PipelineLayout.of(pcfg)
    start = a_steps(pcfg, pipeline_ledger)
    if on_main(lambda: newest_step(layout.a_run)) != start:
        raise ValueError(f"--arm {arm} needs stage A finished ({start} steps); run `flowforge stages CONFIG "
                         "--stage A` (or the whole pipeline) first")
    root = arm_dir(pcfg, arm)
    run_dir = root / "C"
    newest = on_main(lambda: newest_step(run_dir))
    check_arm_settings(pcfg, arm, trained=newest > start)
    ledger = open_arm_ledger(pcfg, arm, pipeline_ledger)
    steps = c_steps(pcfg, ledger)
    if steps == 0 or newest == start + steps:
        return run_dir
    reward, name = arm_reward(pcfg, arm, endpoints)
    resume = "auto" if newest > start else str(layout.a_checkpoint(start))
    cfg = stage_config(pcfg, "C", steps=start + steps, reward=reward, resume=resume, output_dir=root)
    # an arm's C trains without audits: it is a control, not a policy to ship (module docstring)
    log.info("arm %s: stage C steps %d..%d on %d conditions, reward %s", arm, start, start + steps,
             ledger.budget("C"), name)
    _train(stage_trainer(cfg, ledger=ledger, stage="C", reward_name=name, progress=progress,
                         expected_changes=stage_c_changes(pcfg), own_area=layout.root))
    return run_dir


def run_arm_pipeline(pcfg: Any, arm: str, *, progress: bool = True,
                     inputs: dict[str, str | Path] | None = None) -> dict[str, Any]:
    """``flowforge stages CONFIG --arm ARM``: stage A (shared with the pipeline; nothing when it is done), then the
    arm's stage C, under the pipeline directory's lock (:func:`~flowforge.orchestrate.stages.pipeline_session`).
    Returns :func:`arm_table` (rank 0; ``{}`` on the other ranks).

    Raises:
        ValueError: an unknown arm; ``proxy`` without ``stages.proxy_reward``.
        UserError: as :func:`run_arm` and :func:`~flowforge.orchestrate.stages.run_pipeline`.
    """
    if arm not in ARMS or arm == "student":
        raise ValueError(f"--arm must be one of {[a for a in ARMS if a != 'student']} (the student arm is the "
                         f"pipeline itself: run without --arm), got {arm!r}")
    if arm == "proxy" and not pcfg.stages.proxy_reward:
        raise ValueError(PROXY_NEEDED)
    with pipeline_session(pcfg, inputs) as (ledger, endpoints):
        run_stage_a(pcfg, ledger, endpoints, progress=progress)
        run_arm(pcfg, arm, ledger, endpoints, progress=progress)
        return arm_table(pcfg) if is_main() else {}


def arm_table(pcfg: Any) -> dict[str, Any]:
    """The last held-out evaluation of every arm that ran, beside the base (A's step 0) and the hand-off (A's last
    evaluation); each entry's ``gain`` is its metrics minus the hand-off's. Written to
    ``<pipeline>/arms/arms.json``.

    The student arm is the policy the pipeline hands on: stage C's last evaluation; after an audit stop, the
    evaluation of C's last good checkpoint (:func:`~flowforge.orchestrate.stages.evaluate_last_good`; the row is left
    out while that checkpoint is not evaluated), or the hand-off's when the stop goes back to stage A's checkpoint
    (no C checkpoint precedes the last verdict that counts). ``source`` says which (``"C"``, ``"last_good"``,
    ``"handoff"``).
    """
    from flowforge.orchestrate.evals import c_checkpoint_step, last_eval, last_good_eval
    from flowforge.orchestrate.stage_trainer import audit_stops, last_good_c_checkpoint, read_audits
    from flowforge.report.run import read_jsonl

    layout = PipelineLayout.of(pcfg)
    rows: dict[str, dict[str, Any]] = {}
    runs: dict[str, Path] = {}  # the run directory whose samples/ hold each row's per-sample scores
    a_eval = layout.a_run / "eval.jsonl"
    if a_eval.is_file():
        evals, _ = read_jsonl(a_eval)
        if evals:
            rows["base"] = evals[0]
            rows["handoff"] = evals[-1]
            runs["base"] = runs["handoff"] = layout.a_run
    sources = {}
    audits = read_audits(layout.c_run)
    if audit_stops(audits):  # stopped: the stop's rule
        good = last_good_c_checkpoint(layout.c_run, audits)
        evaluated = last_good_eval(layout, good)
        if good is None and "handoff" in rows:  # back to stage A's checkpoint: the pipeline hands on A's policy
            rows["student"], sources["student"], runs["student"] = rows["handoff"], "handoff", layout.a_run
        elif evaluated:
            rows["student"], sources["student"] = evaluated, "last_good"
            runs["student"] = layout.last_good_run(c_checkpoint_step(layout, good))
    elif c_eval := last_eval(layout.c_run):
        rows["student"], sources["student"], runs["student"] = c_eval, "C", layout.c_run
    for arm in ARMS:
        found = last_eval(arm_dir(pcfg, arm) / "C") if arm != "student" else {}
        if found:
            rows[arm], sources[arm], runs[arm] = found, "C", arm_dir(pcfg, arm) / "C"
    handoff = rows.get("handoff", {})
    table = {}
    for name, row in rows.items():
        metrics = {k: v for k, v in row.items() if k.startswith("eval/") and isinstance(v, (int, float))}
        gain = {k: v - handoff[k] for k, v in metrics.items() if isinstance(handoff.get(k), (int, float))}
        table[name] = {"step": row.get("step"), "metrics": metrics, "gain": gain,
                       "gain_se": _paired_se(runs, rows, "handoff", name, gain)}
        if name in sources:
            table[name]["source"] = sources[name]
    for other in ("proxy", "teacher"):  # what the user asks: did the student beat the arm without it?
        if "student" in rows and other in rows:
            diff = {k: v - table[other]["metrics"][k] for k, v in table["student"]["metrics"].items()
                    if k in table[other]["metrics"]}
            table["student"].setdefault("versus", {})[other] = {
                "diff": diff, "se": _paired_se(runs, rows, other, "student", diff)}
    out = layout.root / ARMS_DIR / ARM_TABLE_FILE
    if out.parent.is_dir():
        write_bytes(out, (json.dumps(table, indent=1, sort_keys=True) + "\n").encode("utf-8"))
    return table


def _paired_se(runs: dict[str, Path], rows: dict[str, dict[str, Any]], start: str, end: str,
               keys: dict[str, float]) -> dict[str, float | None]:
    """``{metric: SE of rows[end] - rows[start]}`` for each metric of ``keys``, paired over the held-out prompts
    (:func:`flowforge.report.verdict.change_se`) from the per-sample scores beside each evaluation's grid
    (``<run>/samples/step_<n>.png``); None where a row has no such scores (a metric that is no per-sample score,
    or an evaluation written before they were kept) or the two evaluations did not score the same prompts (no
    pairing: no paired error bar)."""
    from flowforge.report.run import find_grids
    from flowforge.report.verdict import change_se, eval_points

    out: dict[str, float | None] = {}
    if start not in runs or end not in runs or rows[start].get("step") is None or rows[end].get("step") is None:
        return {k: None for k in keys}
    steps = {n: int(rows[n]["step"]) for n in (start, end)}
    grids = {n: [g for g in find_grids(runs[n]) if g[0] == steps[n]] for n in (start, end)}
    for key in keys:
        a, b = (eval_points(grids[n], key).get(steps[n]) for n in (start, end))
        se, paired = change_se(a, b) if a is not None and b is not None else (None, False)
        out[key] = se if paired and se == se else None  # NaN (fewer than 2 prompts) or unpaired: no error bar
    return out


def format_arm_table(table: dict[str, Any]) -> str:
    """The arm table as text: one row per arm, one column per eval metric (the value, then the gain over the
    hand-off ± its paired standard error in brackets), then the student's differences from the other arms."""
    metrics = sorted({k for row in table.values() for k in row["metrics"]})
    if not metrics:
        return "no evaluation yet"

    def change(value: float | None, se: float | None) -> str:
        return "" if value is None else f" ({value:+.4f}" + ("" if se is None else f" ± {se:.4f}") + ")"

    head = ["arm", "step", *[m.removeprefix("eval/") for m in metrics]]
    lines = ["  ".join(f"{h:>24}" for h in head)]
    for name, row in table.items():
        source = row.get("source")
        cells = [name if source in (None, "C") else f"{name} ({source})",
                 "-" if row["step"] is None else str(int(row["step"]))]
        for m in metrics:
            v, g = row["metrics"].get(m), row["gain"].get(m)
            cells.append("-" if v is None else f"{v:.4f}" + ("" if name in ("handoff", "base")
                                                               else change(g, row.get("gain_se", {}).get(m))))
        lines.append("  ".join(f"{c:>24}" for c in cells))
    for name, row in (table.get("student", {}).get("versus") or {}).items():
        cells = [f"student - {name}", "", *[change(row["diff"].get(m), row["se"].get(m)).strip(" ()") or "-"
                                            for m in metrics]]
        lines.append("  ".join(f"{c:>24}" for c in cells))
    return "\n".join(lines)
