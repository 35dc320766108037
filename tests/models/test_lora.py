"""peft LoRA helpers on a tiny SD3 transformer."""
import pytest
import torch

from flowforge.demo.model import build_tiny_sd3, test_sd3_config
from flowforge.models import lora
from flowforge.models.base import Conditioning
from flowforge.models.sd3.adapter import SD3_LORA_TARGETS, SD3Adapter


def _setup():
    model = build_tiny_sd3(test_sd3_config(), seed=0)
    adapter = SD3Adapter(model)
    g = torch.Generator().manual_seed(1)
    x, s = torch.randn(2, 1, 32, 32, generator=g), torch.rand(2, generator=g)
    cond = Conditioning(torch.randn(2, 16, 384, generator=g), torch.randn(2, 384, generator=g))
    return model, adapter, (x, s, cond)


def _v(adapter, inputs):
    x, s, cond = inputs
    with torch.no_grad():
        return adapter.velocity(x, s, cond, 1.0)


def _perturb(params, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(0.1 * torch.randn(p.shape, generator=g))


def test_injection_only_lora_trains_fp32_and_output_unchanged():
    model, adapter, inputs = _setup()
    base = _v(adapter, inputs)
    params = lora.inject_lora(model, rank=4, alpha=8, targets=SD3_LORA_TARGETS)
    trainable = dict((n, p) for n, p in model.named_parameters() if p.requires_grad)
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    assert len(params) == len(trainable) == 2 * (8 + 7)  # block 1 is context-pre-only: no to_add_out
    assert all(p.dtype == torch.float32 for p in params)
    assert torch.equal(_v(adapter, inputs), base)
    assert all(m.lora_dropout["default"].__class__.__name__ == "Identity"
               for m in model.modules() if hasattr(m, "lora_dropout"))


def test_bf16_base_gets_fp32_lora():
    model = build_tiny_sd3(test_sd3_config(), seed=0).to(torch.bfloat16)
    params = lora.inject_lora(model, 2, 2, ["attn.to_q"])
    assert params and all(p.dtype == torch.float32 for p in params)


def test_adapters_disabled_reproduces_base_exactly():
    model, adapter, inputs = _setup()
    base = _v(adapter, inputs)
    params = lora.inject_lora(model, 4, 4, SD3_LORA_TARGETS)
    _perturb(params, 0)
    trained = _v(adapter, inputs)
    assert (trained - base).abs().max() > 1e-3
    flags = [p.requires_grad for p in model.parameters()]
    with lora.adapters_disabled(model):
        assert torch.equal(_v(adapter, inputs), base)
        assert [p.requires_grad for p in model.parameters()] == flags
    assert torch.equal(_v(adapter, inputs), trained)
    assert [p.requires_grad for p in model.parameters()] == flags


def test_named_adapters_switch_copy_and_state_dict():
    model, adapter, inputs = _setup()
    base = _v(adapter, inputs)
    live = lora.inject_lora(model, 4, 4, SD3_LORA_TARGETS)
    lora.add_adapter(model, "old", 4, 4, SD3_LORA_TARGETS, trainable=False)
    assert lora.adapter_names(model) == ["default", "old"] and lora.active_adapter(model) == "default"
    _perturb(live, 0)
    v_live = _v(adapter, inputs)
    flags = [p.requires_grad for p in model.parameters()]
    lora.set_active_adapter(model, "old")
    assert torch.equal(_v(adapter, inputs), base)  # "old" is still at init
    assert [p.requires_grad for p in model.parameters()] == flags  # switching never changes what trains
    lora.set_active_adapter(model, "default")
    lora.copy_adapter(model, "default", "old")
    with lora.using_adapter(model, "old"):
        assert torch.equal(_v(adapter, inputs), v_live)
    assert lora.active_adapter(model) == "default"
    state = lora.lora_state_dict(model, "default")
    assert all("default" not in k for k in state)
    _perturb(live, 1)
    assert not torch.equal(_v(adapter, inputs), v_live)
    lora.load_lora_state_dict(model, state, "default")
    assert torch.equal(_v(adapter, inputs), v_live)
    with pytest.raises(ValueError, match="unknown"):
        lora.set_active_adapter(model, "nope")
    with pytest.raises(ValueError, match="mismatch"):
        lora.load_lora_state_dict(model, {"x": torch.zeros(1)}, "default")
    with pytest.raises(ValueError, match="already exists"):
        lora.add_adapter(model, "old", 4, 4, SD3_LORA_TARGETS)


def test_gradients_reach_only_lora():
    model, adapter, (x, s, cond) = _setup()
    lora.inject_lora(model, 4, 4, SD3_LORA_TARGETS)
    adapter.velocity(x, s, cond, 1.0).square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is None for n, g in grads.items() if "lora_" not in n)
    assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)
