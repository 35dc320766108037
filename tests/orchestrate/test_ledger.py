"""The condition ledger: one seeded pass, stage budgets, the A extension, no reuse, crash-safe exact resume."""

from __future__ import annotations

import json
import random

import pytest

from flowforge.data.prompts import PromptRecord
from flowforge.orchestrate.ledger import Condition, ConditionLedger, conditions_from_records, order_key, pass_order


def _conditions(n: int = 20) -> list[Condition]:
    return [Condition(id=f"c{i:03d}", cluster=f"k{i // 3}", prompt=f"prompt {i}") for i in range(n)]


def _ledger(path, n: int = 20, **kw) -> ConditionLedger:
    kw.setdefault("n_a", 8)
    return ConditionLedger(path, _conditions(n), seed=kw.pop("seed", 7), **kw)


def test_conditions_take_their_cluster_from_metadata_or_the_normalised_text():
    records = [PromptRecord("a seven", {"task": "t2i", "sample_id": "a"}),
               PromptRecord("A SEVEN.", {"task": "t2i", "sample_id": "b"}),
               PromptRecord("an eight", {"task": "t2i", "sample_id": "c", "cluster": "eights"})]
    conds = conditions_from_records(records)
    assert conds[0].cluster == conds[1].cluster != conds[2].cluster == "eights"
    with pytest.raises(ValueError, match="repeats"):
        conditions_from_records(records + records[:1])


def test_the_order_is_a_hash_of_seed_cluster_and_id():
    conds = _conditions(30)
    order = pass_order(conds, seed=3)
    assert [c.id for c in order] == [c.id for c in sorted(conds, key=lambda c: order_key(3, c.cluster, c.id))]
    assert [c.id for c in pass_order(list(reversed(conds)), seed=3)] == [c.id for c in order]  # input order free
    assert [c.id for c in pass_order(conds, seed=4)] != [c.id for c in order]
    # adding a condition does not reorder the others
    grown = pass_order(conds + [Condition("new", "k99")], seed=3)
    assert [c.id for c in grown if c.id != "new"] == [c.id for c in order]


def test_one_pass_with_budgets_and_no_reuse(tmp_path):
    led = _ledger(tmp_path / "c.jsonl", n=20, n_a=8)
    assert (led.budget("A"), led.budget("C"), led.remaining("A")) == (8, 12, 8)
    seen = []
    for step in range(5):
        got = led.take("A", 3, step=step, policy_version=step)
        seen += [c.id for c in got]
        if step >= 3:
            assert got == []  # the stage used its budget: it stops
    assert len(seen) == 8 and led.remaining("A") == 0 and led.used["A"] == 8
    for step in range(10):
        seen += [c.id for c in led.take("C", 5, step=step, policy_version=100 + step)]
    assert len(seen) == 20 and len(set(seen)) == 20  # never handed out twice
    assert seen == [c.id for c in led.order]  # one pass, in the seeded order
    assert led.exhausted and led.remaining("C") == 0 and led.take("C", 5, step=10, policy_version=0) == []
    assert led.status(seen[0]).stage == "A" and led.status(seen[-1]).stage == "C"
    assert led.status(seen[0]).states["scheduled"].policy_version == 0


def test_extension_moves_conditions_from_c_to_a_up_to_the_cap(tmp_path):
    led = _ledger(tmp_path / "c.jsonl", n=20, n_a=8, extend_delta=5, extend_cap=16)
    led.take("A", 8, step=0, policy_version=0)
    assert led.remaining("A") == 0
    assert led.extend_a("gate-1") == 5 and led.budget("A") == 13 and led.budget("C") == 7
    assert led.extend_a("gate-1") == 5 and led.budget("A") == 13  # same key: recorded once
    more = led.take("A", 10, step=1, policy_version=1)
    assert len(more) == 5 and [c.id for c in more] == [c.id for c in led.order[8:13]]
    assert led.extend_a("gate-2") == 3 and led.budget("A") == 16  # capped
    assert led.extend_a("gate-3") == 0
    led.take("A", 3, step=2, policy_version=2)
    c_ids = [c.id for c in led.take("C", 10, step=0, policy_version=3)]
    assert c_ids == [c.id for c in led.order[16:]] and led.exhausted  # C got the rest: no second pass
    again = _ledger(tmp_path / "c2.jsonl", n=6, n_a=2, extend_delta=4)
    again.take("C", 3, step=0, policy_version=0)
    assert again.extend_a("k") == 1  # C already used 3 of its 4: only 1 can move


