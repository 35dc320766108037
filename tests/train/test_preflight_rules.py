"""Rollout chunking: preflight names a rollout chunk / micro-batch pair whose first update is not an exact replay."""

import pytest

from flowforge.config import load_config
from flowforge.train.preflight import PreflightError, preflight
from flowforge.train.preflight.rules import chunking_warnings


def _warnings(*overrides):
    return chunking_warnings(load_config(None, ["data.prompts_per_step=4", "data.group_size=8", *overrides]))


def test_chunk_differs_from_micro_batch_is_named():
    # 32 rows, 2 updates of 16, micro-batches of 8: exact when the rollout chunk is 8 too (the default)
    assert _warnings() == [] and _warnings("sampler.batch_size=8") == []
    (text,) = _warnings("sampler.batch_size=16")
    assert text.startswith("sampler.batch_size=16 (the rollout chunk) differs from train.micro_batch_size=8: the "
                           "first update replays rows in batches of another shape")
    assert "train/first_update_ratio_dev" in text
    (text,) = _warnings("train.micro_batch_size=6")  # chunks of 6 straddle the update boundary at row 16
    assert text.startswith("each update's 16 rows per rank are not a multiple of train.micro_batch_size=6")
    assert _warnings("sampler.batch_size=16", "train.algorithm=nft") == []  # no replayed log-probs
    assert chunking_warnings(load_config(None, ["data.prompts_per_step=4", "data.group_size=8",
                                                "sampler.batch_size=16"]), world_size=2) != []


def test_preflight_reports_the_chunk_warning():
    report = preflight(load_config(None, ["sampler.batch_size=16"]), this_machine=False)
    assert any("sampler.batch_size=16 (the rollout chunk) differs" in w for w in report.warnings)
    report = preflight(load_config(None, []), this_machine=False)
    assert not any("rollout chunk" in w for w in report.warnings)


def test_dpm2_on_the_static_schedule_is_warned():
    from flowforge.train.preflight.rules import dpm2_warnings

    cfg = load_config(None, ["train.algorithm=nft", "forward.sampler=dpm2"])
    (text,) = dpm2_warnings(cfg)
    assert text.startswith("forward.sampler='dpm2' with sampler.schedule='static'")
    assert dpm2_warnings(load_config(None, ["train.algorithm=nft", "forward.sampler=dpm2", "sampler.schedule=wan"])) \
        == [] and dpm2_warnings(load_config(None, ["train.algorithm=nft"])) == []
    assert dpm2_warnings(load_config(None, ["forward.sampler=dpm2"])) == []  # grpo does not roll out with it


def test_a_module_lora_run_that_export_cannot_write_is_warned():
    """module+lora trains for every family but exports only for the families with a format of their own (the world
    model): preflight says so before training a diffusers family that way."""
    from flowforge.train.preflight.rules import export_warnings

    module_lora = ["lora.trainable=module+lora", "lora.modules=[transformer_blocks.0.ff]"]
    (text,) = export_warnings(load_config(None, module_lora))
    assert text.startswith("lora.trainable='module+lora' with model.adapter='sd3': the run trains")
    assert "flowforge export cannot write it yet (only ['world_model'])" in text
    assert export_warnings(load_config(None, [*module_lora, "model.adapter=world_model"])) == []
    assert export_warnings(load_config(None, ["lora.trainable=module", "lora.modules=[transformer_blocks.0.ff]"])) == []
    report = preflight(load_config(None, module_lora), this_machine=False)
    assert any(w.startswith("lora.trainable='module+lora' with model.adapter='sd3'") for w in report.warnings)


def test_dppo_refuses_a_sampler_kind_without_a_gaussian_density():
    with pytest.raises(PreflightError) as err:
        preflight(load_config(None, ["train.algorithm=dppo", "sampler.sde_kind=cps"]), this_machine=False)
    assert err.value.problems == ["sampler.sde_kind='cps' is not allowed with train.algorithm='dppo' (the divergence "
                                  "mask needs a Gaussian transition density); allowed: ['sde', 'dance']"]
    for kind in ("sde", "dance"):  # accepted (preflight returns a report, no PreflightError)
        preflight(load_config(None, ["train.algorithm=dppo", f"sampler.sde_kind={kind}"]), this_machine=False)
    preflight(load_config(None, ["train.algorithm=grpo", "sampler.sde_kind=cps"]), this_machine=False)
