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
    assert "families that support it: ['flux', 'flux2', 'ltx2', 'qwen_image', 'wan']" in family
    preflight(load_config(None, ["distributed.context_parallel.ring=2", "model.adapter=ltx2", "model.task=t2v",
                                 "model.frames=5"]), world_size=2, this_machine=False)  # Ulysses: once loaded
    preflight(load_config(None, ["distributed.context_parallel.ulysses=2", "model.adapter=wan", "model.task=t2v",
                                 "model.frames=5"]), world_size=2, this_machine=False)


def test_degrees_against_the_world_size_and_ring_backend():
    problems = _problems("distributed.context_parallel.ulysses=2", "distributed.context_parallel.ring=2", world=6)
    assert any("ulysses x ring = 2 x 2 = 4 does not divide the world size 6; launch a multiple of 4 ranks" in p
               for p in problems)
    assert not any("attention_backend" in p for p in problems)  # on CPU ring runs on PyTorch's CPU flash kernel
    cuda = _problems("distributed.context_parallel.ring=2", "run.device=cuda", world=2)
    assert any("distributed.context_parallel.ring=2 on run.device='cuda' needs distributed.context_parallel."
               "attention_backend set to one of ['flash'," in p and "got None" in p for p in cuda)
    other = _problems("distributed.context_parallel.ring=2", "distributed.context_parallel.attention_backend=flex")
    assert any("ring=2 on run.device='cpu' needs" in p and "got 'flex'" in p for p in other)
    one = _problems("distributed.context_parallel.ulysses=2", world=1)
    assert any("2 ranks per sample, but 1 rank(s) run; launch with torchrun --nproc_per_node=2 (or a multiple)" in p
               for p in one)
    ok = _problems("distributed.context_parallel.ring=2", "distributed.context_parallel.attention_backend=flash",
                   world=4)
    assert not any("attention_backend" in p or "world size" in p or "rank(s) run" in p for p in ok)
    workers = _problems("distributed.context_parallel.ulysses=2", "rollout.engine=workers")
    assert any("distributed.context_parallel needs rollout.engine=local (got 'workers')" in p for p in workers)


def test_a_context_group_shares_its_samples_in_the_batch_rules():
    """2 ranks of one context group hold the whole batch: 3 prompts x 2 = 6 candidates in micro-batches of 6 fit
    (per-rank batch 6), which data parallelism on 2 ranks would refuse (per-rank batch 3)."""
    base = ["model.adapter=wan", "model.task=t2v", "model.frames=5", "data.prompts_per_step=3", "data.group_size=2",
            "train.micro_batch_size=6", "train.num_updates_per_batch=1", "train.allow_unit_ratio=true"]
    assert any("micro_batch_size" in p for p in _problems(*base))
    preflight(load_config(None, [*base, "distributed.context_parallel.ulysses=2"]), world_size=2,
              this_machine=False)


class PaidBrightness:
    """A scorer that declares its calls cost money."""

    name, needs_group, paid = "paid_brightness", False, True

    def __call__(self, media, prompts, metadata):
        return media.float().mean(dim=(1, 2, 3))


def test_paid_reward_components_are_refused_under_context_parallelism(tmp_path):
    from flowforge.runtime.errors import UserError
    from flowforge.train.scorer_checks import build_reward_processor

    spec = "tests.train.test_preflight_context_parallel:PaidBrightness"
    overrides = [f"reward.weights={{'{spec}': 1.0}}", "reward.required=[]", "eval.scorers=[]"]
    build_reward_processor(load_config(None, overrides), None, tmp_path)  # without context parallelism: fine
    with pytest.raises(UserError, match=r"the paid reward components \['tests.train.test_preflight_context_parallel:"
                                        r"PaidBrightness'\] would be billed once per rank"):
        build_reward_processor(load_config(None, [*overrides, "distributed.context_parallel.ulysses=2"]), None,
                               tmp_path)


def test_ring_off_cpu_is_refused_for_families_whose_attention_takes_a_key_mask():
    """diffusers' ring loop hands a rank's own key mask to every visited chunk (corrected on CPU only): Qwen-Image and
    LTX-2 under ring on CUDA are refused in one line; Ulysses for them, and ring for the unmasked families, are not."""
    gpu = ["run.device=cuda", "distributed.context_parallel.attention_backend=flash"]
    qwen = _problems("distributed.context_parallel.ring=2", "model.adapter=qwen_image", *gpu)
    (line,) = [p for p in qwen if "key mask" in p]
    assert "ring=2 on run.device='cuda' is refused for model.adapter='qwen_image'" in line and "\n" not in line
    assert "['flux', 'flux2', 'wan']" in line
    ltx = ["model.adapter=ltx2", "model.task=t2v", "model.frames=5"]
    (line,) = [p for p in _problems("distributed.context_parallel.ring=2", *ltx, *gpu) if "key mask" in p]
    assert "no context parallelism is left for it off CPU" in line and "ulysses instead" not in line
    assert "use distributed.context_parallel.ulysses instead" in [p for p in qwen if "key mask" in p][0]
    for fine in (["distributed.context_parallel.ulysses=2", "model.adapter=qwen_image", *gpu],
                 ["distributed.context_parallel.ring=2", "model.adapter=wan", "model.task=t2v", "model.frames=5", *gpu],
                 ["distributed.context_parallel.ring=2", "model.adapter=qwen_image"]):  # on CPU: corrected
        try:
            preflight(load_config(None, fine), world_size=2, this_machine=False)
        except PreflightError as err:  # other rules may object (a CUDA config checked here); not this one
            assert not any("key mask" in p for p in err.problems)
