"""The judge request ledger: pending before sent, every attempt a row, the budget, lost attempts after a crash,
first answer wins, and the slot that serves a resumed step."""

import sqlite3
import subprocess
import sys
import threading

import pytest

from flowforge.rewards.judge.ledger import BudgetExhausted, LedgerEntry, RequestLedger, Slot, adopt_answers


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
    ledger.record(_entry("k1", 0.75))  # a second answer for the same key is ignored
    ledger.record(_entry("k2", status="malformed"))
    got = ledger.get("k1")
    assert got.scores == {"A": 0.25, "B": 0.75} and got.prompt_tokens == 10 and got.latency_s == 0.25
    assert got.request["candidates"][0][0]["path"] == "/p/x.jpg" and got.response[0]["verdict"] == "ok"
    assert got.created_unix > 0 and got.attempts == 1 and ledger.billed() == 2
    ledger.close()
    again = RequestLedger(path)  # a new process after a crash sees every committed answer
    assert again.keys() == ["k1", "k2"] and again.get("k2").status == "malformed" and again.get("k2").scores is None
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    again.close()


def test_adopted_answers_are_served_unbilled_and_keep_what_is_there(tmp_path):
    """A ledger adopts another's decided requests without their bill (the other file paid): a claim of the same
    key is answered from it (a malformed or lost one as there: never sent again) and costs nothing here; keys it
    already holds and pending ones are not copied."""
    paid = RequestLedger(tmp_path / "audit.sqlite")
    paid.record(_entry("k1", 0.25))
    paid.record(_entry("k2", 0.5))
    paid.record(_entry("k3", status="malformed"))
    paid.record(_entry("k4", status="lost"))
    paid.begin("k5", model="m", template_sha256="t", request={})  # pending: nothing decided, not copied
    for key, billed in (("k6", True), ("k7", False)):  # failed after a timeout (billed) / a refused connection
        paid.begin(key, model="m", template_sha256="t", request={})
        attempt = paid.start_attempt(key, "first")
        paid.finish_attempt(attempt, "timeout" if billed else "connection_error", billed=billed)
        paid.finish(key, "failed", scores=None, response=[])
    paid.close()
    mine = RequestLedger(tmp_path / "arm.sqlite")
    mine.record(_entry("k2", 0.9))
    mine.close()
    assert adopt_answers(tmp_path / "arm.sqlite", tmp_path / "audit.sqlite") == 4
    assert adopt_answers(tmp_path / "arm.sqlite", tmp_path / "audit.sqlite") == 0  # idempotent
    assert adopt_answers(tmp_path / "arm.sqlite", tmp_path / "missing.sqlite") == 0
    assert not (tmp_path / "missing.sqlite").exists()
    mine = RequestLedger(tmp_path / "arm.sqlite")
    entry, billed = mine.claim("k1", Slot("C", "train", 3, 0, "c1"))
    assert entry.scores == {"A": 0.25, "B": 0.75} and billed == 0
    assert mine.get("k2").scores == _entry("k2", 0.9).scores and mine.get("k5") is None
    assert mine.get("k7") is None  # never billed: may be sent
    for key, status in (("k3", "malformed"), ("k4", "lost"), ("k6", "lost")):
        entry, billed = mine.claim(key)
        assert entry.status == status and entry.scores is None and billed == 0
    assert mine.billed() == 1  # only its own k2
    mine.close()


def test_a_request_is_pending_before_its_attempt_and_every_attempt_is_a_row(tmp_path):
    ledger = RequestLedger(tmp_path / "l.sqlite")
    slot = Slot(stage="A", purpose="train", step=3, policy_version=6, condition="c7")
    ledger.begin("k", model="m", template_sha256="t", request={"prompt": "p"}, slot=slot)
    assert ledger.get("k").status == "pending" and ledger.keys() == []  # not answered: never served
    first = ledger.start_attempt("k", "first")
    assert ledger.attempts("k")[0]["outcome"] == "pending" and ledger.billed() == 1  # recorded before it leaves
    ledger.finish_attempt(first, "timeout", error="timed out")
    retry = ledger.start_attempt("k", "retry")
    ledger.finish_attempt(retry, "connection_error", billed=False, error="refused")
    repair = ledger.start_attempt("k", "repair")
    ledger.finish_attempt(repair, "answered", latency_s=0.5, tokens=(7, 4))
    ledger.finish("k", "ok", scores={"A": 1.0}, response=[{"verdict": "ok"}], tokens=(7, 4), latency_s=0.5)
    rows = ledger.attempts("k")
    assert [(r["n"], r["kind"], r["outcome"], r["billed"]) for r in rows] == [
        (1, "first", "timeout", 1), (2, "retry", "connection_error", 0), (3, "repair", "answered", 1)]
    entry = ledger.get("k")
    assert entry.status == "ok" and entry.attempts == 2 and entry.slot == slot and ledger.billed() == 2
    ledger.finish("k", "failed", scores=None, response=[])  # a finished request never changes
    ledger.finish_attempt(first, "answered")
    assert ledger.get("k").status == "ok" and ledger.attempts("k")[0]["outcome"] == "timeout"


