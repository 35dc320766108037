"""Preflight: every violation collected into one error; warnings returned separately."""

import pytest

from flowforge.config import load_config
from flowforge.train.preflight import PreflightError, preflight


def _problems(*overrides):
    with pytest.raises(PreflightError) as err:
        preflight(load_config(None, list(overrides)), world_size=1)
    return err.value.problems


def test_default_config_passes():
    assert preflight(load_config(None, []), world_size=1).warnings == ()


def test_five_violations_reported_together():
    problems = _problems("train.algorithm=ppo", "sampler.sde_kind=langevin", "advantage.std_mode=mad",
                         "lora.dropout=0.1", "reward.required=[digit, jpeg_compressibility]")
    text = "\n".join(problems)
    assert len(problems) == 5, problems
    assert "train.algorithm='ppo'" in text and "'grpo'" in text
    assert "sampler.sde_kind='langevin'" in text and "'cps'" in text
    assert "advantage.std_mode='mad'" in text
    assert "lora.dropout" in text
    assert "'jpeg_compressibility' but reward.weights has no weight" in text


@pytest.mark.parametrize("override", ["sampler.trained_indices=[9]", "sampler.sde_pool=[1, 9]"])
def test_last_step_is_never_trained(override):
    (p,) = _problems(override)
    assert "last step" in p and "allowed 0..8" in p


@pytest.mark.parametrize("override", ["sampler.trained_indices=[10]", "sampler.sde_pool=[-1, 2]"])
def test_index_outside_schedule(override):
    (p,) = _problems(override)
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
    (p,) = _problems("lora.trainable=full", "lora.rank=8")
    assert "lora.trainable='full'" in p
    (p,) = _problems("lora.rank=0")
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
                                     "train.lr=-1"]), world_size=1)
    problems = err.value.problems
    assert any(p.startswith("data.prompts: ") and "bad.jsonl:1: field 'metadata.sample_id'" in p for p in problems)
    assert any(p.startswith("data.eval_prompts: record 'demo-eval-t00-d0' has metadata.task='t2i' but "
                            "model.task='i2v' needs records with metadata.task in ['i2v']") for p in problems)
    assert any("train.lr" in p for p in problems)  # collected with every other violation
    with pytest.raises(PreflightError, match="is a directory; give a JSONL prompt file"):
        preflight(load_config(None, [f"data.prompts={tmp_path}"]), world_size=1)
    report = preflight(load_config(None, [f"data.prompts={tmp_path / 'elsewhere.jsonl'}"]), world_size=1)
    assert any(w.startswith("data.prompts=") and "no such file on this machine" in w for w in report.warnings)
