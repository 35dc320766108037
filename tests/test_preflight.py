"""Preflight: every violation collected into one error; warnings returned separately. Rules of one section are
checked when the config loads (every section's problems in one ConfigError); preflight checks the rest."""

import pytest

from flowforge.config import ConfigError, load_config
from flowforge.train.preflight import PreflightError, preflight


def _problems(*overrides):
    with pytest.raises(PreflightError) as err:
        preflight(load_config(None, list(overrides)), world_size=1)
    return err.value.problems


def _load_problems(*overrides):
    """Problems of rules that a section checks itself: reported by ``load_config``, before preflight."""
    with pytest.raises(ConfigError) as err:
        load_config(None, list(overrides))
    assert not isinstance(err.value, PreflightError)
    return err.value.problems


def test_default_config_passes():
    assert preflight(load_config(None, []), world_size=1).warnings == ()


def test_five_violations_reported_together():
    problems = _problems("train.algorithm=ppo", "sampler.sde_kind=langevin", "advantage.std_mode=mad",
                         "model.dtype=fp8", "distributed.strategy=zero")
    text = "\n".join(problems)
    assert len(problems) == 5, problems
    assert "train.algorithm='ppo'" in text and "'grpo'" in text
    assert "sampler.sde_kind='langevin'" in text and "'cps'" in text
    assert "advantage.std_mode='mad'" in text
    assert "model.dtype='fp8' is not one of ['float32', 'bfloat16', 'float16']" in text
    assert "distributed.strategy='zero' is not one of ['ddp', 'fsdp']" in text


def test_section_violations_reported_together_at_load():
    problems = _load_problems("lora.dropout=0.1", "reward.required=[digit, jpeg_compressibility]", "train.lr=-1",
                              "train.lr_schedule=step", "nft.ema_decay=1.0", "checkpoint.keep=0")
    text = "\n".join(problems)
    assert len(problems) == 6, problems
    assert "lora.dropout" in text
    assert "'jpeg_compressibility' but reward.weights has no weight" in text
    assert "train.lr=-1.0 must be > 0" in text
    assert "train.lr_schedule='step' is not one of ['constant', 'linear', 'cosine']" in text
    assert "nft.ema_decay=1.0 must be in [0, 1)" in text and "checkpoint.keep=0 must be >= 1" in text


@pytest.mark.parametrize("override", ["sampler.trained_indices=[9]", "sampler.sde_pool=[1, 9]"])
def test_last_step_is_never_trained(override):
    (p,) = _load_problems(override)
    assert "last step" in p and "allowed 0..8" in p


@pytest.mark.parametrize("override", ["sampler.trained_indices=[10]", "sampler.sde_pool=[-1, 2]"])
def test_index_outside_schedule(override):
    (p,) = _load_problems(override)
    assert "outside [0, 10)" in p


def test_step_zero_undefined_where_kernel_std_is_zero():
    # "cps" has std = sigma_next * sin(eta pi / 2): eta 0 makes every step degenerate, step 0 included.
    problems = _problems("sampler.sde_kind=cps", "sampler.noise_level=0.0", "sampler.trained_indices=[0]")
    assert len(problems) == 1 and "trained step 0" in problems[0]


def test_updates_must_divide_per_rank_batch():
    (p,) = _problems("train.num_updates_per_batch=3")
    assert "does not divide the per-rank batch 32" in p
    (p,) = _problems("data.group_size=6", "train.micro_batch_size=8")  # 24 / 2 = 12 not divisible by 8
    assert "micro_batch_size=8 does not divide the per-update batch 12" in p
    with pytest.raises(PreflightError, match="world size 3"):
        preflight(load_config(None, []), world_size=3)


def test_single_update_with_clipped_objective_needs_opt_in():
    (p,) = _problems("train.num_updates_per_batch=1", "train.micro_batch_size=8")
    assert "identically 1" in p and "allow_unit_ratio" in p
    preflight(load_config(None, ["train.num_updates_per_batch=1", "train.allow_unit_ratio=true"]), world_size=1)


def test_group_of_one_with_group_std_is_a_warning():
    cfg = load_config(None, ["data.group_size=1", "data.prompts_per_step=8", "train.micro_batch_size=4"])
    warnings = preflight(cfg, world_size=1).warnings
    assert len(warnings) == 1 and "every advantage is 0" in warnings[0]


