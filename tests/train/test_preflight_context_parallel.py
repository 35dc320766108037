"""Preflight of ``distributed.context_parallel``: one line per problem, naming the key and what is allowed."""

import pytest

from flowforge.config import ConfigError, load_config
from flowforge.train.preflight import PreflightError, preflight


def _problems(*overrides, world=2):
    with pytest.raises(PreflightError) as err:
        preflight(load_config(None, list(overrides)), world_size=world, this_machine=False)
    return err.value.problems


def test_off_by_default_and_section_checks_its_values():
    cfg = load_config(None, [])
    assert cfg.distributed.context_parallel.degree == 1
    preflight(cfg, world_size=2, this_machine=False)  # off: no rule applies
    with pytest.raises(ConfigError) as err:
        load_config(None, ["distributed.context_parallel.ulysses=0", "distributed.context_parallel.ring=-1"])
    assert err.value.problems == ["distributed.context_parallel.ulysses=0 must be an integer >= 1 (1 = off)",
                                  "distributed.context_parallel.ring=-1 must be an integer >= 1 (1 = off)"]
    with pytest.raises(ConfigError, match="unknown key 'distributed.context_parallel.ulyses'.*did you mean"):
        load_config(None, ["distributed.context_parallel.ulyses=2"])


def test_family_without_a_cp_plan_is_refused_in_one_line_listing_those_with_one():
    (family,) = [p for p in _problems("distributed.context_parallel.ulysses=2") if "model.adapter" in p]
    assert "\n" not in family
    assert "model.adapter='sd3' cannot (SD3Transformer2DModel declares no _cp_plan)" in family
    assert "families that support it: ['flux', 'flux2', 'qwen_image', 'wan']" in family
    ltx2 = _problems("distributed.context_parallel.ulysses=2", "model.adapter=ltx2", "model.task=t2v",
                     "model.frames=5")
    assert any("'ltx2' cannot (its transformer's _cp_plan splits only interleaved RoPE" in p for p in ltx2)
    wan = _problems("distributed.context_parallel.ulysses=2", "model.adapter=wan", "model.task=t2v", "model.frames=5")
    assert not any("model.adapter" in p for p in wan)


def test_degrees_against_the_world_size_and_ring_backend():
    problems = _problems("distributed.context_parallel.ulysses=2", "distributed.context_parallel.ring=2", world=6)
    assert any("ulysses x ring = 2 x 2 = 4 does not divide the world size 6" in p for p in problems)
    assert any("distributed.context_parallel.ring=2 needs distributed.context_parallel.attention_backend set to one "
               "of ['flash'," in p and "got None" in p for p in problems)
    one = _problems("distributed.context_parallel.ulysses=2", world=1)
    assert any("2 ranks per sample, but 1 rank(s) run; launch with torchrun --nproc_per_node=2" in p for p in one)
    ok = _problems("distributed.context_parallel.ring=2", "distributed.context_parallel.attention_backend=flash",
                   world=4)
    assert not any("attention_backend" in p or "world size" in p for p in ok)


def test_training_refuses_context_parallelism_until_it_is_wired():
    problems = _problems("distributed.context_parallel.ulysses=2", "model.adapter=wan", "model.task=t2v",
                         "model.frames=5")
    assert any("is not wired into training yet" in p for p in problems)
