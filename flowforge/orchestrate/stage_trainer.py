"""The trainers of stages A and C: the ordinary :class:`~flowforge.train.trainer.Trainer`, composed with the
pipeline's prompt source and step hooks (:mod:`flowforge.train.seams`); no method of it is overridden.

:func:`stage_trainer` plugs in:

1. **prompts** -- :class:`LedgerPrompts`: the K-repeat sampler still fixes the step's layout (candidate ids, which
   seed each candidate's noise; group ids; the training order), but the ``M`` prompts are the next ``M`` conditions
   of the ledger's one pass (:meth:`ConditionLedger.take <flowforge.orchestrate.ledger.ConditionLedger.take>`,
   recorded for the trainer's step before the rollout; a resumed step gets the same conditions back); the
   conditions are marked ``rolled_out`` after the rollout, ``judged`` for the groups the reward scored (not NaN)
   and ``trained_on`` with the policy version after the update (the optimizer steps so far), unless the step was
   skipped. A stage A whose teacher judged none of a step's groups nor any before stops (:func:`nothing_judged`);
2. **judges bound to the step** -- :class:`~flowforge.train.seams.BindScorers`
   (:meth:`VLMJudge.bind <flowforge.rewards.judge.client.VLMJudge.bind>`: stage, ``train`` / ``eval``, step,
   policy version), so a resumed step re-uses the recorded answers of its groups even when its media are
   re-generated, and the evaluation's requests are recorded as the stage's ``eval``;
3. **audits** (stage C) -- :class:`AuditHook`: an :class:`Auditor` has the teacher re-judge the step's groups when an
   audit is due, after scoring and before the update.

What every run does anyway (:mod:`flowforge.train.seams`): a group whose weighted reward is NaN (the judge gave it no
marks after its bounded attempts, or its answer was lost in a crash) is dropped -- advantage 0 and its rows left out
of the update (zero weight), counted as ``reward/judge_failed_groups``; a step with no usable group is skipped.
Evaluation never calls a paid judge (a scorer with ``paid = True``: the teacher) unless ``eval.teacher_groups`` asks
for it: then it scores the groups of the first that many held-out prompts, billed against the budget
(:class:`~flowforge.rewards.processor.RewardProcessor`, ``paid_groups``).

Audits (:class:`Auditor`): the teacher scores every group of an audited step; agreement with the student's scores of
the same candidates (:func:`flowforge.reward_model.evaluate.agreement`: within-group Spearman, pairwise accuracy,
MAE) is logged as ``audit/<metric>`` in ``metrics.jsonl`` and appended to ``audit.jsonl`` in the run directory. An
audit below ``audit.min_spearman`` or ``audit.min_pairwise_accuracy`` raises :class:`AuditStop` before the step's
update, so the stage ends without training on the student's verdict. With ``audit.pool_groups: N`` a verdict is
taken once ``N`` audited groups gathered since the last verdict (this step's and those of the pending audits before
it, read back from ``audit.jsonl``, which keeps each group's two score vectors); every group counts toward one
verdict only, none is reused by a later one: one step's ``M`` groups measure a student's agreement with a standard
error of ~0.15 in Spearman, too noisy to tell a good student from one at the gate's bar. Until then the record is
``pending`` (``verdict: pending``, ``passed: null``): no verdict, no stop, and not a passed audit for the last good
checkpoint. With ``audit.closing`` (the default) C's last steps are audited too, enough for one pool, and C's
last step takes the *closing* verdict on every orderable group gathered since the last verdict however many
(``closing: true``); before it a full pool of the window that fails stops C at once, one that passes stays pending
and joins the closing verdict. So the policy C hands on is trained only on steps a verdict covers: a run that ends
``done`` passed a verdict at its last step. A last step with nothing the teacher could order since the last verdict
stops C (``stop: unaudited``); a last step whose own groups it cannot order takes the closing verdict on the
window's other groups (recorded ``unaudited: true``, without spending the budget's stop). ``flowforge check``
states a verdict's size and power (:func:`flowforge.orchestrate.thresholds.audit_design`). With
``audit.tie_margin`` teacher marks that close are ties (its retest noise): only groups the teacher can order at all
count toward the ``N`` (a group whose marks all tie is kept in ``audit.jsonl`` but judges
nothing); a step none of whose answered groups the teacher can order is *unaudited* (``unaudited: true``), and
the ``audit.max_unaudited + 1``-th such step stops the stage (``stop: unaudited``).

Each record keeps the verdict (``passed`` / ``failed`` / ``pending``), the agreement of the verdict's groups with
the tie margin (``spearman``, ``pairwise_accuracy``) and without it (``spearman_raw``, ``pairwise_accuracy_raw``),
the teacher-ordered pairs it compared (``pairs_compared``; ``pairs_compared_raw`` without the margin) and the pairs
the margin tied (``pairs_tied``), and the step's own agreement (``step_*``).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

from flowforge.orchestrate.directory import AUDIT_FILE
from flowforge.orchestrate.ledger import ConditionLedger
from flowforge.reward_model.evaluate import agreement, tie_blocks
from flowforge.runtime.distributed import all_gather_objects, broadcast_from_main, portable_error
from flowforge.runtime.durable import fsync_path
from flowforge.runtime.errors import UserError
from flowforge.train.seams import BindScorers, StepHook, bind_scorers
from flowforge.train.trainer import StepBatch, Trainer

log = logging.getLogger("flowforge")


class AuditStop(Exception):
    """An audit stops stage C at ``step`` (``record`` is the audit's line; ``record["stop"]``: ``agreement``, the
    student below a threshold, or ``unaudited``, the budget of steps the teacher could not order is spent)."""

    def __init__(self, step: int, record: dict[str, Any]) -> None:
        super().__init__(f"audit at step {step}: {'; '.join(record['reasons'])}")
        self.step, self.record = step, record


def read_audits(run_dir: Path) -> list[dict[str, Any]]:
    """The audit records of a stage-C run directory, one per audited step (a step audited again after a resume
    keeps its first record)."""
    path = Path(run_dir) / AUDIT_FILE
    if not path.is_file():
        return []
    out: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a torn last line after a crash
            continue
        out.setdefault(record["step"], record)
    return [out[s] for s in sorted(out)]


class Auditor:
    """Teacher audits of stage C (module docstring).

    Args:
        judge: the teacher as a group scorer (``score_groups``, ``pop_metrics``:
            :class:`flowforge.rewards.judge.client.VLMJudge`, its ledger under the C run directory).
        audit: the ``audit`` section. first_step: stage C's first trainer step. end_step: one past its last (the
        closing verdict's step is ``end_step - 1``). prompts_per_step: ``M``.
        run_dir: stage C's run directory (``audit.jsonl``).
    """

    def __init__(self, judge: Any, audit: Any, *, first_step: int, end_step: int, prompts_per_step: int,
                 run_dir: Path) -> None:
        self.judge, self.cfg, self.first_step, self.end, self.m = judge, audit, first_step, end_step, prompts_per_step
        self.path = Path(run_dir) / AUDIT_FILE

    def due(self, step: int) -> bool:
        """Whether trainer step ``step`` is audited (:meth:`AuditConfig.due
        <flowforge.orchestrate.config.AuditConfig.due>`)."""
        return self.cfg.due(step, first=self.first_step, end=self.end, m=self.m)

    def audit(self, step: int, policy_version: int, media: torch.Tensor, batch: StepBatch,
              student: torch.Tensor) -> dict[str, float]:
        """Audit step ``step``: teacher scores of its groups vs the ``[B]`` student scores ``student`` (rows as
        ``media``). Returns the ``audit/*`` metrics.

        Under ``torchrun`` (a collective: every rank calls it) each rank's rows, in the canonical order of the step,
        are gathered to rank 0, which alone asks the teacher and writes ``audit.jsonl``; its verdict is broadcast,
        so every rank returns the same metrics or raises the same :class:`AuditStop`.

        Raises:
            AuditStop: the agreement is below a threshold (or nothing could be compared).
        """
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return self._audit(step, policy_version, media, batch.records, batch.group_ids, student)
        canonical = torch.argsort(batch.order)  # this rank's rows in the step's canonical order
        mine = (media[canonical.to(media.device)].cpu(), [batch.records[i] for i in canonical.tolist()],
                batch.group_ids[canonical].cpu(), student[canonical.to(student.device)].detach().float().cpu())
        parts = all_gather_objects(mine)  # every rank's share; rank 0 uses them (small: the step's media)
        verdict, error = None, None
        if torch.distributed.get_rank() == 0:
            try:
                verdict = ("passed", self._audit(step, policy_version, torch.cat([p[0] for p in parts]),
                                                 [r for p in parts for r in p[1]], torch.cat([p[2] for p in parts]),
                                                 torch.cat([p[3] for p in parts])))
            except AuditStop as stop:
                verdict = ("stopped", stop.record)
            except Exception as exc:  # e.g. a spent teacher budget: every rank stops alike, none left waiting
                verdict, error = ("error", portable_error(exc)), exc
        kind, value = broadcast_from_main(verdict)
        if error is not None:
            raise error
        if kind == "error":
            raise value
        if kind == "stopped":
            raise AuditStop(step, value)
        return value

    def _audit(self, step: int, policy_version: int, media: torch.Tensor, records: list[Any],
               group_ids: torch.Tensor, student: torch.Tensor) -> dict[str, float]:
        """:meth:`audit` in one process: ``records`` / ``group_ids`` / ``student`` row by row with ``media``."""
        groups = torch.unique(group_ids).tolist()
        rows = [torch.nonzero(group_ids == g).view(-1) for g in groups]
        bind_scorers([self.judge], stage="C", purpose="audit", step=step, policy_version=policy_version)
        requests = [(media[r], [records[i].prompt for i in r.tolist()],
                     [records[i].metadata for i in r.tolist()]) for r in rows]
        teacher = [t.detach().float().cpu() for t in self.judge.score_groups(requests)]
        sent = self.judge.pop_metrics()
        kept = [(student[r].detach().float().cpu(), t) for r, t in zip(rows, teacher, strict=True)
                if not torch.isnan(t).any() and not torch.isnan(student[r]).any()]  # a dropped group: no verdict
        scores = [[s.tolist(), t.tolist()] for s, t in kept]  # per kept group: [student, teacher]
        margin = self.cfg.tie_margin
        own = agreement([s for s, _ in kept], [t for _, t in kept], margin) if kept else {}
        earlier = [a for a in read_audits(self.path.parent) if a["step"] < step]
        pooled, steps = self._pool(step, scores, earlier)
        result, raw = ({}, {}) if not kept else (
            agreement([torch.tensor(s) for s, _ in pooled], [torch.tensor(t) for _, t in pooled], m)
            for m in (margin, 0.0))
        # a step whose groups the teacher answered but cannot order at all is unaudited: no verdict (a teacher that
        # cannot tell the candidates apart cannot tell a good student from a bad one either), but a bounded budget
        unaudited = bool(kept) and step not in steps
        spent = sum(bool(a.get("unaudited")) for a in earlier) + unaudited
        # no verdict while too few orderable groups gathered since the last verdict (an earlier step's groups say
        # nothing of this step's checkpoint); C's last step takes the closing verdict on whatever gathered, so the
        # policy C hands on is never trained past its last verdict
        closing = self.cfg.closing_steps(self.m) > 0 and step == self.end - 1
        pending = bool(kept) and (not pooled if closing else
                                  unaudited or len(pooled) < max(self.cfg.pool_groups, 1))
        reasons, stop = [], None
        if not kept:  # nothing to compare is not agreement: a step the teacher answered none of stops C
            reasons.append(f"the teacher answered none of the {len(groups)} audited groups of step {step}: no "
                           "agreement to measure")
        for metric, bound in (("spearman", self.cfg.min_spearman),
                              ("pairwise_accuracy", self.cfg.min_pairwise_accuracy)):
            value = result.get(metric, math.nan)
            if kept and not pending and not value >= bound:
                reasons.append(f"{metric}={value:.4g} < audit.min_{metric}={bound:g}"
                               + (f" (pooled over {len(pooled)} groups)" if self.cfg.pool_groups else ""))
        if not (pending or reasons or closing) and step >= self.end - self.cfg.closing_steps(self.m):
            pending = True  # a full pool in the closing window that fails stops C now; one that passes waits, and
            # C's last step judges its groups with the rest (and with its own, where the teacher can order them)
        if reasons:
            stop = "agreement"
        elif closing and pending:  # answered, but no group since the last verdict the teacher could order
            stop = "unaudited"
            reasons.append(f"C's last step {step}: the teacher could not order any group audited since the last "
                           f"verdict (marks within audit.tie_margin={margin:g}), so the policy C hands on would have "
                           "no verdict (audit.closing)")
        elif unaudited and spent > self.cfg.max_unaudited and not closing:  # a closing verdict was taken instead
            stop = "unaudited"
            reasons.append(f"the teacher could not order any of the {len(kept)} audited groups (marks within "
                           f"audit.tie_margin={margin:g}) at {spent} audited steps > audit.max_unaudited="
                           f"{self.cfg.max_unaudited}")
        pairs = self._pairs(pooled)
        verdict = "pending" if pending else "failed" if stop == "agreement" else "passed"
        record = {"step": step, "policy_version": policy_version, "groups": len(groups),
                  "teacher_failures": len(groups) - len(kept), "teacher_requests_sent": sent["requests_sent"],
                  "teacher_served_from_ledger": sent["served_from_ledger"],
                  **{k: result.get(k, math.nan) for k in ("spearman", "pairwise_accuracy", "mae")},
                  **{f"{k}_raw": raw.get(k, math.nan) for k in ("spearman", "pairwise_accuracy")},
                  "pairs_compared": int(result.get("pairs", 0)), "pairs_tied": pairs - int(result.get("pairs", 0)),
                  "pairs_compared_raw": int(raw.get("pairs", 0)),
                  **{f"step_{k}": own.get(k, math.nan) for k in ("spearman", "pairwise_accuracy", "mae")},
                  "pooled_groups": len(pooled), "pooled_steps": steps, "closing": closing and not pending,
                  "verdict": verdict, "passed": None if pending else verdict == "passed", "pending": pending,
                  "unaudited": unaudited, "unaudited_steps": spent, "stop": stop, "reasons": reasons,
                  "conditions": sorted({r.metadata["sample_id"] for r in records}), "scores": scores}
        self._append(record)
        if stop is not None:
            raise AuditStop(step, record)
        return {f"audit/{k}": float(record[k]) for k in ("spearman", "pairwise_accuracy", "mae", "groups",
                                                           "teacher_requests_sent", "unaudited_steps")}

    @staticmethod
    def _pairs(groups: list[list[list[float]]]) -> int:
        """All candidate pairs of the ``[student, teacher]`` groups ``groups`` (``K (K - 1) / 2`` each)."""
        return sum(len(g[1]) * (len(g[1]) - 1) // 2 for g in groups)

    def _orderable(self, scores: list[list[list[float]]]) -> list[list[list[float]]]:
        """The ``[student, teacher]`` groups whose teacher marks form more than one tie block (``audit.tie_margin``)."""
        return [g for g in scores if tie_blocks(torch.tensor(g[1]), self.cfg.tie_margin).max() > 0]

    def _pool(self, step: int, scores: list[list[list[float]]],
              earlier: list[dict[str, Any]]) -> tuple[list[list[list[float]]], list[int]]:
        """The groups the verdict of step ``step`` is taken on and their steps, counting only groups the teacher
        can order (:meth:`_orderable`): ``scores``' alone without pooling, else those plus the groups of the
        ``earlier`` audits since the last verdict (pending ones): every group counts toward one verdict only,
        never again in a later one."""
        pooled = self._orderable(scores)
        steps = [step] if pooled else []
        if self.cfg.pool_groups <= 0:
            return pooled, steps
        for record in reversed(earlier):
            if record.get("passed") is not None:  # a verdict was taken on its groups (and those before)
                break
            take = self._orderable(record.get("scores") or [])
            if take:
                pooled.extend(take)
                steps.append(record["step"])
        return pooled, sorted(steps)

    def _append(self, record: dict[str, Any]) -> None:
        new = not self.path.exists()
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        if new:
            fsync_path(self.path.parent)


def nothing_judged(step: int, groups: int, cause: str | None) -> UserError:
    """The error of a stage A whose teacher judged none of a step's ``groups`` groups, nor any earlier group: the
    step stops before it is trained or saved, so its conditions stay the step's (the condition ledger replays them)
    and a rerun retries it -- a stage A that judged nothing is never 'done' (stage B would have nothing to learn)."""
    return UserError("stage A", f"the teacher judged none of the {groups} groups of step {step} and none before "
                                f"({cause or 'no marks after its attempts'})",
                     f"stopped before step {step} was trained or saved, nothing was used up: rerun the same "
                     "command once the teacher answers (teacher.url / teacher.scorer) and stage A retries step "
                     f"{step} with the same conditions")


def every_rank(ids: Any) -> list[str]:
    """``ids`` of every process (rank order, each once, in order of first appearance): under ``torchrun`` every
    rank marks the whole step's conditions in its ledger (rank 0 writes, the others' mirrors apply the same record).
    A collective; ``ids`` deduplicated on one process."""
    return list(dict.fromkeys(i for part in all_gather_objects(list(ids)) for i in part))


class AuditHook(StepHook):
    """Stage C's audits as a step hook: after scoring, when ``auditor`` says the step is due, the teacher re-judges
    the step's groups against the student's scores (component ``reward_name``); the ``audit/*`` metrics join the
    step's, and an audit below a threshold raises :class:`AuditStop` before the update. After each audit (and at the
    first step it sees, for a resumed run) it pins the checkpoint an audit stop would go back to
    (:func:`pin_last_good`): only a verdict can move it."""

    needs = frozenset({"pixels"})  # the teacher is sent the step's media, whatever the student reads

    def __init__(self, auditor: Auditor, reward_name: str) -> None:
        self.auditor, self.reward_name = auditor, reward_name
        self._pinned = False  # pinned since this process started (a resumed run pins from audit.jsonl once)

    def on_scored(self, trainer: Trainer, step: int, batch: StepBatch, media: torch.Tensor,
                  components: dict[str, torch.Tensor], metrics: dict[str, float]) -> None:
        due = self.auditor.due(step)
        if due:
            metrics.update(self.auditor.audit(step, trainer.policy.optimizer_steps, media, batch,
                                              components[self.reward_name].detach().cpu()))
        if due or not self._pinned:
            pin_last_good(trainer)
            self._pinned = True


def audit_stops(audits: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The :func:`read_audits` records that stop stage C: a failed verdict, or an unaudited step past
    ``audit.max_unaudited`` (``passed`` None is a pooled audit still pending: no verdict, no stop)."""
    return [a for a in audits if a["passed"] is False or a.get("stop") == "unaudited"]


def last_good_step(audits: list[dict[str, Any]]) -> int | None:
    """The step of the last passed audit verdict a stop may go back to (:func:`read_audits` records, in order): after
    a failed pooled verdict only verdicts before the earliest step it pooled count (those steps' groups failed it
    together, so a verdict that passed on some of them is not trusted); None when no verdict counts. One rule for
    the stop (:func:`flowforge.orchestrate.stages.last_good_checkpoint`) and the pin (:func:`pin_last_good`)."""
    failed = [a for a in audits if a["passed"] is False]
    suspect = min(failed[0].get("pooled_steps") or [failed[0]["step"]]) if failed else math.inf
    passed = [a["step"] for a in audits if a["passed"] and a["step"] < suspect]
    return max(passed) if passed else None


def last_good_c_checkpoint(run_dir: Path, audits: list[dict[str, Any]]) -> Path | None:
    """The newest committed checkpoint of the run at ``run_dir`` at or before :func:`last_good_step` of its
    ``audits`` (None: no verdict counts, or no checkpoint of the run precedes it)."""
    from flowforge.runtime.run_dir import committed_checkpoints
    from flowforge.train.checkpoint import step_of

    step = last_good_step(audits)
    good = [p for p in committed_checkpoints(run_dir) if step is not None and step_of(p) <= step]
    return good[-1] if good else None


def pin_last_good(trainer: Trainer) -> Path | None:
    """Pin (:meth:`CheckpointManager.pin <flowforge.train.checkpoint.manager.CheckpointManager.pin>`) the run's newest
    committed checkpoint at or before :func:`last_good_step`, so that rotation (``checkpoint.keep``) never deletes the
    checkpoint an audit stop goes back to. While no verdict has failed that is the last passed verdict's, and a later
    failed verdict pools only steps after it (:meth:`Auditor._pool`: every group counts toward one verdict), so the
    stop's last good checkpoint is the pinned one. Read from ``audit.jsonl`` (:func:`last_good_c_checkpoint`), so a
    resumed run pins it again. Returns the pinned checkpoint (None: no verdict counts yet, or no checkpoint of this
    run precedes it). Rank 0 only (it alone rotates)."""
    if not trainer.dist.is_main:
        return None
    good = last_good_c_checkpoint(trainer.run_dir, read_audits(trainer.run_dir))
    trainer.checkpoints.pin(good)
    return good


def condition_ids(batch: StepBatch) -> list[str]:
    """The step's condition ids, each once, in order of first appearance (under ``torchrun``: of every rank's share,
    rank by rank; a collective)."""
    return every_rank(r.metadata["sample_id"] for r in batch.records)


class LedgerPrompts:
    """The pipeline's prompt source (:class:`~flowforge.train.seams.PromptSource`, module docstring): the conditions
    of ``ledger`` for ``stage``; ``reward_name`` is the reward component whose NaN marks a group as not judged."""

    def __init__(self, ledger: ConditionLedger, stage: str, reward_name: str) -> None:
        self.ledger, self.stage, self.reward_name = ledger, stage, reward_name
        self.index: dict[str, int] = {}

    def check(self, trainer: Trainer) -> None:
        """Index the trainer's prompt rows by condition id.

        Raises:
            ValueError: a condition of the ledger is not a row of ``data.prompts`` (another prompt file).
        """
        self.index = {r.metadata.get("sample_id"): i for i, r in enumerate(trainer.train_prompts)}
        missing = [c.id for c in self.ledger.order if c.id not in self.index]
        if missing:
            raise ValueError(f"conditions {missing[:3]} of the ledger are not rows of data.prompts="
                             f"{trainer.cfg.data.prompts!r}; the pipeline's prompt file changed")

    def groups(self, trainer: Trainer, step: int, sampled: torch.Tensor) -> torch.Tensor:
        m = trainer.cfg.data.prompts_per_step
        taken = self.ledger.take(self.stage, m, step=step, policy_version=trainer.policy.optimizer_steps)
        ids = [c.id for c in taken]
        if broadcast_from_main(ids) != ids:  # rank 0 wrote the take; a mirror that disagrees must not train
            raise RuntimeError(f"stage {self.stage} step {step}: this rank's condition ledger took {ids[:3]}..., "
                               "rank 0's another (the ledger file changed under the run)")
        if len(taken) != m:
            raise RuntimeError(f"stage {self.stage} step {step}: the condition ledger had {len(taken)} of the "
                               f"{m} conditions a step needs (budget or pass used up)")
        return torch.tensor([self.index[c.id] for c in taken], dtype=torch.int64)

    def rolled_out(self, trainer: Trainer, step: int, batch: StepBatch) -> None:
        self.ledger.mark("rolled_out", condition_ids(batch), stage=self.stage, step=step,
                         policy_version=trainer.policy.optimizer_steps)

    def scored(self, trainer: Trainer, step: int, batch: StepBatch, components: dict[str, torch.Tensor]) -> None:
        scores = components[self.reward_name].detach().cpu()
        judged = every_rank(r.metadata["sample_id"] for r, s in zip(batch.records, scores.tolist(), strict=True)
                            if not math.isnan(s))
        if judged:
            self.ledger.mark("judged", dict.fromkeys(judged), stage=self.stage, step=step,
                             policy_version=trainer.policy.optimizer_steps)
        elif self.stage == "A" and not self.ledger.with_state("judged", "A"):
            raise nothing_judged(step, trainer.cfg.data.prompts_per_step,
                                 getattr(trainer.rewards.scorers.get(self.reward_name), "last_error", None))

    def trained_on(self, trainer: Trainer, step: int, batch: StepBatch) -> None:
        # before the checkpoint: a crash after it would otherwise never record the step (it is not replayed)
        self.ledger.mark("trained_on", condition_ids(batch), stage=self.stage, step=step,
                         policy_version=trainer.policy.optimizer_steps)


def stage_trainer(cfg: Any, *, ledger: ConditionLedger, stage: str, reward_name: str,
                  auditor: Auditor | None = None, progress: bool = True,
                  expected_changes: tuple[str, ...] = (), own_area: Path | None = None) -> Trainer:
    """A :class:`~flowforge.train.trainer.Trainer` whose prompts come from ``ledger`` for ``stage`` (module
    docstring).

    Args:
        cfg: the stage's run config (:func:`flowforge.orchestrate.config.stage_config`).
        ledger: the pipeline's condition ledger (its conditions are the rows of ``cfg.data.prompts``).
        stage: ``"A"`` or ``"C"``. reward_name: the reward component whose NaN marks a group as not judged.
        auditor: stage C's :class:`Auditor`, or None.
        expected_changes: config keys / sections this stage changes on purpose against the checkpoint it resumes
            (stage C against stage A's: the reward, the stage's own overrides); its resume does not warn about them.
        own_area: the pipeline directory the stage's run directory lies in (default: the ledger's folder, which is
            the pipeline directory except for a control arm's ledger: :mod:`flowforge.orchestrate.arms`).

    Raises:
        ValueError: a prompt row is not a condition of the ledger (another prompt file).
    """
    source = LedgerPrompts(ledger, stage, reward_name)
    hooks: list[StepHook] = [BindScorers(stage)]
    if auditor is not None:
        hooks.append(AuditHook(auditor, reward_name))
    # own_area: the pipeline directory (the ledger's): the stage's run directory lies in it, the write rule allows
    # that to the pipeline's own stages only (flowforge.runtime.run_dir.check_run_dir_place)
    trainer = Trainer(cfg, progress=progress, prompts=source, hooks=hooks, own_area=own_area or ledger.path.parent,
                      expected_resume_changes=tuple(expected_changes))
    try:
        source.check(trainer)
    except ValueError:
        trainer.close()
        raise
    return trainer
