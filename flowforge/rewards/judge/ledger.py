"""The judge request ledger: every request, every billed attempt and every answer, written *before* a request leaves,
so that no request is ever sent twice and every paid call can be audited.

An SQLite database in WAL mode with ``synchronous=FULL``: every state change is one committed transaction, durable
before the call returns, so a process killed at any point (SIGKILL included) leaves at most one attempt per request
in flight -- recorded as ``pending`` before its HTTP request was sent.

Life of a request (one group)::

    begin            requests row, status 'pending': the request as sent (frames by hash and path, never base64),
                     its slot (stage, purpose, step, policy version, condition) and this process's owner token
    start_attempt    attempts row, outcome 'pending', billed -- committed BEFORE the HTTP request leaves; refused
                     (BudgetExhausted) when the file's billed attempts reached the budget
    finish_attempt   outcome 'answered' | 'timeout' | 'http_error' | 'connection_error' ('connection_error' is not
                     billed when the connection was refused: nothing left the machine); a timeout is billed. An
                     answer is recorded with the request's answers so far, in the same transaction
    finish           status 'ok' (scores) | 'malformed' (answered, never parseable) | 'failed' (no answer); the
                     attempt that brought the scores is recorded answered in the same transaction, so that no
                     committed state has an answered attempt whose scores are unknown

A process killed between ``start_attempt`` and ``finish_attempt`` leaves an attempt ``pending``. The next process
that meets the request (:meth:`RequestLedger.claim`) records that attempt as ``lost`` -- billed, its answer unknown
-- and the request as ``lost``: it is never sent again (the teacher may have answered and billed it). A request left
``pending`` without an attempt in flight (killed before sending, or between retries) continues where it stopped:
its recorded malformed answers are replayed into the conversation, so the next attempt is the repair it would
have been, never the first message again.

Schema (format 2)::

    meta(name TEXT PRIMARY KEY, value TEXT)           -- 'format' = '2'
    requests(                                         -- one row per group request
        key TEXT PRIMARY KEY,                         -- sha256 hex: flowforge.rewards.judge.protocol.request_key
        created_unix REAL, finished_unix REAL,
        model TEXT, template_sha256 TEXT,
        stage TEXT, purpose TEXT,                     -- e.g. 'A' / 'train', 'A' / 'eval', 'C' / 'audit' ('' unbound)
        step INTEGER, policy_version INTEGER,         -- the trainer step and optimizer steps taken (NULL unbound)
        slot TEXT,                                    -- the group's condition id (NULL unbound)
        owner TEXT,                                   -- random token of the process that last worked on it
        status TEXT,                                  -- pending | ok | malformed | failed | lost
        scores_json TEXT,                             -- {"A": 0.73, ...}: presented label -> score in [0, 1]
        request_json TEXT,                            -- the request as sent
        response_json TEXT,                           -- every answered attempt's raw body and the parser's verdict
        prompt_tokens INTEGER, completion_tokens INTEGER, latency_s REAL)   -- summed over answered attempts
    attempts(                                         -- one row per HTTP attempt, in order
        id INTEGER PRIMARY KEY, key TEXT, n INTEGER,  -- n: 1, 2, ... within the request
        kind TEXT,                                    -- first | retry (after a transport failure) | repair (after a
                                                      -- malformed reply)
        owner TEXT, billed INTEGER,                   -- 1: counts against the budget
        outcome TEXT,                                 -- pending | answered | timeout | http_error | connection_error
                                                      -- | lost
        http_status INTEGER, error TEXT, started_unix REAL, finished_unix REAL, latency_s REAL,
        prompt_tokens INTEGER, completion_tokens INTEGER)

Several processes may open one file (SQLite serialises writers); the pipeline gives it one writer at a time (rank 0
of the one process that holds the pipeline's lock), and readers (stage B, the report) only read.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from flowforge.runtime.errors import UserError

FORMAT = "2"
STATUSES = ("pending", "ok", "malformed", "failed", "lost")
ANSWERED = ("ok", "malformed")
"""Final statuses with an answer (served from the ledger, never asked again)."""
OUTCOMES = ("pending", "answered", "timeout", "http_error", "connection_error", "lost")
KINDS = ("first", "retry", "repair")
OWNER = uuid.uuid4().hex
"""This process's owner token (a pid can be reused by a later process; this cannot)."""

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS requests (
    key TEXT PRIMARY KEY, created_unix REAL NOT NULL, finished_unix REAL, model TEXT NOT NULL,
    template_sha256 TEXT NOT NULL, stage TEXT NOT NULL DEFAULT '', purpose TEXT NOT NULL DEFAULT '',
    step INTEGER, policy_version INTEGER, slot TEXT, owner TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN {STATUSES}), scores_json TEXT, request_json TEXT NOT NULL,
    response_json TEXT NOT NULL DEFAULT '[]', prompt_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0, latency_s REAL NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS requests_slot ON requests (stage, purpose, step, slot);
