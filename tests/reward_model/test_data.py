"""Judged groups read back from the judge's request ledger, and the cluster split (no cluster in two splits)."""

from __future__ import annotations

import random
import shutil
from collections import Counter

import pytest

from flowforge.data.clusters import text_cluster
from flowforge.reward_model.data import (
    SPLITS, group_from_dict, group_message, group_to_dict, read_judged_groups, score_answer, split_groups, split_of,
)
from flowforge.rewards.judge import protocol as P
from flowforge.rewards.judge.ledger import LedgerEntry, RequestLedger
from tests.reward_model import support


@pytest.fixture(scope="module")
def stage_a(tmp_path_factory):
    run = tmp_path_factory.mktemp("stage-a")
    return run, support.judged_ledger(run, 4, prompts=3)


def test_groups_come_back_as_the_teacher_saw_and_scored_them(stage_a):
    run, ledger_path = stage_a
    groups = read_judged_groups(ledger_path, clusters={"cond-0": "zero"})
    ledger = RequestLedger(ledger_path)
    entries = [ledger.get(k) for k in ledger.keys()]
    ledger.close()
    assert [g.key for g in groups] == [e.key for e in entries] and len(groups) == 4
    for group, entry in zip(groups, entries):
        assert group.labels == ("A", "B", "C", "D") and group.prompt == entry.request["prompt"]
        assert group.scores == tuple(entry.scores[label] for label in group.labels)
        assert sorted(group.permutation) == [0, 1, 2, 3] and group.reference is None
        message = group_message(group)
        content = message[0]["content"]
        assert content[0]["text"] == entry.request["instructions"] and content[1]["text"] == f"Prompt: {group.prompt}"
        sent = [P.sha256_hex(P.decode_data_url(p["image_url"]["url"])) for p in content if p["type"] == "image_url"]
        assert sent == [f["sha256"] for frames in entry.request["candidates"] for f in frames]  # presented order
        assert P.parse_scores(score_answer(group), group.labels) == pytest.approx(group.scores, abs=0.005)
    assert [g.condition_id for g in groups] == ["cond-0", "cond-1", "cond-2", "cond-0"]
    assert groups[0].cluster == "zero" and groups[1].cluster == text_cluster("prompt 1")  # map, else the text
    assert group_from_dict(group_to_dict(groups[1])) == groups[1]


def test_a_group_without_side_images_rebuilds_the_message_sent_byte_for_byte(tmp_path):
    """No reference, condition frame or examples: the rebuilt message has no empty header for them."""
    from tests.serve.judge_support import group

    judge = support.judge_with_teacher(tmp_path)
    sent, answer = [], judge._send
    judge._send = lambda messages: sent.append(messages[0]["content"]) or answer(messages)
    media, _, _ = group(2000, k=4, size=16)
    judge(media, ["prompt 0"] * 4, [{"sample_id": "cond-0"}] * 4)
    judge.close()
    [rebuilt] = read_judged_groups(tmp_path / "judge" / "ledger.sqlite")
    assert rebuilt.condition is None and rebuilt.examples is None and rebuilt.reference is None
    assert group_message(rebuilt)[0]["content"] == sent[0]


def test_frames_are_found_by_hash_after_the_run_moved_and_bad_rows_are_skipped(tmp_path):
    run = tmp_path / "run"
    support.judged_ledger(run, 4, prompts=3)
    moved = tmp_path / "moved"
    shutil.copytree(run, moved)  # the stored absolute paths now point at the old place ...
    shutil.rmtree(run / "judge" / "media")
    groups = read_judged_groups(moved / "judge" / "ledger.sqlite")  # ... so frames are found under media/<sha>
    assert len(groups) == 4 and all(str(moved) in p for g in groups for c in g.candidates for p in c)
    ledger = RequestLedger(moved / "judge" / "ledger.sqlite")
    request = ledger.get(ledger.keys()[0]).request
    ledger.record(LedgerEntry(key="bad", model="t", template_sha256="x", status="malformed", scores=None,
                              request=request, response=[], prompt_tokens=0, completion_tokens=0, latency_s=0.0,
                              attempts=1))
    ledger.close()
    first = request["candidates"][0][0]["sha256"]
    (moved / "judge" / "media" / first[:2] / f"{first}.jpg").unlink()
    left = read_judged_groups(moved / "judge" / "ledger.sqlite")
    assert len(left) == 3 and "bad" not in {g.key for g in left}  # malformed and frame-less rows skipped
    with pytest.raises(FileNotFoundError):
        read_judged_groups(tmp_path / "nothing.sqlite")


def test_a_changed_frame_is_refused(tmp_path):
    group = support.synthetic_groups(tmp_path, 1)[0]
    with open(group.candidates[0][0], "ab") as f:
        f.write(b"x")
    with pytest.raises(ValueError, match="sha256"):
        group_message(group)


def test_the_split_never_puts_a_cluster_in_two_splits():
    rng = random.Random(0)
    for trial in range(30):
        seed = rng.randint(0, 10**6)
        n_clusters = rng.randint(1, 400)
        names = [f"{rng.random():.12f}-{i}" for i in range(n_clusters)]
        clusters = [rng.choice(names) for _ in range(rng.randint(1, 1200))]
        fractions = rng.choice([(0.8, 0.1, 0.1), (0.5, 0.25, 0.25), (1.0, 0.0, 0.0), (0.0, 0.0, 1.0)])
        where: dict[str, set[str]] = {}
        for cluster in clusters:
            where.setdefault(cluster, set()).add(split_of(cluster, seed, fractions))
        assert all(len(splits) == 1 for splits in where.values())  # no leakage
        for split, fraction in zip(SPLITS, fractions):
            if fraction == 0:
                assert all(split not in s for s in where.values())
    # over many clusters the shares follow the fractions, and more groups never move a cluster
    counts = Counter(split_of(f"c{i}", 3) for i in range(20000))
    assert abs(counts["train"] / 20000 - 0.8) < 0.01 and abs(counts["val"] / 20000 - 0.1) < 0.01
    assert [split_of(f"c{i}", 3) for i in range(100)] == [split_of(f"c{i}", 3) for i in range(100)]
    assert [split_of(f"c{i}", 3) for i in range(200)] != [split_of(f"c{i}", 4) for i in range(200)]
    with pytest.raises(ValueError, match="fractions"):
        split_of("c", 0, (0.5, 0.5, 0.5))


def test_split_groups_keeps_every_group_of_a_cluster_together(tmp_path):
    groups = support.synthetic_groups(tmp_path, 60, clusters=12)
    splits = split_groups(groups, seed=1)
    assert sum(len(v) for v in splits.values()) == 60
    seen = {s: {g.cluster for g in splits[s]} for s in SPLITS}
    assert not (seen["train"] & seen["val"]) and not (seen["train"] & seen["test"]) and not (seen["val"] &
                                                                                              seen["test"])
    assert [g.key for g in splits["train"]] == [g.key for g in groups if split_of(g.cluster, 1) == "train"]