@pytest.mark.parametrize("algorithm", ["grpo", "grpo_guard", "nft"])
def test_guidance_is_allowed_for_every_objective(algorithm):
    """Replay objectives replay the guided velocity (ratio 1 tested in test_trainer / test_families_loop)."""
    preflight(load_config(None, ["sampler.guidance_scale=4.5", f"train.algorithm={algorithm}"]), world_size=1)


def test_lora_mode_disagreement():
    (p,) = _load_problems("lora.trainable=full", "lora.rank=8")
    assert "lora.trainable='full'" in p
    (p,) = _load_problems("lora.rank=0")
    assert "lora.rank=0 must be >= 1" in p


def test_unknown_reward_component():
    problems = _problems("reward.weights={sharpness: 1.0}", "reward.required=[]")
    assert any("unknown component 'sharpness'" in p and "'digit'" in p for p in problems)


def test_multi_rank_limits_of_group_objectives():
    with pytest.raises(PreflightError) as err:
        preflight(load_config(None, ["train.algorithm=dgpo", "data.prompts_per_step=3", "train.micro_batch_size=4",
                                     "train.num_updates_per_batch=1", "data.group_size=4"]), world_size=2)
    assert "whole groups" in str(err.value)  # 12 candidates / 2 ranks = 6, not a multiple of 4
    preflight(load_config(None, ["train.algorithm=dpo"]), world_size=2)  # ranks that pair fewer rows pad
    preflight(load_config(None, ["train.algorithm=nft", "nft.guard=true"]), world_size=2)
    preflight(load_config(None, ["train.algorithm=dgpo"]), world_size=2)  # 32 / 2 = 16 = 2 groups of 8


def test_prompt_files_are_checked_before_any_model_loads(tmp_path):
    """Prompt files present on this machine are validated with the rest of the config (one error listing all);
    a file absent here is only a warning (a config written for another machine)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a cat", "metadata": {"task": "t2i"}}\n')
    with pytest.raises(PreflightError) as err:
        preflight(load_config(None, [f"data.prompts={bad}", "model.task=i2v", "model.adapter=wan", "model.frames=5",
                                     "train.algorithm=ppo"]), world_size=1)
    problems = err.value.problems
    assert any(p.startswith("data.prompts: ") and "bad.jsonl:1: field 'metadata.sample_id'" in p for p in problems)
    assert any(p.startswith("data.eval_prompts: record 'demo-eval-t00-d0' has metadata.task='t2i' but "
                            "model.task='i2v' needs records with metadata.task in ['i2v']") for p in problems)
    assert any("train.algorithm" in p for p in problems)  # collected with every other violation
    with pytest.raises(PreflightError, match="is a directory; give a JSONL prompt file"):
        preflight(load_config(None, [f"data.prompts={tmp_path}"]), world_size=1)
    report = preflight(load_config(None, [f"data.prompts={tmp_path / 'elsewhere.jsonl'}"]), world_size=1)
    assert any(w.startswith("data.prompts=") and "no such file on this machine" in w for w in report.warnings)


def test_reward_device_is_not_read_and_says_so():
    warnings = preflight(load_config(None, ["reward.device=cuda"]), world_size=1).warnings
    assert len(warnings) == 1 and "reward.device='cuda' is not read" in warnings[0]
    assert "reward.options.<name>.device" in warnings[0]


def test_algorithm_rules_come_from_the_objective_class():
    """Preflight reaches each algorithm's cross-section rules through the registry."""
    from flowforge.objectives import OBJECTIVES

    cfg = load_config(None, ["sampler.sde_kind=ode", "train.algorithm=grpo_guard"])
    expected = OBJECTIVES["grpo_guard"].preflight_problems(cfg, world_size=1)
    assert len(expected) == 1 and "a log-prob objective needs a stochastic kernel" in expected[0]
    assert _problems("sampler.sde_kind=ode", "train.algorithm=grpo_guard") == expected
    assert OBJECTIVES["nft"].preflight_problems(load_config(None, ["sampler.sde_kind=ode"]), world_size=1) == []
