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


def _module_lora_policy(**kw):
    adapter = make_adapter()
    lora = LoraConfig(trainable="module+lora", modules=(B,), rank=4, alpha=8.0)
    policy = Policy(adapter, TrainableWeights.from_section(lora), OptimizerSettings.from_section(TrainConfig(lr=1e-2)),
                    10, **kw)
    return adapter, policy


def test_module_lora_bank_holds_the_module_copies_and_named_adapters():
    from flowforge.models import lora as lora_lib

    adapter, policy = _module_lora_policy(keep_old=True, keep_ref=True, ema_decay=0.5)
    t = adapter.transformer
    b_names = {f"{B}.{k}" for k in t.get_submodule(B).state_dict()}
    lora_keys = set(lora_lib.lora_parameters(t, "default"))
    assert lora_keys and all(".coupling." in k for k in lora_keys) and not b_names & lora_keys
    assert lora_lib.adapter_names(t) == ["default", "ema", "old"]  # ref = adapters off: no adapter of its own
    assert set(policy._copies) == {"old", "ref", "ema"}  # copies of B only
    for name in ("live", "old", "ema"):
        assert set(policy.named_weights(name)) == b_names | lora_keys
    trained = {id(p) for p in policy.params}
    assert trained == {id(p) for p in t.get_submodule(B).parameters()} | {
        id(p) for p in lora_lib.lora_parameters(t, "default").values()}
    x, sigma, cond = _inputs(adapter)
    with torch.no_grad():
        before = adapter.velocity(x, sigma, cond, 1.0)
    for _ in range(2):  # two steps: LoRA's B moves on the first, its A on the second
        policy.backward(adapter.velocity(x, sigma, cond, 1.0)[:, :, 1:].pow(2).mean())
        policy.step()
    live = policy.named_weights("live")
    moved = {k for k, v in live.items() if not torch.equal(v, policy.named_weights("old")[k])}
    assert moved & b_names and moved & lora_keys  # both kinds trained
    with torch.no_grad():
        after = adapter.velocity(x, sigma, cond, 1.0)
        with policy.using("ref"):
            ref = adapter.velocity(x, sigma, cond, 1.0)
        with policy.using("old"):
            old = adapter.velocity(x, sigma, cond, 1.0)
            assert lora_lib.active_adapter(t) == "old" and t.get_submodule(B) is policy._copies["old"][0]
    assert lora_lib.active_adapter(t) == "default" and t.get_submodule(B) is not policy._copies["old"][0]
    assert not torch.equal(after, before) and torch.equal(ref, before) and torch.equal(old, before)
    ema = policy.named_weights("ema")  # blended after each step toward live: both kinds moved
    assert any(not torch.equal(ema[k], live[k]) for k in b_names) and any(ema[k].abs().sum() > 0 for k in lora_keys
                                                                          if ".lora_B." in k)
    policy.blend("old", 0.0)  # old <- live, both kinds
    with torch.no_grad(), policy.using("old"):
        assert torch.equal(adapter.velocity(x, sigma, cond, 1.0), after)
    state = policy.state_dict()
    _, other = _module_lora_policy(keep_old=True, keep_ref=True, ema_decay=0.5)
    other.load_state_dict(state)
    for name in ("live", "old", "ema"):
        assert all(torch.equal(v, policy.named_weights(name)[k]) for k, v in other.named_weights(name).items())


def test_module_lora_refuses_a_lora_layer_inside_a_trained_module():
    for modules, where in ((("blocks.0.coupling",), "contains the LoRA layer 'blocks.0.coupling.q'"),
                           (("blocks.0.coupling.k",), "is the LoRA layer 'blocks.0.coupling.k'")):
        with pytest.raises(ValueError, match=where):
            Policy(make_adapter(), TrainableWeights(mode="module+lora", rank=4, alpha=4.0, modules=modules),
                   OptimizerSettings.from_section(TrainConfig()), 10)
    with pytest.raises(ValueError, match="lies inside the LoRA layer 'latent_state_rollout.transition'"):
        Policy(make_adapter(), TrainableWeights(mode="module+lora", rank=4, alpha=4.0, targets=(B,),
                                                modules=(f"{B}.delta",)), OptimizerSettings.from_section(TrainConfig()),
               10)