CREATE TABLE IF NOT EXISTS attempts (
    id INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL REFERENCES requests (key), n INTEGER NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN {KINDS}), owner TEXT NOT NULL, billed INTEGER NOT NULL,
    outcome TEXT NOT NULL CHECK (outcome IN {OUTCOMES}), http_status INTEGER, error TEXT,
    started_unix REAL NOT NULL, finished_unix REAL, latency_s REAL, prompt_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS attempts_key ON attempts (key);
"""
_COLUMNS = ("key, model, template_sha256, status, scores_json, request_json, response_json, prompt_tokens, "
            "completion_tokens, latency_s, created_unix, stage, purpose, step, policy_version, slot, owner")


class BudgetExhausted(ValueError):
    """The ledger's billed attempts reached its budget: nothing more is sent (the message says how many). A
    ``ValueError``: a limit the user set (``max_billed``, ``teacher.max_requests``), reported by the command line in
    one line (exit 2), not as an internal error."""


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where a request belongs: the stage, its purpose, the trainer step, the policy version, the condition.

    Two requests with the same ``(stage, purpose, step, condition)`` are the same judging of the same group, even when
    the media differ (a resumed step regenerates its media, bit-exact or not): the first one's answer serves both.
    """

    stage: str = ""
    purpose: str = ""
    step: int | None = None
    policy_version: int | None = None
    condition: str | None = None


@dataclasses.dataclass(frozen=True)
class LedgerEntry:
    """One request (a ``requests`` row; module docstring). ``attempts`` counts its billed attempts."""

    key: str
    model: str
    template_sha256: str
    status: str
    scores: dict[str, float] | None
    request: dict
    response: list
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    attempts: int
    created_unix: float = 0.0
    slot: Slot = Slot()
    owner: str = ""


def _where(key: str, slot: Slot) -> tuple[str, list]:
    """The SQL condition (and its arguments) on ``requests`` for request ``key`` or, when ``slot`` is bound (a step
    and a condition), any request of that slot."""
    where, args = "key = ?", [key]
    if slot.step is not None and slot.condition is not None:
        where += " OR (stage = ? AND purpose = ? AND step = ? AND slot = ?)"
        args += [slot.stage, slot.purpose, slot.step, slot.condition]
    return where, args


