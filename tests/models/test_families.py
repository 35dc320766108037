"""FLUX / Qwen-Image / Wan adapters (and SD3 where the same check applies) on tiny random-init models.

Every model is built from a config (tests/models/tiny_families.py); nothing is downloaded. The pipeline tests run the
real diffusers pipeline (``FluxPipeline``, ``QwenImagePipeline``, ``WanPipeline``, ``WanImageToVideoPipeline``) built
from the same components and compare its latents / images with the adapter's Euler steps and decode.
"""
from __future__ import annotations

import copy

import pytest
import torch

from flowforge.models import ADAPTERS
from flowforge.models.base import FlowModel
from flowforge.models.common import pack_2x2, unpack_2x2
from flowforge.models.lora import adapters_disabled, inject_lora
from tests.models import tiny_families as tiny
from tests.models.families import (FAMILIES, PIPELINE_FAMILIES, PROMPTS, SEQ_LEN, Family, cond_of, family, inputs_of,
                                   strip_negative, with_transformer)


@pytest.fixture(params=FAMILIES)
def fam(request) -> Family:
    return family(request.param)


@pytest.fixture(params=PIPELINE_FAMILIES)
def pfam(request) -> Family:
    return family(request.param)


# ---------------------------------------------------------------------------------------------------- protocol


def test_registered_and_protocol(fam):
    assert fam.name in ADAPTERS
    assert isinstance(fam.adapter, FlowModel)
    assert not fam.adapter.transformer.training
    blocks = fam.adapter.blocks()
    assert blocks and all(isinstance(b, torch.nn.Module) for b in blocks)
    if fam.name == "flux":  # both double- and single-stream blocks
        t = fam.adapter.transformer
        assert len(blocks) == len(t.transformer_blocks) + len(t.single_transformer_blocks) == 2
        assert type(blocks[0]).__name__ == "FluxTransformerBlock"
        assert type(blocks[1]).__name__ == "FluxSingleTransformerBlock"
    if fam.name != "sd3":
        assert fam.adapter.tasks == {"wan": ("t2v",)}.get(fam.name, ("t2i", "i2i"))  # FLUX: Kontext, Qwen: Edit
        assert fam.name in fam.adapter.encoder_id or "Pipeline" in fam.adapter.encoder_id


def test_latent_shape(fam):
    h, w, frames = fam.size
    assert fam.adapter.latent_shape(h, w, frames) == fam.latent
    with pytest.raises(ValueError):
        fam.adapter.latent_shape(h + 1, w, frames)
    if frames is None:
        with pytest.raises(ValueError):
            fam.adapter.latent_shape(h, w, 5)
    else:
        with pytest.raises(ValueError):
            fam.adapter.latent_shape(h, w, frames + 1)
        with pytest.raises(ValueError):
            fam.adapter.latent_shape(h, w, None)


def test_encode_fields(pfam):
    cond = cond_of(pfam)
    assert cond.batch_size == len(PROMPTS) and cond.prompt_embeds.shape[1] == SEQ_LEN[pfam.name]
    assert (cond.prompt_embeds[0] - cond.prompt_embeds[1]).abs().max() > 0
    if pfam.name == "flux":
        assert cond.pooled is not None and cond.pooled.shape == (2, 16)
        assert cond.negative is None  # guidance-distilled: no unconditional branch is ever evaluated
    else:
        assert cond.negative is not None and cond.mask is not None
        # Real tokens first, then padding (zeros in the embeddings).
        lengths = cond.mask.sum(1)
        assert lengths[0] > lengths[1] > 0
        for row, n in enumerate(lengths.tolist()):
            assert cond.mask[row, :n].all() and not cond.mask[row, n:].any()
            assert cond.prompt_embeds[row, n:].abs().max() == 0
    if pfam.name == "qwen_image":
        # the template's first 34 tokens are dropped: "a red cat sitting under a tree" + 5 closing template tokens
        assert cond.mask.sum(1).tolist() == [7 + 5, 2 + 5]


def test_velocity_shape_and_fp32(fam):
    x, s = inputs_of(fam)
    cond = cond_of(fam)
    v = fam.adapter.velocity(x, s, cond, 1.0)
    assert v.shape == x.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
    bf16 = with_transformer(fam, copy.deepcopy(fam.adapter.transformer).to(torch.bfloat16))
    v16 = bf16.velocity(x, s, cond, 1.0)
    assert v16.shape == x.shape and v16.dtype == torch.float32
    with pytest.raises(ValueError):
        fam.adapter.velocity(x, s[:1], cond, 1.0)


def test_velocity_depends_on_prompt_and_sigma(fam):
    x, s = inputs_of(fam)
    cond = cond_of(fam)
    with torch.no_grad():
        v = fam.adapter.velocity(x, s, cond, 1.0)
        swapped = fam.adapter.velocity(x, s, cond.index([1, 0]), 1.0)
        other_sigma = fam.adapter.velocity(x, s * 0.5, cond, 1.0)
    assert (v - swapped).abs().max() > 1e-5
    assert (v - other_sigma).abs().max() > 1e-5


def test_native_timestep_unit(fam):
    seen = {}

    def hook(module, args, kwargs):
        seen["timestep"] = kwargs["timestep"].detach().clone()

    handle = fam.adapter.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        x, s = inputs_of(fam)
        with torch.no_grad():
            fam.adapter.velocity(x, s, cond_of(fam), 1.0)
    finally:
        handle.remove()
    assert seen["timestep"].dtype == torch.float32
    torch.testing.assert_close(seen["timestep"], fam.timestep_scale * s, rtol=0, atol=1e-4)


