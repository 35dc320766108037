"""Preflight on guidance: a ``sampler.guidance_scale`` the family's pipeline never guides with is one warning line
once the model is loaded (the adapter's ``guidance_use`` / ``cfg_rule``); the family ``sampler`` keys (LTX-2's audio
guidance, rescale, frame rate) are refused for an adapter that does not read them."""
from __future__ import annotations

import pytest

from flowforge.config import ConfigError, load_config
from flowforge.train.preflight import PreflightError, check_loaded_model, preflight
from flowforge.train.preflight.loaded import guidance_warnings


@pytest.fixture(scope="module")
def sd3(tiny_model_dir):
    from flowforge.models import build_adapter

    return build_adapter("sd3", str(tiny_model_dir))


def test_guidance_below_one_warns_that_it_means_no_cfg(sd3):
    warnings = check_loaded_model(load_config(None, ["sampler.guidance_scale=0.5"]), sd3)
    assert warnings == ["sampler.guidance_scale=0.5 means no CFG for model.adapter='sd3': its pipeline guides only "
                        "when guidance_scale > 1, so this samples exactly as guidance_scale=1 (the conditional "
                        "velocity alone)"]
    for g in ("1.0", "4.0"):  # the default, and a value the pipeline guides with
        assert guidance_warnings(load_config(None, [f"sampler.guidance_scale={g}"]), sd3) == []


def test_each_family_rule_decides_the_warning():
    """Guidance-embedding FLUX.1-dev uses every value (no warning); HunyuanVideo's guider guides at 0.5 (no
    warning); a step-distilled FLUX.2 Klein ignores any value (a warning at 4)."""
    from flowforge.models.flux.adapter import FluxAdapter
    from flowforge.models.flux2.adapter import Flux2Adapter
    from flowforge.models.hunyuan_video15.adapter import HunyuanVideo15Adapter

    from types import SimpleNamespace

    def bare(cls, guidance_embeds=False, **state):  # the rule without weights: a transformer config only
        adapter = object.__new__(cls)
        adapter.transformer = SimpleNamespace(config=SimpleNamespace(guidance_embeds=guidance_embeds))
        adapter.__dict__.update(state)
        return adapter

    dev, hunyuan = bare(FluxAdapter, guidance_embeds=True), bare(HunyuanVideo15Adapter)
    klein = bare(Flux2Adapter, is_distilled=True)
    half, four = (load_config(None, [f"sampler.guidance_scale={g}"]) for g in (0.5, 4.0))
    assert guidance_warnings(half, dev) == [] and guidance_warnings(half, hunyuan) == []
    (line,) = guidance_warnings(four, klein)
    assert line.startswith("sampler.guidance_scale=4.0 means no CFG") and "step-distilled Klein" in line


def test_family_sampler_keys_are_refused_where_unread_and_validated():
    from flowforge.models import option_problems

    with pytest.raises(PreflightError) as err:
        preflight(load_config(None, ["sampler.frame_rate=25"]), world_size=1, this_machine=False)
    assert ("sampler.frame_rate=25.0 is not read by model.adapter='sd3' (it reads none of these keys); remove it"
            in err.value.problems)
    assert option_problems("ltx2", {"frame_rate": 25.0, "audio_guidance_scale": 5.0, "guidance_rescale": 0.0,
                                    "audio_guidance_rescale": 0.3}) == []
    with pytest.raises(ConfigError, match=r"sampler.guidance_rescale=1.5 must be in \[0, 1\]"):
        load_config(None, ["sampler.guidance_rescale=1.5"])
    with pytest.raises(ConfigError, match="sampler.frame_rate=0"):
        load_config(None, ["sampler.frame_rate=0"])