def test_a_replayed_step_gets_the_same_conditions_and_bad_calls_raise(tmp_path):
    led = _ledger(tmp_path / "c.jsonl")
    first = led.take("A", 3, step=0, policy_version=0)
    led.take("A", 3, step=1, policy_version=1)
    assert led.take("A", 3, step=0, policy_version=0) == first and led.used["A"] == 6
    with pytest.raises(ValueError, match="n=3"):
        led.take("A", 4, step=1, policy_version=1)
    led.take("A", 1, step=5, policy_version=5)
    with pytest.raises(ValueError, match="increasing order"):
        led.take("A", 1, step=3, policy_version=3)
    with pytest.raises(ValueError, match="stage must be"):
        led.take("B", 1, step=0, policy_version=0)
    with pytest.raises(ValueError, match="never handed out"):
        led.mark("judged", [first[0].id, "zzz"], stage="A", step=0, policy_version=0)
    with pytest.raises(ValueError, match="state must be"):
        led.mark("scheduled", [first[0].id], stage="A", step=0, policy_version=0)
    with pytest.raises(ValueError, match="must not exceed"):
        _ledger(tmp_path / "x.jsonl", n=5, n_a=6)


def test_states_and_exact_resume_after_reload(tmp_path):
    path = tmp_path / "c.jsonl"
    led = _ledger(path, extend_delta=4)
    for step in range(2):
        ids = [c.id for c in led.take("A", 3, step=step, policy_version=step)]
        led.mark("rolled_out", ids, stage="A", step=step, policy_version=step)
        led.mark("judged", ids, stage="A", step=step, policy_version=step)
        led.mark("trained_on", ids, stage="A", step=step, policy_version=step + 1)
    size = path.stat().st_size
    led.mark("judged", ids, stage="A", step=9, policy_version=9)  # already judged: nothing written
    assert path.stat().st_size == size
    led.extend_a("gate-1")
    led.mark("used_for_rm", led.with_state("judged"), stage="B", step=0, policy_version=2)
    again = _ledger(path, extend_delta=4)
    assert again.summary() == led.summary() and again.torn is None
    assert again.summary()["states"] == {"scheduled": 6, "rolled_out": 6, "judged": 6, "used_for_rm": 6,
                                         "trained_on": 6}
    assert again.status(ids[0]) == led.status(ids[0])
    assert again.status(ids[0]).states["trained_on"].policy_version == 2
    assert again.peek("A", 4) == led.peek("A", 4)
    assert again.take("A", 4, step=2, policy_version=2) == led.take("A", 4, step=2, policy_version=2)
    assert again.take("A", 3, step=1, policy_version=1) == led.take("A", 3, step=1, policy_version=1)
    with pytest.raises(ValueError, match="another pass"):
        _ledger(path, extend_delta=4, seed=8)
    with pytest.raises(ValueError, match="another pass"):
        _ledger(path, extend_delta=4, n_a=9)


@pytest.mark.parametrize("tear", ["partial", "garbage_with_newline"])
def test_a_torn_last_line_is_dropped_reported_and_cut(tmp_path, tear):
    path = tmp_path / "c.jsonl"
    led = _ledger(path)
    led.take("A", 2, step=0, policy_version=0)
    expected = led.peek("A", 3)
    record = json.dumps({"kind": "take", "stage": "A", "step": 1, "policy_version": 1, "n": 3,
                         "ids": [c.id for c in expected]})
    with open(path, "a") as f:
        f.write(record[:25] if tear == "partial" else record[:25] + "\n")
    again = _ledger(path)
    assert again.torn is not None and "torn" in again.torn
    assert again.used["A"] == 2 and again.peek("A", 3) == expected
    assert again.take("A", 3, step=1, policy_version=1) == expected  # the lost take is taken again, cleanly
    third = _ledger(path)
    assert third.torn is None and {**third.summary(), "torn": again.torn} == again.summary()
    lines = path.read_text().splitlines()
    assert all(json.loads(line) for line in lines) and len(lines) == 3


