"""The judge request ledger: append-only, durable, first answer wins, failures audited but never served."""

import sqlite3
import threading

from flowforge.rewards.judge.ledger import LedgerEntry, RequestLedger


def _entry(key: str, score: float = 0.5, status: str = "ok") -> LedgerEntry:
    return LedgerEntry(key=key, model="m", template_sha256="t", status=status,
                       scores={"A": score, "B": 1 - score} if status == "ok" else None,
                       request={"candidates": [[{"sha256": "x", "path": "/p/x.jpg"}]]},
                       response=[{"body": '{"choices": []}', "verdict": "ok"}], prompt_tokens=10,
                       completion_tokens=3, latency_s=0.25, attempts=1)


def test_record_get_reopen_and_first_answer_wins(tmp_path):
    path = tmp_path / "judge" / "ledger.sqlite"
    ledger = RequestLedger(path)
    assert ledger.get("k1") is None and len(ledger) == 0
    ledger.record(_entry("k1", 0.25))
    ledger.record(_entry("k1", 0.75))  # append-only: a second answer for the same key is ignored
    ledger.record(_entry("k2", status="malformed"))
    got = ledger.get("k1")
    assert got.scores == {"A": 0.25, "B": 0.75} and got.prompt_tokens == 10 and got.latency_s == 0.25
    assert got.request["candidates"][0][0]["path"] == "/p/x.jpg" and got.response[0]["verdict"] == "ok"
    assert got.created_unix > 0
    ledger.close()
    again = RequestLedger(path)  # a new process after a crash sees every committed answer
    assert again.keys() == ["k1", "k2"] and again.get("k2").status == "malformed" and again.get("k2").scores is None
    mode = sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    again.close()


def test_failures_are_kept_for_audit_and_never_served(tmp_path):
    ledger = RequestLedger(tmp_path / "l.sqlite")
    ledger.record_failure("k", "APITimeoutError after 4 tries", {"prompt": "p"}, 0)
    assert ledger.get("k") is None and len(ledger) == 0
    assert [f["error"] for f in ledger.failures()] == ["APITimeoutError after 4 tries"]


def test_concurrent_writers_from_threads_and_a_second_connection(tmp_path):
    path = tmp_path / "l.sqlite"
    a, b = RequestLedger(path), RequestLedger(path)

    def write(ledger, start):
        for i in range(start, start + 20):
            ledger.record(_entry(f"k{i}"))

    threads = [threading.Thread(target=write, args=(led, s)) for led, s in ((a, 0), (a, 20), (b, 40), (b, 10))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(a) == 60 and sorted(b.keys()) == sorted(f"k{i}" for i in range(60))


def test_memory_ledger():
    ledger = RequestLedger(":memory:")
    ledger.record(_entry("k"))
    assert ledger.get("k").scores["A"] == 0.5