def test_the_budget_refuses_an_attempt_before_it_is_recorded(tmp_path):
    ledger = RequestLedger(tmp_path / "l.sqlite", budget=2)
    ledger.begin("k", model="m", template_sha256="t", request={})
    ledger.finish_attempt(ledger.start_attempt("k", "first"), "timeout")
    ledger.finish_attempt(ledger.start_attempt("k", "retry"), "connection_error", billed=False)  # refused: free
    ledger.finish_attempt(ledger.start_attempt("k", "retry"), "timeout")
    with pytest.raises(BudgetExhausted, match="budget of 2"):
        ledger.start_attempt("k", "retry")
    assert ledger.billed() == 2 and len(ledger.attempts("k")) == 3


def test_an_attempt_left_in_flight_by_a_killed_process_is_lost_and_billed(tmp_path):
    path = tmp_path / "l.sqlite"
    code = ("import os, signal, sys; from flowforge.rewards.judge.ledger import RequestLedger, Slot\n"
            "l = RequestLedger(sys.argv[1])\n"
            "l.begin('sent', model='m', template_sha256='t', request={}, slot=Slot('A', 'train', 0, 0, 'c0'))\n"
            "l.start_attempt('sent', 'first')\n"
            "l.begin('between', model='m', template_sha256='t', request={}, slot=Slot('A', 'train', 0, 0, 'c1'))\n"
            "l.finish_attempt(l.start_attempt('between', 'first'), 'timeout')\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, timeout=120)
    assert done.returncode == -9, done.stderr
    ledger = RequestLedger(path)
    assert ledger.get("sent").status == "pending"  # opening alone changes nothing (readers only read)
    entry, billed = ledger.claim("sent")
    assert entry.status == "lost" and billed == 1  # the answer may exist and be billed: never sent again
    assert ledger.attempts("sent")[0]["outcome"] == "lost"
    # the slot finds it for re-generated media under another key
    entry, billed = ledger.claim("other-key", Slot("A", "train", 0, 0, "c0"))
    assert entry.key == "sent" and billed == 1
    # killed between two attempts (nothing in flight): it continues with what is left of its attempts
    entry, billed = ledger.claim("between")
    assert entry is None and billed == 1 and ledger.get("between").status == "pending"
    assert [f["status"] for f in ledger.failures()] == ["lost"]


def test_the_slot_serves_an_answer_for_other_media_of_the_same_step(tmp_path):
    ledger = RequestLedger(tmp_path / "l.sqlite")
    slot = Slot(stage="A", purpose="train", step=2, policy_version=2, condition="c1")
    ledger.record(LedgerEntry(**{**_entry("k").__dict__, "slot": slot}))
    assert ledger.claim("k2", slot)[0].key == "k"
    assert ledger.claim("k2", Slot("A", "eval", 2, 2, "c1")) == (None, 0)  # another purpose, another slot
    assert ledger.claim("k2", Slot("A", "train", 3, 3, "c1")) == (None, 0)
    assert ledger.claim("k2", Slot("A", "train", 2, 2, None)) == (None, 0)  # unbound: by key only


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


def test_an_older_ledger_is_refused_and_left_as_it_is(tmp_path):
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE requests (key TEXT PRIMARY KEY, status TEXT)")
    db.commit()
    db.close()
    before = path.read_bytes()
    with pytest.raises(ValueError, match="older format"):
        RequestLedger(path)
    assert path.read_bytes() == before


def test_memory_ledger():
    ledger = RequestLedger(":memory:")
    ledger.record(_entry("k"))
    assert ledger.get("k").scores["A"] == 0.5
