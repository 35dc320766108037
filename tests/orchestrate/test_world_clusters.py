"""``demo:world`` rows are clustered by episode, so the student's train / val / test split keeps every episode whole:
clips of one episode share its start frames' look, its ball and its score, and a held-out clip whose episode was
trained on would flatter the gate."""

from __future__ import annotations

import pytest

from flowforge.data.prompts import load_prompts
from flowforge.orchestrate.ledger import conditions_from_records
from flowforge.reward_model.config import StudentConfig
from flowforge.reward_model.data import split_clusters


@pytest.mark.parametrize("split_seed", [0, 1, 2])
def test_no_world_episode_straddles_the_student_split(split_seed):
    records = load_prompts("demo:world-train")
    conditions = conditions_from_records(records)
    fractions = StudentConfig().split
    split = split_clusters([c.cluster for c in conditions], split_seed, fractions)
    episode_of = {r.metadata["sample_id"]: r.metadata["episode"] for r in records}
    splits_of_episode: dict[int, set[str]] = {}
    for c in conditions:
        splits_of_episode.setdefault(episode_of[c.id], set()).add(split[c.cluster])
    assert len(splits_of_episode) == 56
    assert all(len(s) == 1 for s in splits_of_episode.values()), {
        e: s for e, s in splits_of_episode.items() if len(s) > 1}
    assert {next(iter(s)) for s in splits_of_episode.values()} == {"train", "val", "test"}
