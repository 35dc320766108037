"""The condition ledger: one seeded pass over the eligible conditions, shared by every stage of the pipeline.

A *condition* is one row of the prompt file (its ``metadata.sample_id`` is the condition id). Stage A (RL with the
teacher judge) and stage C (RL with the student) draw their conditions from **one pass** over the condition set, in
one fixed order; there is no implicit epoch: a stage that used its budget stops, and a pass that is exhausted ends
the pipeline. A condition is never handed out twice.

Clusters and order
------------------
Near-duplicate conditions share a *cluster* id (the student's train / held-out split is made by cluster, so a
paraphrase cannot leak from training into evaluation): ``metadata.cluster`` when the prompt file gives one, else
:func:`~flowforge.data.clusters.text_cluster` of the prompt -- ``"text:"`` + the first 16 hex digits of the
sha256 of the prompt normalised by :func:`~flowforge.data.clusters.normalise_text` (Unicode NFKC, lower case, every
run of punctuation / underscores / whitespace replaced by one space, stripped), so prompts that differ only in case, punctuation or spacing share a cluster.

The pass order sorts conditions by ``sha256(json([seed, cluster, id]))`` (:func:`order_key`): a pure function of
the seed and the condition, never an RNG state, so it is the same on every machine, rank and resume, and adding a
condition does not reorder the others.

Budgets
-------
============  ===================================================================================================
stage ``A``   the first ``budget_A`` conditions handed out (``n_A`` at the start)
stage ``C``   the rest: ``N - budget_A`` (``N`` = number of conditions)
extension     :meth:`ConditionLedger.extend_a` moves ``min(delta, cap - budget_A, N - budget_A - used_C)``
              conditions from C's budget to A's (``cap`` defaults to ``N``); never a second pass
============  ===================================================================================================

:meth:`ConditionLedger.take` ``(stage, n, step=s)`` hands out the next ``min(n, remaining(stage))`` conditions of
the pass and records them for ``(stage, s)``. Asking again for a step that is already recorded (a resumed run
replaying the steps after its last checkpoint) returns the same conditions -- never new ones -- so a resumed run
sees exactly what the interrupted one saw, and no condition is ever handed to two steps.

File format
-----------
``path`` is JSON Lines, appended one record per line and fsynced before the call returns (the directory is
fsynced when the file is created). The first line is the header; records are replayed in order on open::

    {"kind": "header", "version": 1, "seed": 0, "conditions": N, "order_sha256": "...", "n_a": 32,
     "extend_delta": 8, "extend_cap": 64}
    {"kind": "take", "stage": "A", "step": 0, "policy_version": 0, "n": 4, "ids": ["c17", "c3", ...]}
    {"kind": "mark", "state": "rolled_out", "stage": "A", "step": 0, "policy_version": 0, "ids": [...]}
    {"kind": "extend", "key": "gate-1", "amount": 8, "budget_a": 40}

``order_sha256`` is the sha256 of the ordered ``[[id, cluster], ...]`` list: reopening with another prompt file,
seed or budget is refused. A crash can tear at most the last line (a record is one ``write``); a last line without
its newline or that does not parse is dropped on open, reported (:attr:`ConditionLedger.torn`, a warning) and cut
off the file so the next record starts on a clean line. A bad line before the last is corruption and raises.

Condition states (:data:`STATES`): ``scheduled`` (handed out by :meth:`take`), then :meth:`mark`-ed
``rolled_out``, ``judged``, ``used_for_rm``, ``trained_on``; each kept with the stage, step and policy version of
its first occurrence. One process writes a ledger (the orchestrator / rank 0).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flowforge.data.clusters import cluster_of
from flowforge.runtime.durable import fsync_path

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
STAGES = ("A", "C")
"""Stages that draw conditions: A (teacher-judge RL) and C (student-reward RL)."""
STATES = ("scheduled", "rolled_out", "judged", "used_for_rm", "trained_on")
"""Condition states, each recorded with ``(stage, step, policy_version)``; ``scheduled`` comes from :meth:`take`."""


def order_key(seed: int, cluster: str, condition_id: str) -> str:
    """The sort key of a condition in the pass: sha256 hex of ``json([seed, cluster, id])``."""
    return hashlib.sha256(json.dumps([seed, cluster, condition_id]).encode("utf-8")).hexdigest()


@dataclasses.dataclass(frozen=True)
class Condition:
    """One eligible condition: its id (``metadata.sample_id``), cluster id and prompt text."""

    id: str
    cluster: str
    prompt: str = ""


def conditions_from_records(records: Iterable[Any]) -> list[Condition]:
    """Conditions from prompt records (:class:`flowforge.data.prompts.PromptRecord`: ``prompt`` + ``metadata``).

    Raises:
        ValueError: a repeated ``sample_id`` or a bad ``metadata.cluster``.
    """
    out, seen = [], set()
    for record in records:
        cid = record.metadata["sample_id"]
        if cid in seen:
            raise ValueError(f"condition id {cid!r} repeats; sample_id must be unique")
        seen.add(cid)
        out.append(Condition(id=cid, cluster=cluster_of(record.prompt, record.metadata), prompt=record.prompt))
    return out


def pass_order(conditions: Sequence[Condition], seed: int) -> list[Condition]:
    """``conditions`` sorted by :func:`order_key` (the one pass).

    Raises:
        ValueError: a repeated condition id, or no conditions.
    """
    ids = [c.id for c in conditions]
    if not ids:
        raise ValueError("the condition set is empty")
    if len(set(ids)) != len(ids):
        raise ValueError("condition ids must be unique")
    return sorted(conditions, key=lambda c: order_key(seed, c.cluster, c.id))


@dataclasses.dataclass(frozen=True)
class Event:
    """Where a state was reached: the stage, the stage's step and the policy version (optimizer updates so far)."""

    stage: str
    step: int
    policy_version: int


