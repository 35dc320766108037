"""Conditioning row operations and the FlowModel protocol check."""
import pytest
import torch

from flowforge.models.base import Conditioning, FlowModel


def _cond(b=3, s=4, d=5, p=6, with_negative=True):
    g = torch.Generator().manual_seed(b)
    neg = Conditioning(torch.randn(b, s, d, generator=g), torch.randn(b, p, generator=g)) if with_negative else None
    return Conditioning(torch.randn(b, s, d, generator=g), torch.randn(b, p, generator=g),
                        torch.randint(0, 2, (b, s), generator=g), negative=neg)


def test_index_selects_rows_everywhere():
    c = _cond()
    sub = c.index(torch.tensor([2, 0]))
    assert torch.equal(sub.prompt_embeds, c.prompt_embeds[[2, 0]])
    assert torch.equal(sub.pooled, c.pooled[[2, 0]])
    assert torch.equal(sub.mask, c.mask[[2, 0]])
    assert torch.equal(sub.negative.pooled, c.negative.pooled[[2, 0]])
    assert torch.equal(c.index([1]).prompt_embeds, c.prompt_embeds[1:2])


def test_repeat_interleave_and_cat():
    c = _cond(b=2)
    r = c.repeat_interleave(3)
    assert r.batch_size == 6
    assert torch.equal(r.pooled, c.pooled.repeat_interleave(3, dim=0))
    assert torch.equal(r.negative.prompt_embeds, c.negative.prompt_embeds.repeat_interleave(3, dim=0))
    both = Conditioning.cat([c, c.index([1])])
    assert both.batch_size == 3
    assert torch.equal(both.prompt_embeds[2], c.prompt_embeds[1])
    assert torch.equal(both.negative.pooled[2], c.negative.pooled[1])
    with pytest.raises(ValueError, match="negative"):
        Conditioning.cat([c, _cond(b=2, with_negative=False)])


def test_to_casts_floats_but_not_mask():
    c = _cond().to("cpu", torch.bfloat16)
    assert c.prompt_embeds.dtype == torch.bfloat16 and c.pooled.dtype == torch.bfloat16
    assert c.negative.prompt_embeds.dtype == torch.bfloat16
    assert c.mask.dtype == torch.int64


def test_shape_validation():
    with pytest.raises(ValueError, match="prompt_embeds"):
        Conditioning(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="pooled"):
        Conditioning(torch.zeros(2, 3, 4), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="negative"):
        Conditioning(torch.zeros(2, 3, 4), negative=Conditioning(torch.zeros(1, 3, 4)))


def test_protocol_runtime_check():
    class Missing:
        transformer = torch.nn.Linear(1, 1)

    assert not isinstance(Missing(), FlowModel)


# ------------------------------------------------------------------------------------------------ the adapter contract
def test_protocol_declares_every_member_the_other_layers_use():
    from flowforge.models.base import HOOK_MEMBERS, REQUIRED_MEMBERS

    declared = set(vars(FlowModel)) | set(FlowModel.__annotations__)
    assert set(REQUIRED_MEMBERS) | set(HOOK_MEMBERS) <= declared
    assert {"encoder_id", "release_text_encoder", "pipeline_sigmas", "enable_gradient_checkpointing", "lora_targets",
            "condition_index", "generated_index"} == set(HOOK_MEMBERS)


class _Minimal(torch.nn.Module):
    """A transformer stand-in with diffusers' checkpointing switch."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.checkpointing = False

    def enable_gradient_checkpointing(self):
        self.checkpointing = True


class _SixMembers:
    """The six required members only (what a bring-your-own adapter had to have before the hooks were declared)."""

    def __init__(self):
        self.transformer = _Minimal()

    def blocks(self):
        return [self.transformer.lin]

    def encode(self, prompts):
        return Conditioning(torch.zeros(len(prompts), 1, 2))

    def latent_shape(self, height, width, frames=None):
        return (1, height, width)

    def velocity(self, x, sigma, cond, guidance_scale):
        return torch.zeros_like(x)

    def decode(self, latents):
        return latents


def test_adapter_mixin_defaults():
    from flowforge.models.base import AdapterMixin

    class WithMixin(AdapterMixin, _SixMembers):
        pass

    a = WithMixin()
    assert isinstance(a, FlowModel) and not isinstance(_SixMembers(), FlowModel)
    assert a.lora_targets == () and a.condition_index is None and a.generated_index == (slice(None),)
    assert a.encoder_id == "WithMixin"  # no text_encoder attribute: the class name, as the trainer used to fall back
    assert a.pipeline_sigmas(4, 32, 32) is None
    a.release_text_encoder()  # nothing to release: a no-op
    a.enable_gradient_checkpointing()
    assert a.transformer.checkpointing
    assert a.dtype == torch.float32 and a.device == torch.device("cpu")

    class Text:
        encoder_id = "enc"
        released = False

        def release(self):
            self.released = True

    a.text_encoder, a.negative_prompt = Text(), ""
    assert a.encoder_id == "enc|negative=''"
    a.release_text_encoder()
    assert a.text_encoder.released
    a.text_encoder = None
    assert a.encoder_id == "none"


def test_build_adapter_lists_missing_members(monkeypatch):
    import sys
    import types

    from flowforge.models import build_adapter

    module = types.ModuleType("ff_test_byo")
    module.SixMembers = lambda path, **kw: _SixMembers()
    monkeypatch.setitem(sys.modules, "ff_test_byo", module)
    missing = r"missing \['encoder_id', 'release_text_encoder', 'lora_targets'.*AdapterMixin"
    with pytest.raises(TypeError, match=missing):
        build_adapter("ff_test_byo:SixMembers", "x")


def test_condition_slot_needs_generated_index():
    from flowforge.models.base import AdapterMixin, check_condition_slot

    class Slot(AdapterMixin, _SixMembers):
        condition_index = (slice(None), slice(0, 1))
        generated_index = None

    with pytest.raises(TypeError, match="declares condition_index but no generated_index"):
        check_condition_slot(Slot())
    Slot.generated_index = (slice(None), slice(1, None))
    check_condition_slot(Slot())


def test_an_adapter_path_that_names_a_function_is_refused():
    """Issue 24: ``model.adapter=os:getcwd`` is refused when resolved, not called with the adapter's arguments."""
    from flowforge.models import adapter_class

    with pytest.raises(ValueError, match="'getcwd' is a builtin_function_or_method, not an adapter class or factory"):
        adapter_class("os:getcwd")