# ---------------------------------------------------------------------------------------------------- guidance


def test_guidance_one_is_conditional_only(fam):
    x, s = inputs_of(fam)
    cond = cond_of(fam)
    with torch.no_grad():
        v1 = fam.adapter.velocity(x, s, cond, 1.0)
        v_c = fam.adapter.velocity(x, s, strip_negative(cond), 1.0)
    assert torch.equal(v1, v_c)
    if cond.negative is not None:
        with torch.no_grad():
            v_u = fam.adapter.velocity(x, s, cond.negative, 1.0)
            v_g = fam.adapter.velocity(x, s, cond, 4.0)
        assert (v_u - v_c).abs().max() > 1e-5
        if fam.name == "qwen_image":  # the pipeline's per-token renormalisation of the CFG output
            pc, pu = pack_2x2(v_c), pack_2x2(v_u)
            comb = pu + 4.0 * (pc - pu)
            expected = unpack_2x2(comb * (pc.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True)), 8, 8)
        else:
            expected = v_u + 4.0 * (v_c - v_u)
        torch.testing.assert_close(v_g, expected, rtol=1e-4, atol=1e-5)
        with pytest.raises(ValueError):
            fam.adapter.velocity(x, s, strip_negative(cond), 4.0)


def test_flux_guidance_reaches_embedding_single_forward():
    f = family("flux")
    x, s = inputs_of(f)
    cond = cond_of(f)
    calls = []

    def spy(module, args, kwargs):
        calls.append(args)

    handle = f.adapter.transformer.time_text_embed.register_forward_pre_hook(spy, with_kwargs=True)
    try:
        with torch.no_grad():
            v35 = f.adapter.velocity(x, s, cond, 3.5)
            v1 = f.adapter.velocity(x, s, cond, 1.0)
    finally:
        handle.remove()
    assert len(calls) == 2  # one forward per velocity: distilled guidance, not CFG
    timestep, guidance, _ = calls[0]
    assert timestep.shape == guidance.shape == (2,)
    torch.testing.assert_close(guidance, torch.full((2,), 3500.0))  # the transformer scales by 1000
    torch.testing.assert_close(calls[1][1], torch.full((2,), 1000.0))
    assert (v35 - v1).abs().max() > 1e-5


def test_flux_without_guidance_embeds_uses_true_cfg():
    from flowforge.models.flux.adapter import FluxAdapter

    c = tiny.flux_components(guidance_embeds=False)
    fake = FakeFluxText()
    a = FluxAdapter(c["transformer"], fake)
    assert a.negative_prompt == ""
    x = torch.randn(2, 4, 16, 16)
    s = torch.tensor([0.2, 0.9])
    cond = a.encode(["a", "b"])
    with torch.no_grad():
        v_c = a.velocity(x, s, cond, 1.0)
        v_u = a.velocity(x, s, cond.negative, 1.0)
        v = a.velocity(x, s, cond, 3.0)
    torch.testing.assert_close(v, v_u + 3.0 * (v_c - v_u), rtol=1e-4, atol=1e-5)


class FakeFluxText:
    encoder_id = "fake-flux"

    def encode(self, prompts):
        g = [torch.Generator().manual_seed(len(p) + 1) for p in prompts]
        return (torch.stack([torch.randn(8, 32, generator=r) for r in g]), None,
                torch.stack([torch.randn(16, generator=r) for r in g]))


# ---------------------------------------------------------------------------------------------------- LoRA


def test_lora_only_adapter_weights_train_and_disabled_is_base(fam):
    transformer = copy.deepcopy(fam.adapter.transformer)
    adapter = with_transformer(fam, transformer)
    x, s = inputs_of(fam)
    cond = cond_of(fam)
    with torch.no_grad():
        base = adapter.velocity(x, s, cond, 1.0)
    params = inject_lora(transformer, 4, 8, adapter.lora_targets)
    trainable = {n for n, p in transformer.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == len(params)
    wrapped = {n.rsplit(".lora_", 1)[0] for n in trainable}
    for target in adapter.lora_targets:  # every default target names a real module of this family
        assert any(n.endswith(target) for n in wrapped), target
    with torch.no_grad():
        assert torch.equal(adapter.velocity(x, s, cond, 1.0), base)  # B = 0 at init
        for n, p in transformer.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.5)
        moved = adapter.velocity(x, s, cond, 1.0)
        with adapters_disabled(transformer):
            off = adapter.velocity(x, s, cond, 1.0)
    assert (moved - base).abs().max() > 1e-5
    assert torch.equal(off, base)


# ---------------------------------------------------------------------------------------------------- schedules


def test_schedule_mu_from_scheduler_config():
    from flowforge.algorithms.schedules import calculate_shift

    f = family("flux")
    q = family("qwen_image")
    assert f.adapter.schedule_mu(32, 32) == pytest.approx(calculate_shift(64, 256, 4096, 0.5, 1.15))
    # Qwen-Image's scheduler config (tiny copy) has max_image_seq_len 8192, max_shift 0.9: mu must use them.
    assert q.adapter.schedule_mu(16, 16) == pytest.approx(calculate_shift(16, 256, 8192, 0.5, 0.9))
    assert q.adapter.schedule_mu(16, 16) != pytest.approx(calculate_shift(16))


def test_wan_default_shift():
    from flowforge.models.wan.adapter import WanAdapter

    w = family("wan")
    assert w.adapter.default_shift == 3.0  # the tiny pipeline's scheduler config
    assert WanAdapter(w.adapter.transformer).default_shift == 5.0
    assert WanAdapter(w.adapter.transformer, scheduler_config={"flow_shift": 3.0}).default_shift == 3.0