@dataclasses.dataclass(frozen=True)
class ConditionStatus:
    """A condition's place in the pass (``position``), the stage it was handed to (None: unused) and its states
    (``state -> first Event``)."""

    condition: Condition
    position: int
    stage: str | None
    states: dict[str, Event]


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


class ConditionLedger:
    """The append-only condition ledger at ``path`` over ``conditions`` (module docstring).

    Args:
        path: the JSONL file (created with its parent directories; reopened and replayed when it exists).
        conditions: the eligible conditions (any order; the pass order is :func:`pass_order`).
        seed: the pass seed.
        n_a: stage A's initial budget (conditions), ``0 <= n_a <= N``.
        extend_delta: conditions one :meth:`extend_a` adds to A (0: no extension).
        extend_cap: the most A may ever get (default: ``N``); ``n_a <= extend_cap <= N``.
        writer: False for a read-only mirror (the ranks other than 0 under ``torchrun``): it loads the file the
            writer made and applies every record in memory only, so the same calls in the same order keep it equal
            to the writer's ledger while the file keeps one writer.

    Raises:
        ValueError: bad budgets; an existing file made for another condition set, seed or budgets; a corrupt file
            (a bad line before the last, records that do not fit the pass); a mirror of a missing file or of one
            with a torn last line (the writer opens it first and repairs it).
    """

    def __init__(self, path: str | Path, conditions: Sequence[Condition], *, seed: int, n_a: int,
                 extend_delta: int = 0, extend_cap: int | None = None, writer: bool = True) -> None:
        self.path = Path(path)
        self.writer = writer
        self.order = pass_order(conditions, seed)
        total = len(self.order)
        cap = total if extend_cap is None else extend_cap
        _check_int("n_a", n_a, 0)
        _check_int("extend_delta", extend_delta, 0)
        if n_a > total or cap > total:
            raise ValueError(f"n_a={n_a} and extend_cap={cap} must not exceed the {total} conditions")
        _check_int("extend_cap", cap, n_a)
        digest = hashlib.sha256(json.dumps([[c.id, c.cluster] for c in self.order]).encode("utf-8")).hexdigest()
        self.header = {"kind": "header", "version": FORMAT_VERSION, "seed": seed, "conditions": total,
                       "order_sha256": digest, "n_a": n_a, "extend_delta": extend_delta, "extend_cap": cap}
        self._position = {c.id: i for i, c in enumerate(self.order)}
        self.cursor = 0
        self.budget_a = n_a
        self.used = {stage: 0 for stage in STAGES}
        self.takes: dict[tuple[str, int], dict[str, Any]] = {}
        self.extensions: dict[str, int] = {}
        self._last_step: dict[str, int] = {}
        self._stage: dict[str, str] = {}
        self._states: dict[str, dict[str, Event]] = {}
        self.torn: str | None = None
        self._records = 1  # records held, the header included (a mirror's place in the writer's file)
        """Set when the last line of the file was torn and dropped on open (what was dropped)."""
        if self.path.exists() and self.path.stat().st_size > 0:
            self._load()
        elif not writer:
            raise ValueError(f"{self.path}: a read-only mirror needs the ledger its writer created")
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._append(self.header)
            fsync_path(self.path.parent)

    # ------------------------------------------------------------------------------------------------ budgets
    @property
    def total(self) -> int:
        """``N``, the number of conditions in the pass."""
        return len(self.order)

    def budget(self, stage: str) -> int:
        """Conditions ``stage`` may use in all (A: ``budget_A``; C: ``N - budget_A``)."""
        self._check_stage(stage)
        return self.budget_a if stage == "A" else self.total - self.budget_a

    def remaining(self, stage: str) -> int:
        """Conditions ``stage`` can still take: its unused budget, at most what is left of the pass."""
        return max(0, min(self.budget(stage) - self.used[stage], self.total - self.cursor))

    @property
    def exhausted(self) -> bool:
        """Whether the pass is used up (every condition handed out): the pipeline ends."""
        return self.cursor >= self.total

    def extend_a(self, key: str) -> int:
        """Move up to ``extend_delta`` conditions from C's budget to A's (bounded by ``extend_cap`` and by what C
        has not used); the number moved (0 when none can be). Idempotent per ``key``: a key already recorded
        returns its amount and changes nothing, so a rerun of the same decision does not extend twice.

        Raises:
            ValueError: an empty ``key``.
        """
        if not isinstance(key, str) or not key:
            raise ValueError(f"extend_a needs a non-empty key, got {key!r}")
        if key in self.extensions:
            return self.extensions[key]
        amount = min(self.header["extend_delta"], self.header["extend_cap"] - self.budget_a,
                     self.total - self.budget_a - self.used["C"])
        if amount <= 0:
            return 0
        self._write({"kind": "extend", "key": key, "amount": amount, "budget_a": self.budget_a + amount})
        return amount

    # ------------------------------------------------------------------------------------------------ take / mark
    def take(self, stage: str, n: int, *, step: int, policy_version: int) -> list[Condition]:
        """The conditions of ``stage``'s step ``step``: the next ``min(n, remaining(stage))`` of the pass, recorded
        as ``scheduled`` before they are returned (an empty list when the stage's budget or the pass is used up).
        A step already recorded returns the same conditions again (exact replay after a resume).

        Raises:
            ValueError: an unknown stage; ``n`` / ``step`` / ``policy_version`` not ints >= 0; a replayed step asked
                with another ``n``; a new step below the stage's last recorded step.
        """
        self._check_stage(stage)
        _check_int("n", n, 0)
        _check_int("step", step, 0)
        _check_int("policy_version", policy_version, 0)
        done = self.takes.get((stage, step))
        if done is not None:
            if done["n"] != n:
                raise ValueError(f"stage {stage} step {step} was taken with n={done['n']}, now asked with n={n}")
            return [self.order[self._position[i]] for i in done["ids"]]
        if step < self._last_step.get(stage, -1):
            raise ValueError(f"stage {stage} step {step} was never taken but step {self._last_step[stage]} was: "
                             "steps are taken in increasing order")
        chosen = self.order[self.cursor:self.cursor + min(n, self.remaining(stage))]
        self._write({"kind": "take", "stage": stage, "step": step, "policy_version": policy_version, "n": n,
                     "ids": [c.id for c in chosen]})
        return list(chosen)

    def peek(self, stage: str, n: int) -> list[Condition]:
        """The conditions the next new :meth:`take` of ``stage`` with this ``n`` would return (nothing recorded)."""
        self._check_stage(stage)
        return list(self.order[self.cursor:self.cursor + min(_check_int("n", n, 0), self.remaining(stage))])

    def mark(self, state: str, ids: Iterable[str], *, stage: str, step: int, policy_version: int) -> None:
        """Record that the conditions ``ids`` reached ``state`` (one record; nothing written when every id already
        has that state).

        Raises:
            ValueError: ``state`` not in :data:`STATES` or ``"scheduled"`` (use :meth:`take`); an id that was never
                handed out; ``step`` / ``policy_version`` not ints >= 0.
        """
        if state not in STATES or state == "scheduled":
            raise ValueError(f"state must be one of {list(STATES[1:])}, got {state!r}")
        _check_int("step", step, 0)
        _check_int("policy_version", policy_version, 0)
        ids = list(ids)
        unknown = [i for i in ids if i not in self._stage]
        if unknown:
            raise ValueError(f"conditions {unknown[:5]} were never handed out; only taken conditions can be marked")
        if all(state in self._states[i] for i in ids):
            return
        self._write({"kind": "mark", "state": state, "stage": stage, "step": step,
                     "policy_version": policy_version, "ids": ids})

    # ------------------------------------------------------------------------------------------------ queries
    def status(self, condition_id: str) -> ConditionStatus:
        """The state of one condition.

        Raises:
            KeyError: an unknown id.
        """
        position = self._position[condition_id]
        return ConditionStatus(condition=self.order[position], position=position,
                               stage=self._stage.get(condition_id),
                               states=dict(self._states.get(condition_id, {})))

    def with_state(self, state: str, stage: str | None = None) -> list[str]:
        """Ids that reached ``state`` (of ``stage``'s conditions only, when given), in pass order."""
        return [c.id for c in self.order if state in self._states.get(c.id, {})
                and (stage is None or self._stage.get(c.id) == stage)]

    def clusters(self) -> dict[str, str]:
        """``condition id -> cluster id`` for every condition."""
        return {c.id: c.cluster for c in self.order}

    def summary(self) -> dict[str, Any]:
        """A JSON-ready summary: pass size and position, budgets, use per stage, counts per state, torn line."""
        counts = {s: sum(s in states for states in self._states.values()) for s in STATES}
        return {"conditions": self.total, "handed_out": self.cursor, "exhausted": self.exhausted,
                "budget": {s: self.budget(s) for s in STAGES}, "used": dict(self.used),
                "remaining": {s: self.remaining(s) for s in STAGES}, "states": counts,
                "extensions": dict(self.extensions), "torn": self.torn}

    # ------------------------------------------------------------------------------------------------ internals
    @staticmethod
    def _check_stage(stage: str) -> None:
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {list(STAGES)}, got {stage!r}")

    def _write(self, record: dict[str, Any]) -> None:
        """Append ``record`` durably, then apply it (a failed write changes nothing in memory)."""
        self._append(record)
        self._apply(record)
        self._records += 1

    def refresh(self) -> int:
        """A mirror (``writer=False``) applies the records its writer appended beyond those it holds (after work
        only the writer did, e.g. stage B on rank 0). Returns how many; 0 for the writer.

        Raises:
            ValueError: a record that does not fit the pass.
        """
        if self.writer:
            return 0
        records = [json.loads(raw) for raw in self.path.read_bytes().split(b"\n") if raw.strip()]
        for record in records[self._records:]:
            self._apply(record)
        new, self._records = len(records) - self._records, len(records)
        return new

    def _append(self, record: dict[str, Any]) -> None:
        if not self.writer:  # a mirror: the writer appends the same record
            return
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode("utf-8")
        with open(self.path, "ab") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())

    def _apply(self, record: Mapping[str, Any]) -> None:
        """Replay one record onto the in-memory state.

        Raises:
            ValueError: a record that does not fit the pass (wrong ids, unknown kind).
        """
        kind = record.get("kind")
        if kind == "take":
            stage, ids = record["stage"], list(record["ids"])
            expected = [c.id for c in self.order[self.cursor:self.cursor + len(ids)]]
            if ids != expected or len(ids) > self.remaining(stage) or (stage, record["step"]) in self.takes:
                raise ValueError(f"{self.path}: take record {record} does not continue the pass at position "
                                 f"{self.cursor} (expected ids {expected[:5]}...)")
            event = Event(stage, record["step"], record["policy_version"])
            self.takes[(stage, record["step"])] = {"n": record["n"], "ids": ids}
            self._last_step[stage] = max(self._last_step.get(stage, -1), record["step"])
            self.cursor += len(ids)
            self.used[stage] += len(ids)
            for i in ids:
                self._stage[i] = stage
                self._states[i] = {"scheduled": event}
        elif kind == "mark":
            event = Event(record["stage"], record["step"], record["policy_version"])
            for i in record["ids"]:
                if i not in self._stage:
                    raise ValueError(f"{self.path}: mark record names {i!r}, which was never handed out")
                self._states[i].setdefault(record["state"], event)
        elif kind == "extend":
            self.budget_a = record["budget_a"]
            self.extensions[record["key"]] = record["amount"]
        else:
            raise ValueError(f"{self.path}: unknown record kind {kind!r}")

    def _load(self) -> None:
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        tail = lines.pop()  # the bytes after the last newline: empty unless the last write was torn
        records, good_bytes = [], 0
        for number, raw in enumerate(lines, start=1):
            try:
                records.append(json.loads(raw))
            except (json.JSONDecodeError, UnicodeDecodeError):
                if number < len(lines) or tail:
                    raise ValueError(f"{self.path}:{number}: corrupt record before the last line") from None
                tail = raw + b"\n"  # the last line parses not: torn even though its newline made it out
                break
            good_bytes += len(raw) + 1
        if tail and not self.writer:
            raise ValueError(f"{self.path}: torn last record; the writer must open (and repair) the ledger first")
        if tail:
            self.torn = f"dropped a torn last record of {len(tail)} bytes: {tail[:80]!r}"
            log.warning("condition ledger %s: %s", self.path, self.torn)
            with open(self.path, "r+b") as handle:
                handle.truncate(good_bytes)
                handle.flush()
                os.fsync(handle.fileno())
        if not records and self.torn is not None:  # killed while writing the header: start the file again
            self._append(self.header)
            return
        if not records or records[0].get("kind") != "header":
            raise ValueError(f"{self.path}: the first line is not a condition-ledger header")
        if records[0] != self.header:
            raise ValueError(f"{self.path} was made for another pass: file header {records[0]}, this ledger "
                             f"{self.header} (a different prompt file, seed or budget)")
        for record in records[1:]:
            self._apply(record)
        self._records = len(records)
