"""sampler.negative_prompt: the unconditional branch of classifier-free guidance encodes it; unused (warned) at 1."""

import torch

from flowforge.config import load_config
from flowforge.train.preflight import preflight
from flowforge.train.trainer import Trainer
from tests.train.test_trainer import tiny_cfg


def test_the_negative_prompt_is_what_the_unconditional_branch_encodes(tiny_model_dir, tmp_path, encode_cache_dir):
    def negative(name, *more):
        t = Trainer(tiny_cfg(tiny_model_dir, tmp_path, encode_cache_dir, f"run.name={name}",
                             "sampler.guidance_scale=2.0", *more), progress=False)
        return t.adapter, t.train_cond.negative.prompt_embeds

    adapter, default = negative("d")
    assert adapter.negative_prompt == ""
    adapter, blurry = negative("b", "sampler.negative_prompt=blurry, low quality")
    assert adapter.negative_prompt == "blurry, low quality" and "blurry" in adapter.encoder_id
    assert not torch.equal(default, blurry)  # another encoding, not the cached empty prompt's


def test_a_negative_prompt_without_guidance_is_warned():
    warnings = preflight(load_config(None, ["sampler.negative_prompt=ugly"]), this_machine=False).warnings
    assert any(w.startswith("sampler.negative_prompt='ugly' is not used") for w in warnings)
    warnings = preflight(load_config(None, ["sampler.negative_prompt=ugly", "sampler.guidance_scale=3"]),
                         this_machine=False).warnings
    assert not any("negative_prompt" in w for w in warnings)
