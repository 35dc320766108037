"""The judge request ledger: every answered request, kept permanently, so no request is ever sent twice.

An append-only SQLite database in WAL mode with ``synchronous=FULL``: each answer is one committed transaction, made
durable before :meth:`RequestLedger.record` returns, so a process killed at any point (SIGKILL included) loses at
most the requests still in flight. Rows are only inserted (``INSERT OR IGNORE``: the first answer of a key wins),
never updated or deleted. Several processes (ranks) may share one file; SQLite's locks serialise the writers.

Schema::

    requests(                      -- one row per answered request
        key TEXT PRIMARY KEY,      -- sha256 hex: flowforge.rewards.judge.protocol.request_key
        created_unix REAL,         -- time.time() of the answer
        model TEXT,                -- model name sent
        template_sha256 TEXT,      -- sha256 of the template file's bytes
        status TEXT,               -- 'ok' (scores parsed) | 'malformed' (still malformed after every repair)
        scores_json TEXT,          -- {"A": 0.73, ...}: presented label -> score in [0, 1]; NULL when malformed
        request_json TEXT,         -- the request as sent, images as {"sha256", "path"} (never base64)
        response_json TEXT,        -- every attempt's raw HTTP body and the parser's verdict
        prompt_tokens INTEGER, completion_tokens INTEGER,   -- summed over attempts (0 when not reported)
        latency_s REAL,            -- wall seconds, summed over attempts
        attempts INTEGER)          -- HTTP requests that got an answer (1 + repairs)
    failures(                      -- requests that got no usable answer (transport errors after all retries);
        id INTEGER PRIMARY KEY,    -- kept for audit, never served: the next run asks again
        key TEXT, created_unix REAL, error TEXT, request_json TEXT, attempts INTEGER)
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
import time
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    key TEXT PRIMARY KEY, created_unix REAL NOT NULL, model TEXT NOT NULL, template_sha256 TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('ok', 'malformed')), scores_json TEXT, request_json TEXT NOT NULL,
    response_json TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    latency_s REAL NOT NULL, attempts INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS failures (
    id INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL, created_unix REAL NOT NULL, error TEXT NOT NULL,
    request_json TEXT NOT NULL, attempts INTEGER NOT NULL);
"""


@dataclasses.dataclass(frozen=True)
class LedgerEntry:
    """One answered request (a ``requests`` row; see the module docstring for the fields)."""

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


class RequestLedger:
    """The ledger file at ``path`` (created with its parent directories; ``":memory:"`` keeps it in memory).

    Thread-safe: one connection guarded by a lock (the judge's worker threads record as answers arrive).

    Raises:
        sqlite3.Error: the file is not a database or cannot be written.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # autocommit mode (isolation_level=None) + explicit BEGIN IMMEDIATE: one transaction per record.
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=60.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)

    def get(self, key: str) -> LedgerEntry | None:
        """The answered request ``key``, or None."""
        with self._lock:
            row = self._db.execute(
                "SELECT key, model, template_sha256, status, scores_json, request_json, response_json, prompt_tokens,"
                " completion_tokens, latency_s, attempts, created_unix FROM requests WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        return LedgerEntry(key=row[0], model=row[1], template_sha256=row[2], status=row[3],
                           scores=None if row[4] is None else json.loads(row[4]), request=json.loads(row[5]),
                           response=json.loads(row[6]), prompt_tokens=row[7], completion_tokens=row[8],
                           latency_s=row[9], attempts=row[10], created_unix=row[11])

    def record(self, entry: LedgerEntry) -> None:
        """Insert ``entry`` durably (committed and synced before returning); a key already present is kept."""
        row = (entry.key, time.time(), entry.model, entry.template_sha256, entry.status,
               None if entry.scores is None else json.dumps(entry.scores), json.dumps(entry.request),
               json.dumps(entry.response), entry.prompt_tokens, entry.completion_tokens, entry.latency_s,
               entry.attempts)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT OR IGNORE INTO requests (key, created_unix, model, template_sha256, status,"
                                 " scores_json, request_json, response_json, prompt_tokens, completion_tokens,"
                                 " latency_s, attempts) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def record_failure(self, key: str, error: str, request: dict, attempts: int) -> None:
        """Append a request that got no usable answer (audit only; never served)."""
        with self._lock:
            self._db.execute("INSERT INTO failures (key, created_unix, error, request_json, attempts) "
                             "VALUES (?, ?, ?, ?, ?)", (key, time.time(), error, json.dumps(request), attempts))

    def keys(self) -> list[str]:
        """Every answered key, in insertion order."""
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT key FROM requests ORDER BY rowid")]

    def failures(self) -> list[dict]:
        """Every failure row as a dict (``key``, ``error``, ``attempts``, ``created_unix``)."""
        with self._lock:
            rows = self._db.execute("SELECT key, error, attempts, created_unix FROM failures ORDER BY id").fetchall()
        return [dict(key=r[0], error=r[1], attempts=r[2], created_unix=r[3]) for r in rows]

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM requests").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()
