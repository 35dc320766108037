"""Policy bank in module mode (lora.trainable: module): live / old / ref / EMA hold exactly the trained submodules,
the rest is one shared frozen backbone; switching swaps the copies in and back."""

import pytest
import torch
from tests.models.world_model.wm_helpers import PROMPTS, make_adapter

from flowforge.config import LoraConfig, TrainConfig
from flowforge.policy import OptimizerSettings, Policy, TrainableWeights

B = "latent_state_rollout.transition"


def _policy(**kw):
    adapter = make_adapter()
    lora = LoraConfig(trainable="module", modules=(B,))
    policy = Policy(adapter, TrainableWeights.from_section(lora), OptimizerSettings.from_section(TrainConfig(lr=1e-2)),
                    10, **kw)
    return adapter, policy


def _inputs(adapter):
    gen = torch.Generator().manual_seed(0)
    cond = adapter.encode(PROMPTS)
    x = torch.randn(2, 1, 8, 32, 32, generator=gen)
    return x, torch.tensor([0.6, 0.4]), cond.__class__(**{**cond.__dict__, "image": x[:, :, :1]})


def test_bank_holds_exactly_the_trained_submodule():
    adapter, policy = _policy(keep_old=True, keep_ref=True, ema_decay=0.9)
    names = {f"{B}.{n}" for n, _ in adapter.transformer.get_submodule(B).named_parameters()}
    assert {n for n, p in adapter.transformer.named_parameters() if p.requires_grad} == names
    assert policy.num_trainable() == sum(p.numel() for p in adapter.transformer.get_submodule(B).parameters())
    for name in ("live", "old", "ref", "ema"):
        assert policy.has(name)
        if name != "ref":
            assert set(policy.named_weights(name)) == names  # only B, prefixed by its path
    copies = sum(p.numel() for m in policy._copies.values() for p in m.parameters())
    assert copies == 3 * policy.num_trainable()  # old, ref, ema: copies of B only, no second backbone


def test_switching_swaps_the_copies_and_ref_stays_immutable():
    adapter, policy = _policy(keep_old=True, keep_ref=True)
    x, sigma, cond = _inputs(adapter)
    live_b = adapter.transformer.get_submodule(B)
    with torch.no_grad():
        before = adapter.velocity(x, sigma, cond, 1.0)
    loss = adapter.velocity(x, sigma, cond, 1.0)[:, :, 1:].pow(2).mean()
    policy.backward(loss)
    policy.step()
    with torch.no_grad():
        after = adapter.velocity(x, sigma, cond, 1.0)
        with policy.using("ref"):
            assert adapter.transformer.get_submodule(B) is not live_b
            ref = adapter.velocity(x, sigma, cond, 1.0)
        with policy.using("old"):
            old = adapter.velocity(x, sigma, cond, 1.0)
    assert adapter.transformer.get_submodule(B) is live_b  # put back
    assert not torch.equal(after, before) and torch.equal(ref, before) and torch.equal(old, before)
    policy.blend("old", 0.0)
    with torch.no_grad(), policy.using("old"):
        assert torch.equal(adapter.velocity(x, sigma, cond, 1.0), after)
    state = policy.state_dict()
    assert set(state["weights"]) == {"live", "old"}
    policy.load_state_dict(state)


def test_module_mode_refusals():
    with pytest.raises(ValueError, match="not submodules"):
        Policy(make_adapter(), TrainableWeights(mode="module", rank=8, alpha=8.0, modules=("latent_state_rollout.b",)),
               OptimizerSettings.from_section(TrainConfig()), 10)
    with pytest.raises(ValueError, match="contain one another"):
        Policy(make_adapter(), TrainableWeights(mode="module", rank=8, alpha=8.0,
                                                modules=("latent_state_rollout", B)),
               OptimizerSettings.from_section(TrainConfig()), 10)
    with pytest.raises(Exception, match="lora.modules"):
        LoraConfig(trainable="module")
    with pytest.raises(Exception, match="lora.modules"):
        LoraConfig(trainable="full", modules=(B,))
