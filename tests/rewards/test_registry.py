"""The name -> factory registry (:mod:`flowforge.rewards.registry`) and the package-level re-exports."""

import pytest

import flowforge.rewards
from flowforge.rewards.base import RewardScorer
from flowforge.rewards.registry import SCORERS, build_scorer


def test_registry_builds_every_scorer_and_lists_names_on_error():
    builtin = ("digit", "digit_eval", "jpeg_compressibility", "jpeg_incompressibility")
    assert set(SCORERS) >= set(builtin)
    for name in builtin:
        scorer = build_scorer(name)
        assert isinstance(scorer, RewardScorer)
        assert scorer.name == name and scorer.needs_group is False
    assert build_scorer("jpeg_compressibility", quality=50).quality == 50
    with pytest.raises(ValueError, match="allowed names.*digit.*jpeg_compressibility.*jpeg_incompressibility"):
        build_scorer("clip")


def test_every_registered_name_is_the_scorers_own_name():
    # metrics and config keys use the registry name; a factory whose ``name`` differs would log under another key
    per_sample = {"digit", "digit_eval", "jpeg_compressibility", "jpeg_incompressibility", "pickscore", "clip_score",
                  "aesthetic", "hps"}
    assert set(SCORERS) >= per_sample
    for name, factory in SCORERS.items():
        assert factory.name == name, (name, factory)
        assert isinstance(factory.needs_group, bool)
    assert all(SCORERS[name].needs_group is False for name in per_sample)


def test_package_reexports_the_registry():
    assert flowforge.rewards.SCORERS is SCORERS
    assert flowforge.rewards.build_scorer is build_scorer
    with pytest.raises(TypeError):
        build_scorer("jpeg_compressibility", qualty=50)  # a misspelt option is the factory's own error