def test_a_corrupt_line_before_the_last_raises_and_a_torn_header_restarts(tmp_path):
    path = tmp_path / "c.jsonl"
    led = _ledger(path)
    led.take("A", 2, step=0, policy_version=0)
    led.take("A", 2, step=1, policy_version=1)
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "{not json", lines[2]]) + "\n")
    with pytest.raises(ValueError, match="corrupt"):
        _ledger(path)
    header = tmp_path / "h.jsonl"
    header.write_text('{"kind": "head')
    fresh = _ledger(header)
    assert fresh.torn is not None and fresh.cursor == 0 and len(header.read_text().splitlines()) == 1


def test_random_interleavings_never_reuse_a_condition(tmp_path):
    rng = random.Random(0)
    for trial in range(20):
        n = rng.randint(1, 40)
        path = tmp_path / f"r{trial}.jsonl"
        led = _ledger(path, n=n, n_a=rng.randint(0, n), extend_delta=rng.randint(0, 5))
        steps = {"A": 0, "C": 0}
        handed: list[str] = []
        for _ in range(rng.randint(1, 30)):
            op = rng.random()
            if op < 0.1:
                led.extend_a(f"k{rng.randint(0, 3)}")
            elif op < 0.2:
                led = _ledger(path, n=n, n_a=led.header["n_a"], extend_delta=led.header["extend_delta"])
            else:
                stage = rng.choice("AC")
                handed += [c.id for c in led.take(stage, rng.randint(0, 6), step=steps[stage], policy_version=0)]
                steps[stage] += 1
        assert len(handed) == len(set(handed)) == led.cursor
        assert handed == [c.id for c in led.order[:led.cursor]]
        assert led.used["A"] <= led.budget("A") and led.used["C"] <= led.budget("C")


def test_a_mirror_follows_its_writer_and_never_writes(tmp_path):
    """The ranks other than 0 under torchrun hold a mirror: the same calls keep it equal to the writer's ledger, the
    file keeps one writer, and refresh() catches up with records only the writer made (stage B)."""
    path = tmp_path / "c.jsonl"
    with pytest.raises(ValueError, match="needs the ledger its writer created"):
        _ledger(path, writer=False)
    assert not path.exists()
    led = _ledger(path, extend_delta=4)
    mirror = _ledger(path, extend_delta=4, writer=False)
    for step in range(2):
        for book in (led, mirror):
            ids = [c.id for c in book.take("A", 3, step=step, policy_version=step)]
            book.mark("judged", ids, stage="A", step=step, policy_version=step)
    written = path.read_bytes()
    assert mirror.summary() == led.summary() and written.count(b"\n") == 1 + 2 * 2  # header + 2 x (take, mark)
    led.mark("used_for_rm", led.with_state("judged"), stage="B", step=0, policy_version=2)  # the writer alone
    assert mirror.summary() != led.summary()
    assert mirror.refresh() == 1 and mirror.summary() == led.summary() and mirror.refresh() == 0
    for book in (led, mirror):
        assert book.extend_a("gate-0") == 4
    assert mirror.summary() == led.summary() == _ledger(path, extend_delta=4).summary()
    assert path.read_bytes().count(b"\n") == 1 + 4 + 1 + 1  # the mirror's calls appended nothing
    path.write_bytes(path.read_bytes() + b'{"kind":"ma')  # torn: the writer repairs it, a mirror refuses
    with pytest.raises(ValueError, match="torn last record"):
        _ledger(path, extend_delta=4, writer=False)