class RequestLedger:
    """The ledger file at ``path`` (created with its parent directories; ``":memory:"`` keeps it in memory).

    Args:
        budget: the most billed attempts the file may hold (0: no limit); :meth:`start_attempt` refuses beyond it.

    Thread-safe: one connection guarded by a lock (the judge's worker threads write as requests go and come).

    Raises:
        UserError: the file is not an SQLite database (a ``ValueError`` naming it; the file is not touched).
        sqlite3.Error: the file cannot be written.
        ValueError: the file is a ledger of another format (an older flowforge); it is left as it is.
    """

    def __init__(self, path: str | Path, *, budget: int = 0) -> None:
        self.path, self.budget = str(path), budget
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # autocommit mode (isolation_level=None) + explicit BEGIN IMMEDIATE: one transaction per change
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=60.0)
        try:  # reads the header: a file that is no SQLite database fails here, before anything is written to it
            columns = {r[1] for r in self._db.execute("PRAGMA table_info(requests)")}
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise UserError(self.path, f"is not a valid judge request ledger (SQLite: {exc}); it was left as it is",
                            "restore it from a backup, or move it aside to start a new ledger (its requests would "
                            "then be asked and billed again)") from None
        if columns and "owner" not in columns:  # checked before anything is written to the file
            self._db.close()
            raise ValueError(f"{self.path} is a judge ledger of an older format (no attempts table); keep it for "
                             "audit and give this run a new one")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        with self._lock:
            self._db.executescript(SCHEMA)
            self._db.execute("INSERT OR IGNORE INTO meta (name, value) VALUES ('format', ?)", (FORMAT,))

    # ------------------------------------------------------------------------------------------------ writes
    def _tx(self, *statements: tuple[str, tuple]) -> list[sqlite3.Cursor]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                out = [self._db.execute(sql, args) for sql, args in statements]
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        return out

    def begin(self, key: str, *, model: str, template_sha256: str, request: dict, slot: Slot = Slot()) -> None:
        """Record request ``key`` as ``pending`` for this process: a new row, or a ``failed`` / ``pending`` one
        continued (an answered or lost request is never begun again)."""
        self._tx(("INSERT OR IGNORE INTO requests (key, created_unix, model, template_sha256, stage, purpose, step, "
                  "policy_version, slot, owner, status, request_json) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
                  "'pending', ?)", (key, time.time(), model, template_sha256, slot.stage, slot.purpose, slot.step,
                                    slot.policy_version, slot.condition, OWNER, json.dumps(request))),
                 ("UPDATE requests SET status = 'pending', owner = ? WHERE key = ? AND status IN ('pending', 'failed')",
                  (OWNER, key)))

    def start_attempt(self, key: str, kind: str) -> int:
        """Record the next attempt of ``key`` as billed and ``pending`` -- before it is sent. Returns its row id.

        Raises:
            BudgetExhausted: the file holds ``budget`` billed attempts already.
            ValueError: an unknown ``kind``.
        """
        if kind not in KINDS:
            raise ValueError(f"attempt kind must be one of {KINDS}, got {kind!r}")
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                billed = self._db.execute("SELECT COUNT(*) FROM attempts WHERE billed = 1").fetchone()[0]
                if self.budget and billed >= self.budget:
                    raise BudgetExhausted(f"the judge's budget of {self.budget} billed requests is spent ({billed} "
                                          f"in {self.path}); nothing more is sent")
                n = self._db.execute("SELECT COUNT(*) FROM attempts WHERE key = ?", (key,)).fetchone()[0] + 1
                cur = self._db.execute("INSERT INTO attempts (key, n, kind, owner, billed, outcome, started_unix) "
                                       "VALUES (?, ?, ?, ?, 1, 'pending', ?)", (key, n, kind, OWNER, time.time()))
                self._db.execute("UPDATE requests SET owner = ? WHERE key = ?", (OWNER, key))
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            return int(cur.lastrowid)

    @staticmethod
    def _attempt_end(attempt_id: int, outcome: str, billed: bool, http_status: int | None, error: str | None,
                     latency_s: float, tokens: tuple[int, int]) -> tuple[str, tuple]:
        if outcome not in OUTCOMES or outcome == "pending":
            raise ValueError(f"an attempt's outcome must be one of {OUTCOMES[1:]}, got {outcome!r}")
        return ("UPDATE attempts SET outcome = ?, billed = ?, http_status = ?, error = ?, finished_unix = ?, "
                "latency_s = ?, prompt_tokens = ?, completion_tokens = ? WHERE id = ? AND outcome = 'pending'",
                (outcome, int(billed), http_status, error, time.time(), latency_s, tokens[0], tokens[1], attempt_id))

    def finish_attempt(self, attempt_id: int, outcome: str, *, billed: bool = True, http_status: int | None = None,
                       error: str | None = None, latency_s: float = 0.0, tokens: tuple[int, int] = (0, 0),
                       response: list | None = None) -> None:
        """Record how attempt ``attempt_id`` ended (a pending attempt only; a recorded outcome never changes).
        ``response``: the request's answers so far (this one last), stored on its pending request in the same
        transaction -- a process killed before the next attempt leaves them for the rerun to repair from."""
        statements = [self._attempt_end(attempt_id, outcome, billed, http_status, error, latency_s, tokens)]
        if response is not None:
            statements.append(("UPDATE requests SET response_json = ? WHERE key = (SELECT key FROM attempts WHERE "
                               "id = ?) AND status = 'pending'", (json.dumps(response), attempt_id)))
        self._tx(*statements)

    def finish(self, key: str, status: str, *, scores: dict[str, float] | None, response: list,
               tokens: tuple[int, int] = (0, 0), latency_s: float = 0.0, request: dict | None = None,
               answered: tuple[int, float, tuple[int, int]] | None = None) -> None:
        """Record the end of request ``key``: ``ok`` with ``scores``, ``malformed`` or ``failed`` (``request``:
        the recorded request with what the attempts added, e.g. the repair messages). ``answered``: ``(attempt id,
        its latency_s, its (prompt, completion) tokens)`` of the pending attempt whose answer ends the request,
        recorded ``answered`` in the same transaction (no state in between for a kill to leave behind)."""
        if status not in ("ok", "malformed", "failed"):
            raise ValueError(f"a request ends 'ok', 'malformed' or 'failed', got {status!r}")
        extra = ", request_json = ?" if request is not None else ""
        args = (status, None if scores is None else json.dumps(scores), json.dumps(response), tokens[0], tokens[1],
                latency_s, time.time(), *((json.dumps(request),) if request is not None else ()), key)
        first = () if answered is None else (self._attempt_end(answered[0], "answered", True, None, None,
                                                               answered[1], answered[2]),)
        self._tx(*first, (f"UPDATE requests SET status = ?, scores_json = ?, response_json = ?, prompt_tokens = ?, "
                          f"completion_tokens = ?, latency_s = ?, finished_unix = ?{extra} WHERE key = ? AND "
                          f"status = 'pending'", args))

    def claim(self, key: str, slot: Slot = Slot()) -> tuple[LedgerEntry | None, int]:
        """What is known of a group before this process sends it: the requests of ``key`` and, when the slot is
        bound (a step and a condition), of its slot. Pending attempts another process left in flight are recorded
        as ``lost`` (billed) and their requests as ``lost`` first.

        Returns:
            ``(entry, billed)``: the answered request (``ok`` / ``malformed``; the first one) or else a ``lost``
            one, or None; and the billed attempts of all those requests together.
        """
        where, args = _where(key, slot)
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                keys = [r[0] for r in self._db.execute(f"SELECT key FROM requests WHERE {where} ORDER BY rowid",
                                                       args)]
                for k in keys:
                    cur = self._db.execute("UPDATE attempts SET outcome = 'lost', finished_unix = ? WHERE key = ? "
                                           "AND outcome = 'pending' AND owner != ?", (now, k, OWNER))
                    if cur.rowcount:
                        self._db.execute("UPDATE requests SET status = 'lost', finished_unix = ? WHERE key = ? AND "
                                         "status = 'pending'", (now, k))
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            entries = [self._entry(self._db.execute(f"SELECT {_COLUMNS} FROM requests WHERE key = ?",
                                                    (k,)).fetchone()) for k in keys]
        billed = sum(e.attempts for e in entries)
        decided = [e for e in entries if e.status in ANSWERED] or [e for e in entries if e.status == "lost"]
        return (decided[0] if decided else None), billed

    def billed_failures(self, key: str, slot: Slot = Slot()) -> list[tuple[str, int | None]]:
        """``(outcome, http_status)`` of every billed attempt without an answer of the requests :meth:`claim`
        looks at (``key`` and its slot), in order: what a group has cost without being judged."""
        where, args = _where(key, slot)
        with self._lock:
            return [(r[0], r[1]) for r in self._db.execute(
                f"SELECT outcome, http_status FROM attempts WHERE billed = 1 AND outcome != 'answered' AND key IN "
                f"(SELECT key FROM requests WHERE {where}) ORDER BY id", args)]

    def record(self, entry: LedgerEntry) -> None:
        """Insert a finished request with ``entry.attempts`` answered billed attempts (tools and tests; the judge
        writes through :meth:`begin` ... :meth:`finish`); a key already present is kept."""
        s = entry.slot
        row = (entry.key, time.time(), time.time(), entry.model, entry.template_sha256, s.stage, s.purpose, s.step,
               s.policy_version, s.condition, OWNER, entry.status,
               None if entry.scores is None else json.dumps(entry.scores), json.dumps(entry.request),
               json.dumps(entry.response), entry.prompt_tokens, entry.completion_tokens, entry.latency_s)
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                cur = self._db.execute(
                    "INSERT OR IGNORE INTO requests (key, created_unix, finished_unix, model, template_sha256, stage, "
                    "purpose, step, policy_version, slot, owner, status, scores_json, request_json, response_json, "
                    "prompt_tokens, completion_tokens, latency_s) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
                    "?, ?, ?, ?)", row)
                for n in range(1, entry.attempts + 1) if cur.rowcount else ():
                    self._db.execute("INSERT INTO attempts (key, n, kind, owner, billed, outcome, started_unix, "
                                     "finished_unix) VALUES (?, ?, ?, ?, 1, 'answered', ?, ?)",
                                     (entry.key, n, "first" if n == 1 else "repair", OWNER, now, now))
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def adopt(self, other: str | Path) -> int:
        """Copy the decided requests of the ledger file ``other`` -- answered (``ok``, ``malformed``), ``lost``
        (billed, answer unknown) or ``failed`` after a billed attempt (copied as ``lost``) -- into this one, unbilled here (the other file paid for them), keeping every key
        already present: a request whose body another ledger of the same judge already paid for is then served from
        this file as there (its scores, or NaN for a malformed or lost one), never sent again (a pipeline's teacher
        arm and its audits judge the same groups: :mod:`flowforge.orchestrate.arms`). Returns how many were added;
        0 when ``other`` does not exist."""
        if not Path(other).is_file():
            return 0
        source = RequestLedger(other)
        try:
            found = source.entries(statuses=(*ANSWERED, "lost"))
            # a failed request whose attempts may have been billed (a timeout, a 5xx) is never sent again there;
            # here it is lost: billed elsewhere, answer unknown
            found += [dataclasses.replace(e, status="lost") for e in source.entries(statuses=("failed",))
                      if source.billed_failures(e.key)]
        finally:
            source.close()
        known = set(self.keys(statuses=STATUSES))
        fresh = [e for e in found if e.key not in known]
        for entry in fresh:
            self.record(dataclasses.replace(entry, attempts=0))
        return len(fresh)

    # ------------------------------------------------------------------------------------------------ reads
    def _entry(self, row: tuple | None) -> LedgerEntry | None:
        if row is None:
            return None
        billed = self._db.execute("SELECT COUNT(*) FROM attempts WHERE key = ? AND billed = 1",
                                  (row[0],)).fetchone()[0]
        return LedgerEntry(key=row[0], model=row[1], template_sha256=row[2], status=row[3],
                           scores=None if row[4] is None else json.loads(row[4]), request=json.loads(row[5]),
                           response=json.loads(row[6]), prompt_tokens=row[7], completion_tokens=row[8],
                           latency_s=row[9], attempts=billed, created_unix=row[10],
                           slot=Slot(stage=row[11], purpose=row[12], step=row[13], policy_version=row[14],
                                     condition=row[15]), owner=row[16])

    def get(self, key: str) -> LedgerEntry | None:
        """Request ``key`` (any status), or None."""
        with self._lock:
            return self._entry(self._db.execute(f"SELECT {_COLUMNS} FROM requests WHERE key = ?", (key,)).fetchone())

    def keys(self, *, statuses: tuple[str, ...] = ANSWERED) -> list[str]:
        """The keys with one of ``statuses`` (default: the answered ones), in the order they were begun."""
        marks = ", ".join("?" * len(statuses))
        with self._lock:
            return [r[0] for r in self._db.execute(f"SELECT key FROM requests WHERE status IN ({marks}) "
                                                   "ORDER BY rowid", statuses)]

    def entries(self, *, statuses: tuple[str, ...] = STATUSES) -> list[LedgerEntry]:
        """Every request with one of ``statuses``, in the order they were begun."""
        return [self.get(k) for k in self.keys(statuses=statuses)]

    def attempts(self, key: str | None = None) -> list[dict[str, Any]]:
        """Attempt rows (of ``key``, or all) as dicts, in order."""
        where, args = ("WHERE key = ?", (key,)) if key is not None else ("", ())
        with self._lock:
            cur = self._db.execute("SELECT key, n, kind, billed, outcome, http_status, error, latency_s, "
                                   f"started_unix, finished_unix FROM attempts {where} ORDER BY id", args)
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def billed(self) -> int:
        """Billed attempts in the file (what the budget counts)."""
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM attempts WHERE billed = 1").fetchone()[0])

    def failures(self) -> list[dict]:
        """Requests that ended without an answer (``failed`` or ``lost``): ``key``, ``status``, ``attempts``
        (billed) and ``error`` (the last attempt's)."""
        out = []
        for entry in self.entries(statuses=("failed", "lost")):
            rows = self.attempts(entry.key)
            out.append(dict(key=entry.key, status=entry.status, attempts=entry.attempts,
                            error=rows[-1]["error"] if rows else None, created_unix=entry.created_unix))
        return out

    def __len__(self) -> int:
        """Answered requests."""
        return len(self.keys())

    def close(self) -> None:
        with self._lock:
            self._db.close()


def adopt_answers(into: str | Path, source: str | Path) -> int:
    """:meth:`RequestLedger.adopt` of the ledger file ``source`` into the one at ``into`` (created if needed; nothing
    when ``source`` does not exist). A pipeline's teacher arm and stage C's audits judge the same groups when both
    start from stage A's hand-off: each adopts the other's answers before it sends anything, so a group judged by
    both is paid once (:mod:`flowforge.orchestrate.arms`). Returns how many answers were copied."""
    if not Path(source).is_file():
        return 0
    book = RequestLedger(into)
    try:
        return book.adopt(source)
    finally:
        book.close()

