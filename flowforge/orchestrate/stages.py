"""The three-stage pipeline: teacher-judge RL (A) -> student reward model (B) -> student-reward RL (C).

::

    <pipeline>/                      run.output_dir / run.name of the pipeline config (every path below is named
                                     by flowforge.orchestrate.directory.PipelineLayout)
      pipeline.json                  the marker that makes it a pipeline directory: only the pipeline writes here
                                     (the shared write rule, flowforge.runtime.write_guard)
      conditions.jsonl               the condition ledger: one seeded pass, budgets, extensions, states
      judge.token                    bearer token of the judge servers the pipeline starts (0600)
      teacher/requests.log           every request the auto-started teacher received (one key per line)
      teacher/scorer_options.yaml    its scorer's options (teacher.scorer_options), passed as --options
      A/                             stage A run directory: RL with the teacher; A/judge/ledger.sqlite + media
      B/attempt_<n>/                 stage B: the student trained on A's judged groups (n = extensions so far),
                                     gate.json: held-out agreement, the gate's verdict and the student's path
                                     (relative to the pipeline directory: the directory may be moved or copied)
      C/                             stage C run directory: RL with the student, audit.jsonl, audit/judge/ (the
                                     teacher's audit ledger)
      summary.json, report.html      the pipeline report (flowforge.orchestrate.report)

Stage A trains ``budget_A / M`` steps on the first ``budget_A`` conditions of the pass with ``vlm_judge`` pointed at
the teacher. Stage B reads A's judged groups (only the groups of conditions A judged: held-out eval prompts never
reach the student), splits them 80/10/10 by the pass's clusters, trains the student
(:func:`flowforge.reward_model.train.train_student`: epochs chosen on ``val``) and gates it on ``test`` only, with
thresholds a random student must fail (:func:`flowforge.reward_model.gate.gate_on_test`) and, with
``student.gate.min_spearman_above_baselines``, a margin over its baselines. A failed gate stops the
pipeline with the reasons, or with ``stages.on_gate_fail: extend`` moves ``extend_delta`` conditions from C to A
(:meth:`ConditionLedger.extend_a <flowforge.orchestrate.ledger.ConditionLedger.extend_a>`, recorded once per gate
attempt), continues A and retrains the student in a new attempt directory, until the gate passes or the cap is
reached. Stage C resumes A's last checkpoint in its own run directory (the trainer's step, policy, optimizer and
old-policy continue) and trains on the rest of the pass with the student as the reward; audits
(:class:`~flowforge.orchestrate.stage_trainer.Auditor`) may stop it, naming the last good checkpoint.

Resume: every stage continues from what it committed -- A and C through ``train.resume=auto`` (C's first start:
A's last checkpoint), B through the student trainer's per-epoch checkpoints; the condition ledger replays a
resumed step's conditions, the judges' request ledgers answer every request already answered, so a rerun of the
same command after ``kill -9`` continues without handing out a condition or sending a teacher request twice.
Whether a stage is done is read from its files (checkpoints, ``gate.json``, ``audit.jsonl``), never from a state
file that could disagree with them.

Under ``torchrun --nproc_per_node N -m flowforge.cli stages CONFIG`` stages A and C train data-parallel on N ranks
(each rolls out and trains its share of every step, as ``flowforge train`` does) and everything with one writer
stays on rank 0: the pipeline directory's lock, the judge servers (started once, their address and token shared
with the other ranks), every teacher and student request and its request ledger (``vlm_judge`` is a
``single_client`` group scorer: the other ranks' candidates travel to rank 0 and their scores back, so each group is
judged once), the audits, the condition ledger (the other ranks hold a read-only mirror that applies the same
records in memory: :class:`~flowforge.orchestrate.ledger.ConditionLedger` with ``writer=False``), the reports and
stage B (the student trains on rank 0 while the other ranks wait for its gate record, up to
:data:`RANK_WAIT_S`). Every decision read from files (is a stage done, where C resumes, the audit stop) is taken on
rank 0 and broadcast, so every rank takes the same path through the collectives. A kill of any rank ends the job
(torchrun stops the others); rerunning the same command resumes as above, from the committed checkpoints and the
ledgers' recorded answers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flowforge.data.prompts import load_prompts
from flowforge.demo.paths import resolve_demo_path
from flowforge.orchestrate.config import JUDGE, SCALAR_HEAD_SCORER, stage_config
from flowforge.orchestrate.directory import (PipelineLayout, check_pipeline_dir, mark_pipeline_dir, record_path,
                                            student_dir)
from flowforge.orchestrate.budget import teacher_cap
from flowforge.orchestrate.endpoints import Endpoints, is_main, on_main
from flowforge.orchestrate.ledger import ConditionLedger, conditions_from_records
from flowforge.orchestrate.plan import prompts_per_step, stage_steps
from flowforge.orchestrate.servers import pipeline_token
from flowforge.rewards.judge.ledger import BudgetExhausted, adopt_answers
from flowforge.runtime import distributed as dist_lib
from flowforge.runtime.durable import write_bytes
from flowforge.runtime.errors import UserError
from flowforge.runtime.lock import RunLock
from flowforge.settings.schema import flatten, parse_overrides
from flowforge.train.checkpoint import committed_checkpoints, step_of

log = logging.getLogger("flowforge")

STAGES = ("A", "B", "C")
RANK_WAIT_S = 6 * 3600.0
"""Under torchrun: how long a rank waits in a collective for the others (stage B trains on rank 0 meanwhile)."""


@dataclasses.dataclass
class Outcome:
    """How a pipeline invocation ended: ``status`` is ``done`` (stage C finished: the pipeline is), ``partial``
    (``--stage A`` / ``--stage B`` finished; the later stages have not run), ``gate_failed``, ``audit_stopped``,
    ``unaudited_stopped`` (more audited steps than ``audit.max_unaudited`` the teacher could not order) or
    ``budget_exhausted`` (``teacher.max_requests`` would have been exceeded); ``reason`` says why it stopped;
    ``last_good`` is the checkpoint to use after an audit stop; ``stages_run`` the stages this invocation ran (in
    order; a stage B attempt counts once)."""

    status: str
    reason: str = ""
    last_good: str | None = None
    stages_run: list[str] = dataclasses.field(default_factory=list)


def open_ledger(pcfg: Any, *, writer: bool = True) -> ConditionLedger:
    """The pipeline's condition ledger over the rows of ``data.prompts`` (created on the first run); ``writer=False``:
    a read-only mirror of it (the ranks other than 0 under torchrun).

    Raises:
        ValueError: the ledger was made for another prompt file, seed or budget; rows without unique sample ids.
    """
    return open_ledger_at(pcfg, PipelineLayout.of(pcfg).conditions, writer=writer)


def stage_a_groups(pcfg: Any, ledger: ConditionLedger) -> list[Any]:
    """The judged groups stage B trains and gates on (:class:`~flowforge.reward_model.data.JudgedGroup`): each answered
    group of stage A's request ledger whose condition ``ledger`` marks judged in A, clustered by ``ledger``; the last
    answer of a condition wins.

    Raises:
        ValueError: stage A has judged nothing yet.
    """
    from flowforge.reward_model.data import read_judged_groups

    judged = set(ledger.with_state("judged", "A"))
    source = PipelineLayout.of(pcfg).a_judge_ledger
    if not judged or not source.is_file():
        raise ValueError(f"no judged stage-A group in {source}; run stage A first")
    groups = read_judged_groups(source, ledger.clusters())
    return list({g.condition_id: g for g in groups if g.condition_id in judged}.values())


def open_ledger_at(pcfg: Any, path: Path, *, writer: bool = True) -> ConditionLedger:
    """The condition ledger at ``path`` over the rows of ``data.prompts`` with the pipeline's seed and budgets (the
    pipeline's own, or a control arm's: :mod:`flowforge.orchestrate.arms`).

    Raises:
        ValueError: as :func:`open_ledger`.
    """
    records = load_prompts(resolve_demo_path(pcfg.data.prompts))
    s = pcfg.stages
    return ConditionLedger(path, conditions_from_records(records), seed=s.seed, n_a=s.n_a,
                           extend_delta=s.extend_delta, extend_cap=s.extend_cap or None, writer=writer)


def a_steps(pcfg: Any, ledger: ConditionLedger) -> int:
    """Stage A's trainer steps: ``budget_A // M_A``, at most an override's ``train.steps``
    (:func:`flowforge.orchestrate.plan.stage_steps`)."""
    return stage_steps(pcfg, "A", ledger.budget("A"))


def c_steps(pcfg: Any, ledger: ConditionLedger) -> int:
    """Stage C's trainer steps: ``budget_C // M_C``, at most ``stages.c_steps`` and an override's ``train.steps``
    (:func:`flowforge.orchestrate.plan.stage_steps`)."""
    return stage_steps(pcfg, "C", ledger.budget("C"), start=a_steps(pcfg, ledger))


def newest_step(run_dir: Path) -> int:
    """The step of the newest committed checkpoint of ``run_dir`` (-1: none)."""
    found = committed_checkpoints(run_dir)
    return step_of(found[-1]) if found else -1


# ------------------------------------------------------------------------------------------------ stage A
def run_stage_a(pcfg: Any, ledger: ConditionLedger, endpoints: Endpoints, *, progress: bool = True) -> Path:
    """Train stage A up to its current budget (nothing when its last checkpoint is already there)."""
    from flowforge.orchestrate.stage_trainer import stage_trainer
    from flowforge.report.run import REPORT_FILE as RUN_REPORT_FILE, write_report

    steps = a_steps(pcfg, ledger)
    run_dir = PipelineLayout.of(pcfg).a_run
    if on_main(lambda: newest_step(run_dir) == steps):
        if not ledger.with_state("judged", "A"):  # finished by a version that trained on with a silent teacher
            raise UserError("stage A", f"{run_dir} finished without a single judged group (the teacher was "
                                       "unreachable or gave no marks throughout)",
                            f"move it aside (mv {run_dir} {run_dir}.unjudged) and rerun the same command: stage A "
                            "runs again on the same conditions (the condition ledger replays its steps)")
        if is_main() and not (run_dir / RUN_REPORT_FILE).is_file():
            write_report(run_dir)
        return run_dir
    layout = PipelineLayout.of(pcfg)  # A spends first; a gate extension after the audits / an arm spent shares
    teacher = {**endpoints.teacher(),
               "max_billed": on_main(lambda: teacher_cap(pcfg, layout.a_judge_ledger, "stage A"))}
    reward = {"weights": {JUDGE: 1.0}, "options": {JUDGE: teacher}}
    cfg = stage_config(pcfg, "A", steps=steps, reward=reward)
    log.info("stage A: %d steps on %d conditions (teacher %s)", steps, ledger.budget("A"), reward["options"][JUDGE]
             ["base_url"])
    _train(stage_trainer(cfg, ledger=ledger, stage="A", reward_name=JUDGE, progress=progress))
    return run_dir


def _train(trainer: Any) -> None:
    """``trainer.train()``; on a stop (an audit, the spent budget) its log and lock are closed before it is raised."""
    try:
        trainer.train()
    except BaseException:
        if trainer.logger is not None:
            trainer.logger.close()
        trainer.close()
        raise


# ------------------------------------------------------------------------------------------------ stage B
def run_stage_b(pcfg: Any, ledger: ConditionLedger) -> dict[str, Any]:
    """Train (or reload) the student of the current attempt on A's judged groups and gate it; the gate record
    (also written to ``B/attempt_<n>/gate.json``, with the ``student.gate`` values it was judged under as
    ``gate_config``).

    Raises:
        ValueError: stage A has judged nothing yet.
        UserError: the attempt's ``gate.json`` was judged under other ``student.gate`` values than the config's.
    """
    from flowforge.reward_model.baselines import baseline_reasons, baselines_on_test, constant_mark, judges_on_test
    from flowforge.reward_model.data import split_groups
    from flowforge.reward_model.gate import gate_on_test
    from flowforge.reward_model.students import load_student
    from flowforge.reward_model.train import train_student

    attempt = len(ledger.extensions)
    layout = PipelineLayout.of(pcfg)
    out, gate = layout.attempt(attempt), layout.gate_file(attempt)
    thresholds = json.loads(json.dumps(dataclasses.asdict(pcfg.student.gate)))  # as a JSON record holds them
    if gate.is_file():
        record = json.loads(gate.read_text())
        changed = sorted(k for k, v in record.get("gate_config", thresholds).items() if thresholds.get(k) != v)
        if changed:  # a verdict is never re-read under other thresholds: it would pass or fail what it never judged
            raise UserError(layout.relative(gate), "judged under other student.gate values: " + ", ".join(
                f"{k}={record['gate_config'][k]!r} (now {thresholds.get(k)!r})" for k in changed),
                "restore them, or run the changed gate in a new pipeline directory (run.name)")
        return record
    groups = stage_a_groups(pcfg, ledger)
    s = pcfg.student
    log.info("stage B: training a %s student on %d judged groups (attempt %d)", s.kind, len(groups), attempt)
    clusters = sorted(set(ledger.clusters().values()))  # every cluster of the pass: an exact 80/10/10 of them
    result = train_student(s, groups, out, clusters=clusters)
    splits = split_groups(groups, s.split_seed, s.split, clusters)
    ledger.mark("used_for_rm", [g.condition_id for g in splits["train"]], stage="B", step=attempt,
                policy_version=0)
    # judged on the test split only: validation chose the epoch (train_student), test selects nothing
    constant = constant_mark(splits["train"])
    verdict = gate_on_test(load_student(result.student_dir, device=s.device), splits["test"], s.gate,
                           constant=constant)
    rows = {r.metadata["sample_id"]: r.metadata for r in load_prompts(resolve_demo_path(pcfg.data.prompts))}
    baselines = baselines_on_test(s, splits["test"], constant=constant, metadata=rows)
    judges = judges_on_test(pcfg.eval.scorers, splits["test"], tie_margin=s.gate.tie_margin, metadata=rows,
                            options=pcfg.reward.options)
    reasons = verdict["reasons"] + baseline_reasons(verdict["test"], baselines, s.gate.min_spearman_above_baselines)
    passed = verdict["passed"] and not reasons
    record = {"attempt": attempt, "student": record_path(layout.root, result.student_dir),
              "groups": len(groups),
              "split_sizes": result.split_sizes, "best_epoch": result.best_epoch, "val": result.val,
              "test": verdict["test"], "held_out": verdict["test"], "null": verdict["null"],
              "probes": verdict["probes"], "baselines": baselines, "eval_judges": judges,
              "constant_mae": verdict.get("constant_mae"), "passed": passed, "reasons": reasons,
              "budget_a": ledger.budget("A"), "gate_config": thresholds}
    write_bytes(gate, json.dumps(record, indent=1, default=float).encode())
    return record


# ------------------------------------------------------------------------------------------------ stage C
def last_good_checkpoint(pcfg: Any, ledger: ConditionLedger, audits: list[dict[str, Any]]) -> str:
    """The newest committed checkpoint (of C, else A's last) at or before the last passed audit's step. After a
    failed pooled verdict (``audit.pool_groups``) only audits before the earliest step it pooled count: those steps'
    groups failed it together, so a verdict that passed on some of them (the step where the student went bad and
    a good step's groups) is not trusted."""
    from flowforge.orchestrate.stage_trainer import last_good_c_checkpoint

    start = a_steps(pcfg, ledger)
    layout = PipelineLayout.of(pcfg)
    good = last_good_c_checkpoint(layout.c_run, audits)
    return str(good if good is not None and step_of(good) > start else layout.a_checkpoint(start))


def audit_outcome(pcfg: Any, ledger: ConditionLedger) -> Outcome | None:
    """The audit stop recorded in ``C/audit.jsonl``, or None."""
    from flowforge.orchestrate.stage_trainer import audit_stops, read_audits

    audits = read_audits(PipelineLayout.of(pcfg).c_run)
    stops = audit_stops(audits)
    if not stops:
        return None
    status = "unaudited_stopped" if stops[0].get("stop") == "unaudited" else "audit_stopped"
    return Outcome(status, f"audit at step {stops[0]['step']}: {'; '.join(stops[0]['reasons'])}",
                   last_good_checkpoint(pcfg, ledger, audits))


def _student_reward(pcfg: Any, endpoints: Endpoints, student_dir: Path) -> tuple[dict[str, Any], str]:
    if pcfg.stages.student_serving == "in_process":
        return {"weights": {SCALAR_HEAD_SCORER: 1.0},
                "options": {SCALAR_HEAD_SCORER: {"path": str(student_dir)}}}, SCALAR_HEAD_SCORER
    return {"weights": {JUDGE: 1.0}, "options": {JUDGE: endpoints.student(student_dir)}}, JUDGE


def stage_c_changes(pcfg: Any) -> tuple[str, ...]:
    """What stage C's config changes on purpose against stage A's checkpoint, which its first start resumes: the
    reward (the student replaces the teacher), ``train.steps`` (C continues A's count) and every key of
    ``stages.a_overrides`` / ``stages.c_overrides``. Its resume warns only about other differences."""
    keys = {"reward", "train.steps"}
    for overrides in (pcfg.stages.a_overrides, pcfg.stages.c_overrides):
        keys.update(flatten(parse_overrides(overrides)[0]))
    return tuple(sorted(keys))


def run_stage_c(pcfg: Any, ledger: ConditionLedger, endpoints: Endpoints, student_dir: Path, *,
                progress: bool = True) -> Outcome:
    """Train stage C on the rest of the pass with the student as the reward, audited by the teacher."""
    from flowforge.orchestrate.stage_trainer import AuditStop, Auditor, stage_trainer
    from flowforge.rewards.registry import build_scorer

    stopped = on_main(lambda: audit_outcome(pcfg, ledger))
    if stopped is not None:
        return stopped
    start, steps = a_steps(pcfg, ledger), c_steps(pcfg, ledger)
    layout = PipelineLayout.of(pcfg)
    run_dir = layout.c_run
    newest = on_main(lambda: newest_step(run_dir))
    if steps == 0 or newest == start + steps:
        return Outcome("done", "" if steps else "the pass has no conditions left for stage C")
    a_last = layout.a_checkpoint(start)
    resume = "auto" if newest > start else str(a_last)
    reward, name = _student_reward(pcfg, endpoints, student_dir)
    cfg = stage_config(pcfg, "C", steps=start + steps, reward=reward, resume=resume)
    auditor = None
    if pcfg.audit.first_groups > 0 or pcfg.audit.every > 0:
        # the teacher arm (flowforge.orchestrate.arms) may have paid for these groups already: answered, not resent
        on_main(lambda: adopt_answers(layout.audit_judge_ledger, layout.arm_judge_ledger("teacher")))
        try:  # the audits spend what A (and an arm) left of max_requests
            left = on_main(lambda: teacher_cap(pcfg, layout.audit_judge_ledger, "stage C's audits"))
        except BudgetExhausted as exc:
            return Outcome("budget_exhausted", str(exc))
        teacher = build_scorer(JUDGE, run_dir=layout.audit_dir, **endpoints.teacher(), max_billed=left)
        auditor = Auditor(teacher, pcfg.audit, first_step=start, end_step=start + steps,
                          prompts_per_step=prompts_per_step(pcfg, "C"), run_dir=run_dir)
        from flowforge.orchestrate.thresholds import record_audit_design

        on_main(lambda: record_audit_design(pcfg, run_dir))
    log.info("stage C: steps %d..%d on %d conditions, student %s", start, start + steps, ledger.budget("C"),
             student_dir)
    trainer = stage_trainer(cfg, ledger=ledger, stage="C", reward_name=name, auditor=auditor, progress=progress,
                           expected_changes=stage_c_changes(pcfg))
    try:
        _train(trainer)
    except AuditStop as stop:
        log.warning("stage C stopped: %s", stop)
        return on_main(lambda: audit_outcome(pcfg, ledger)) or Outcome(
            "unaudited_stopped" if stop.record.get("stop") == "unaudited" else "audit_stopped", str(stop))
    return Outcome("done")


def evaluate_last_good(pcfg: Any, endpoints: Endpoints, student_dir: Path, outcome: Outcome) -> dict[str, float]:
    """After an audit stop (``outcome.last_good`` set): the held-out evaluation of that checkpoint -- the policy the
    pipeline hands on -- in :meth:`PipelineLayout.last_good_run` of its step (its ``eval.jsonl`` and sample grid; the
    same eval as every stage's end: fixed noise, the independent scorers, the student's reward; never the teacher).
    Returns the scalars on rank 0 (``{}`` on the others); ``{}`` when the last good checkpoint is stage A's (the
    hand-off: A's last evaluation is its evaluation) or none. An evaluation of that checkpoint done before is read,
    not repeated. A failure is logged, not raised: the stop and its report come first. Every rank calls it (the
    samples are generated on all)."""
    from flowforge.orchestrate.evals import c_checkpoint_step, last_eval
    from flowforge.train.trainer import Trainer

    layout = PipelineLayout.of(pcfg)
    step = c_checkpoint_step(layout, outcome.last_good)
    if step is None:
        return {}
    run_dir = layout.last_good_run(step)
    done = on_main(lambda: last_eval(run_dir))
    if done:
        return done
    try:
        reward, _ = _student_reward(pcfg, endpoints, student_dir)
        cfg = stage_config(pcfg, "C", steps=step, reward=reward, resume=str(outcome.last_good),
                           output_dir=run_dir.parent)
        log.info("stage C stopped: evaluating its last good checkpoint (step %d) in %s", step, run_dir)
        trainer = Trainer(cfg, progress=False, own_area=layout.root, expected_resume_changes=stage_c_changes(pcfg))
        try:
            return trainer.evaluate(step)
        finally:
            if trainer.logger is not None:
                trainer.logger.close()
            trainer.close()
    except Exception as exc:  # noqa: BLE001 -- the stop is the result; its evaluation is an extra
        log.warning("the evaluation of the last good checkpoint %s failed (%s); rerun the pipeline to retry",
                    outcome.last_good, exc)
        return {}


# ------------------------------------------------------------------------------------------------ the pipeline
def _a_and_b(pcfg: Any, ledger: ConditionLedger, endpoints: Endpoints, stage: str | None,
             progress: bool, ran: list[str]) -> tuple[dict[str, Any] | None, Outcome | None]:
    """Stages A and B with the gate's extension loop: ``(passed gate record or None, outcome when stopped or when
    ``stage`` is done)``; appends each stage it runs to ``ran``."""
    while True:
        if stage in (None, "A"):
            run_stage_a(pcfg, ledger, endpoints, progress=progress)
            ran.append("A")
            if stage == "A":
                return None, Outcome("partial", "ran stage A only: run --stage B, then --stage C")
        elif on_main(lambda: newest_step(PipelineLayout.of(pcfg).a_run)) != a_steps(pcfg, ledger):
            raise ValueError(f"stage {stage} needs stage A finished ({a_steps(pcfg, ledger)} steps); run "
                             "`flowforge stages CONFIG --stage A` (or without --stage) first")
        record = on_main(lambda: run_stage_b(pcfg, ledger))  # the student trains on rank 0 (one writer)
        ran.append("B")
        ledger.refresh()  # a mirror takes up what stage B recorded on rank 0
        if record["passed"]:
            return record, Outcome("partial", "ran stage B only: run --stage C") if stage == "B" else None
        reason = "quality gate failed: " + "; ".join(record["reasons"])
        if stage is None and pcfg.stages.on_gate_fail == "extend":
            moved = ledger.extend_a(f"gate-{record['attempt']}")
            if moved:
                log.warning("%s; extending stage A by %d conditions (budget %d)", reason, moved,
                            ledger.budget("A"))
                continue
            reason += " (stage A cannot be extended further: the cap or the pass is used up)"
        return None, Outcome("gate_failed", reason)


@contextlib.contextmanager
def pipeline_session(pcfg: Any, inputs: Mapping[str, str | Path] | None = None):
    """Hold the pipeline directory for one invocation: the write rule and the lock (rank 0), the marker, the judge
    token and the condition ledger; yields ``(ledger, endpoints)`` and stops every judge server it started on exit.
    Under torchrun every rank enters it (rank 0 claims; the others get a read-only ledger mirror).

    Raises:
        UserError: the pipeline directory lies inside a run, a checkpoint, the base model or an input.
    """
    dist_lib.init(pcfg.run.device, timeout_s=RANK_WAIT_S)  # torchrun: the group A and C train in (no-op alone)
    layout = PipelineLayout.of(pcfg)
    lock = RunLock(layout.root)

    def claim() -> None:  # rank 0: the write rule, the lock, the marker, the token and the ledger's file
        check_pipeline_dir(pcfg, inputs)
        layout.root.mkdir(parents=True, exist_ok=True)
        lock.acquire()
        mark_pipeline_dir(layout.root)
        pipeline_token(layout.token)
        open_ledger(pcfg)

    endpoints = None
    try:
        on_main(claim)
        endpoints = Endpoints(pcfg, layout)
        yield open_ledger(pcfg, writer=is_main()), endpoints
    finally:
        if endpoints is not None:
            endpoints.close()
        if is_main():
            lock.release()


def run_pipeline(pcfg: Any, *, stage: str | None = None, progress: bool = True,
                 inputs: Mapping[str, str | Path] | None = None) -> Outcome:
    """Run the pipeline (every stage, or only ``stage``), then write its report. Holds the pipeline directory's
    lock throughout (a second process is refused). ``inputs`` (label -> path, e.g. the config file) may not hold
    the pipeline directory (:func:`check_pipeline_dir`). Under torchrun every rank calls it (module docstring:
    rank 0 holds the lock, the servers, the ledgers and the reports).

    Raises:
        ValueError: an unknown stage; a stage whose predecessor has not finished; ledger mismatches.
        UserError: the pipeline directory lies inside a run, a checkpoint, the base model or an input.
    """
    from flowforge.orchestrate.report import write_pipeline_report

    if stage is not None and stage not in STAGES:
        raise ValueError(f"--stage must be one of {list(STAGES)}, got {stage!r}")
    with pipeline_session(pcfg, inputs) as (ledger, endpoints):
        record, outcome, ran = None, None, []
        try:
            if stage != "C":
                record, outcome = _a_and_b(pcfg, ledger, endpoints, stage, progress, ran)
            else:
                record = on_main(lambda: _passed_gate(pcfg, ledger))
            if outcome is None and stage in (None, "C"):
                ran.append("C")
                student = Path(on_main(lambda: str(student_dir(pcfg, record))))
                outcome = run_stage_c(pcfg, ledger, endpoints, student, progress=progress)
                if outcome.status in ("audit_stopped", "unaudited_stopped"):
                    evaluate_last_good(pcfg, endpoints, student, outcome)
        except BudgetExhausted as exc:  # stopped before the budget was exceeded; a rerun with more continues
            log.warning("pipeline stopped: %s", exc)
            outcome = Outcome("budget_exhausted", str(exc))
        outcome = outcome or Outcome("done")
        outcome.stages_run = list(dict.fromkeys(ran))  # A and B repeat when the gate extends A
        if is_main():
            write_pipeline_report(pcfg, ledger, outcome)
        return outcome


def _passed_gate(pcfg: Any, ledger: ConditionLedger) -> dict[str, Any]:
    path = PipelineLayout.of(pcfg).gate_file(len(ledger.extensions))
    record = json.loads(path.read_text()) if path.is_file() else None
    if record is None or not record["passed"]:
        raise ValueError(f"stage C needs a student that passed the quality gate ({path}); run stage B first")
    return record
