"""FLUX / Qwen-Image / Wan adapters (and SD3 where the same check applies) on tiny random-init models.

Every model is built from a config (tests/models/tiny_families.py); nothing is downloaded. The pipeline tests run the
real diffusers pipeline (``FluxPipeline``, ``QwenImagePipeline``, ``WanPipeline``, ``WanImageToVideoPipeline``) built
from the same components and compare its latents / images with the adapter's Euler steps and decode.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch

from flowforge.models import ADAPTERS, build_adapter
from flowforge.models.base import Conditioning, FlowModel
from flowforge.models.common import pack_2x2, unpack_2x2
from flowforge.models.lora import adapters_disabled, inject_lora
from tests.models import tiny_families as tiny

FAMILIES = ["sd3", "flux", "qwen_image", "wan"]
PIPELINE_FAMILIES = ["flux", "qwen_image", "wan"]
PROMPTS = ["a red cat sitting under a tree", "two dogs"]
SEQ_LEN = {"flux": 16, "qwen_image": 64, "wan": 16}
MIN_TOK = 10


@dataclasses.dataclass
class Family:
    name: str
    adapter: Any
    components: dict | None
    size: tuple[int, int, int | None]  # height, width, frames
    latent: tuple[int, ...]
    timestep_scale: float  # native timestep = scale * sigma
    pipeline_kwargs: dict


class FakeSD3Text:
    encoder_id = "fake"

    def encode(self, prompts):
        rows = [torch.Generator().manual_seed(sum(map(ord, p)) + 7 * len(p)) for p in prompts]
        embeds = torch.stack([torch.randn(16, 384, generator=g) for g in rows])
        pooled = torch.stack([torch.randn(384, generator=g) for g in rows])
        return embeds, torch.ones(len(prompts), 16, dtype=torch.long), pooled


def _build(name: str) -> Family:
    if name == "sd3":
        from flowforge.demo.model import build_tiny_sd3, test_sd3_config
        from flowforge.models.sd3 import SD3Adapter

        return Family(name, SD3Adapter(build_tiny_sd3(test_sd3_config(), seed=0), FakeSD3Text()), None,
                      (32, 32, None), (1, 32, 32), 1000.0, {})
    if name == "flux":
        from flowforge.models.flux import FluxAdapter, flux_text

        c = tiny.flux_components()
        text = flux_text(components={k: c[k] for k in ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2")},
                         max_sequence_length=SEQ_LEN[name], min_tokenizer_size=MIN_TOK)
        adapter = FluxAdapter(c["transformer"], text, c["vae"], scheduler_config=dict(c["scheduler"].config))
        return Family(name, adapter, c, (32, 32, None), (4, 16, 16), 1.0, dict(guidance_scale=3.5))
    if name == "qwen_image":
        from flowforge.models.qwen_image import QwenImageAdapter, qwen_image_text

        c = tiny.qwen_components()
        text = qwen_image_text(components={k: c[k] for k in ("tokenizer", "text_encoder")},
                               max_sequence_length=SEQ_LEN[name], min_tokenizer_size=MIN_TOK)
        adapter = QwenImageAdapter(c["transformer"], text, c["vae"], scheduler_config=dict(c["scheduler"].config))
        return Family(name, adapter, c, (16, 16, None), (4, 8, 8), 1.0,
                      dict(true_cfg_scale=4.0, negative_prompt=" "))
    if name == "wan":
        from flowforge.models.wan import WanAdapter, wan_text

        c = tiny.wan_components()
        text = wan_text(components={k: c[k] for k in ("tokenizer", "text_encoder")},
                        max_sequence_length=SEQ_LEN[name], min_tokenizer_size=MIN_TOK)
        adapter = WanAdapter(c["transformer"], text, c["vae"], scheduler_config=dict(c["scheduler"].config))
        return Family(name, adapter, c, (16, 16, 9), (4, 3, 2, 2), 1000.0,
                      dict(guidance_scale=4.0, negative_prompt="", num_frames=9))
    raise AssertionError(name)


_CACHE: dict[str, Family] = {}


@pytest.fixture(params=FAMILIES)
def fam(request) -> Family:
    if request.param not in _CACHE:
        _CACHE[request.param] = _build(request.param)
    return _CACHE[request.param]


@pytest.fixture(params=PIPELINE_FAMILIES)
def pfam(request) -> Family:
    if request.param not in _CACHE:
        _CACHE[request.param] = _build(request.param)
    return _CACHE[request.param]


_COND: dict[str, Conditioning] = {}


def _cond(f: Family) -> Conditioning:
    if f.name not in _COND:
        _COND[f.name] = f.adapter.encode(PROMPTS)
    return _COND[f.name]


def _inputs(f: Family, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(PROMPTS), *f.latent, generator=g), torch.tensor([0.37, 0.81])


def _strip_negative(cond: Conditioning) -> Conditioning:
    return Conditioning(cond.prompt_embeds, cond.pooled, cond.mask)


def _with_transformer(f: Family, transformer) -> Any:
    other = copy.copy(f.adapter)
    other.transformer = transformer
    return other


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
    cond = _cond(pfam)
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
    x, s = _inputs(fam)
    cond = _cond(fam)
    v = fam.adapter.velocity(x, s, cond, 1.0)
    assert v.shape == x.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
    bf16 = _with_transformer(fam, copy.deepcopy(fam.adapter.transformer).to(torch.bfloat16))
    v16 = bf16.velocity(x, s, cond, 1.0)
    assert v16.shape == x.shape and v16.dtype == torch.float32
    with pytest.raises(ValueError):
        fam.adapter.velocity(x, s[:1], cond, 1.0)


def test_velocity_depends_on_prompt_and_sigma(fam):
    x, s = _inputs(fam)
    cond = _cond(fam)
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
        x, s = _inputs(fam)
        with torch.no_grad():
            fam.adapter.velocity(x, s, _cond(fam), 1.0)
    finally:
        handle.remove()
    assert seen["timestep"].dtype == torch.float32
    torch.testing.assert_close(seen["timestep"], fam.timestep_scale * s, rtol=0, atol=1e-4)


# ---------------------------------------------------------------------------------------------------- guidance


def test_guidance_one_is_conditional_only(fam):
    x, s = _inputs(fam)
    cond = _cond(fam)
    with torch.no_grad():
        v1 = fam.adapter.velocity(x, s, cond, 1.0)
        v_c = fam.adapter.velocity(x, s, _strip_negative(cond), 1.0)
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
            fam.adapter.velocity(x, s, _strip_negative(cond), 4.0)


def test_flux_guidance_reaches_embedding_single_forward():
    f = _CACHE.setdefault("flux", _build("flux"))
    x, s = _inputs(f)
    cond = _cond(f)
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
    from flowforge.models.flux import FluxAdapter

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
    adapter = _with_transformer(fam, transformer)
    x, s = _inputs(fam)
    cond = _cond(fam)
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

    f = _CACHE.setdefault("flux", _build("flux"))
    q = _CACHE.setdefault("qwen_image", _build("qwen_image"))
    assert f.adapter.schedule_mu(32, 32) == pytest.approx(calculate_shift(64, 256, 4096, 0.5, 1.15))
    # Qwen-Image's scheduler config (tiny copy) has max_image_seq_len 8192, max_shift 0.9: mu must use them.
    assert q.adapter.schedule_mu(16, 16) == pytest.approx(calculate_shift(16, 256, 8192, 0.5, 0.9))
    assert q.adapter.schedule_mu(16, 16) != pytest.approx(calculate_shift(16))


def test_wan_default_shift():
    from flowforge.models.wan import WanAdapter

    w = _CACHE.setdefault("wan", _build("wan"))
    assert w.adapter.default_shift == 3.0  # the tiny pipeline's scheduler config
    assert WanAdapter(w.adapter.transformer).default_shift == 5.0
    assert WanAdapter(w.adapter.transformer, scheduler_config={"flow_shift": 3.0}).default_shift == 3.0


# ---------------------------------------------------------------------------------------------------- pipelines

_PIPES: dict[str, Any] = {}


def _pipeline(f: Family):
    import diffusers

    if f.name not in _PIPES:
        cls = {"flux": "FluxPipeline", "qwen_image": "QwenImagePipeline", "wan": "WanPipeline"}[f.name]
        _PIPES[f.name] = getattr(diffusers, cls)(**f.components)
    return _PIPES[f.name]


def _run_pipeline(f: Family, x: torch.Tensor, steps: int, **overrides):
    """Run the diffusers pipeline from latents ``x`` (``overrides`` replace ``f.pipeline_kwargs`` entries); returns
    (final latents unpacked, media in [0, 1], sigmas)."""
    pipe = _pipeline(f)
    h, w, _ = f.size
    captured = {}

    def grab(p, i, t, kw):
        captured["latents"] = kw["latents"].detach().clone()
        return {}

    packed = f.name in ("flux", "qwen_image")
    with torch.no_grad():
        out = pipe(prompt=PROMPTS, height=h, width=w, num_inference_steps=steps,
                   latents=pack_2x2(x) if packed else x.clone(), output_type="pt",
                   max_sequence_length=SEQ_LEN[f.name], callback_on_step_end=grab,
                   callback_on_step_end_tensor_inputs=["latents"], **{**f.pipeline_kwargs, **overrides})
    media = out.images if hasattr(out, "images") else out.frames
    final = captured["latents"].float()
    if packed:
        final = unpack_2x2(final, *f.latent[-2:])
    if f.name == "wan":
        media = media.permute(0, 2, 1, 3, 4)  # postprocess_video gives [B, F, C, H, W]
    return final, media, pipe.scheduler.sigmas.clone()


def _guidance(f: Family) -> float:
    return f.pipeline_kwargs.get("guidance_scale", f.pipeline_kwargs.get("true_cfg_scale", 1.0))


@pytest.mark.parametrize("scale", ["0.5", "1", "family"])
def test_adapter_reproduces_the_diffusers_pipeline(pfam, scale):
    """Two Euler steps of the adapter over the pipeline's own sigmas give the pipeline's latents, and decode gives
    its images: packing, timestep unit, text encoding, guidance and VAE scaling all agree -- at guidance 0.5 (Wan's
    ``guidance_scale`` and Qwen-Image's ``true_cfg_scale`` <= 1: the pipeline runs no CFG; FLUX.1-dev embeds it),
    1 and the family's CFG value > 1. The latents are bitwise equal (``transition("ode")`` is the scheduler's step;
    Wan's CFG runs two forwards, as the pipeline), the max abs differences printed."""
    from flowforge.algorithms.sde import transition

    x, _ = _inputs(pfam, seed=3)
    g = {"0.5": 0.5, "1": 1.0, "family": _guidance(pfam)}[scale]
    key = "true_cfg_scale" if "true_cfg_scale" in pfam.pipeline_kwargs else "guidance_scale"
    final, media, sigmas = _run_pipeline(pfam, x, steps=2, **{key: g})
    cond = _cond(pfam)
    y = x.clone()
    with torch.no_grad():
        for i in range(2):
            v = pfam.adapter.velocity(y, sigmas[i].expand(2), cond, g)
            y = transition("ode", y, v, sigmas[i], sigmas[i + 1], 0.0).x_next
    images = pfam.adapter.decode(y)
    print(f"{pfam.name} guidance {g}: latents max abs diff {(y - final).abs().max().item():.3g}, "
          f"media {(images - media.float()).abs().max().item():.3g}")
    assert torch.equal(y, final)
    assert (y - x).abs().max() > 1e-3
    assert images.dtype == torch.float32 and images.min() >= 0 and images.max() <= 1
    assert torch.equal(images, media.float())
    if g < 1:  # the pipeline's rule: no CFG below 1 (FLUX.1-dev: the embedded value, which does change the output)
        with torch.no_grad():
            v05, v1 = (pfam.adapter.velocity(x, sigmas[0].expand(2), cond, s) for s in (0.5, 1.0))
        assert (v05 - v1).abs().max() > 0 if pfam.adapter.guidance_use(0.5) == "embedded" else torch.equal(v05, v1)
    if pfam.name != "wan":
        torch.testing.assert_close(pfam.adapter.pipeline_sigmas(2, *pfam.size[:2]), sigmas)


def test_save_pretrained_loads_through_registry(pfam, tmp_path):
    _pipeline(pfam).save_pretrained(str(tmp_path))
    loaded = build_adapter(pfam.name, str(tmp_path), max_sequence_length=SEQ_LEN[pfam.name],
                           min_tokenizer_size=MIN_TOK)
    assert type(loaded) is type(pfam.adapter)
    assert str(tmp_path.resolve()) in loaded.encoder_id
    x, s = _inputs(pfam, seed=5)
    cond = loaded.encode(PROMPTS)
    torch.testing.assert_close(cond.prompt_embeds, _cond(pfam).prompt_embeds)
    with torch.no_grad():
        for g in (1.0, _guidance(pfam)):
            torch.testing.assert_close(loaded.velocity(x, s, cond, g), pfam.adapter.velocity(x, s, _cond(pfam), g),
                                       rtol=0, atol=1e-6)
    public = {k: v for k, v in dict(pfam.components["scheduler"].config).items() if not k.startswith("_")}
    assert {k: v for k, v in loaded.scheduler_config.items() if not k.startswith("_")} == public
    loaded.release_text_encoder()
    assert loaded.text_encoder._pipe is None
    torch.testing.assert_close(loaded.encode(PROMPTS[:1]).prompt_embeds, cond.prompt_embeds[:1])  # lazy reload


def test_loader_rejects_non_pipeline_dir(pfam, tmp_path):
    with pytest.raises(FileNotFoundError):
        build_adapter(pfam.name, str(tmp_path))


def test_in_memory_text_encoder_cannot_reload_after_release():
    from flowforge.models.wan import wan_text

    c = tiny.wan_components()
    text = wan_text(components={"tokenizer": c["tokenizer"], "text_encoder": c["text_encoder"]},
                    max_sequence_length=8, min_tokenizer_size=MIN_TOK)
    assert text.encode(["a cat"])[0].shape == (1, 8, 32)
    text.release()
    with pytest.raises(RuntimeError):
        text.encode(["a cat"])
    strict = wan_text(components={"tokenizer": c["tokenizer"], "text_encoder": c["text_encoder"]})
    with pytest.raises(RuntimeError, match="placeholder tokenizer"):
        strict.encode(["a cat"])


# ---------------------------------------------------------------------------------------------------- Wan i2v


def _i2v_pipeline_run(adapter, components, *, expand_timesteps: bool, image: torch.Tensor, noise: torch.Tensor,
                      cond: Conditioning):
    from diffusers import WanImageToVideoPipeline

    pipe = WanImageToVideoPipeline(**components, expand_timesteps=expand_timesteps)
    captured = {}

    def grab(p, i, t, kw):
        captured["latents"] = kw["latents"].detach().clone()
        return {}

    with torch.no_grad():
        # Embeddings given: WanImageToVideoPipeline's prompt_clean needs ftfy (diffusers 0.42); the text path is
        # checked against WanPipeline in test_adapter_reproduces_the_diffusers_pipeline.
        out = pipe(image=image, prompt_embeds=cond.prompt_embeds, negative_prompt_embeds=cond.negative.prompt_embeds,
                   guidance_scale=4.0, height=16, width=16,
                   num_frames=9, num_inference_steps=2, latents=noise[:, : adapter.z_dim].clone(), output_type="pt",
                   max_sequence_length=SEQ_LEN["wan"], callback_on_step_end=grab,
                   callback_on_step_end_tensor_inputs=["latents"])
    return pipe, captured["latents"], out.frames.permute(0, 2, 1, 3, 4), pipe.scheduler.sigmas.clone()


@pytest.mark.parametrize("layout", ["pin", "concat"])
def test_wan_i2v_matches_image_to_video_pipeline(layout):
    from flowforge.models.wan import WanAdapter, wan_text
    from flowforge.rollout import generate, with_condition

    c = tiny.wan_components(i2v=layout == "concat")
    text = wan_text(components={k: c[k] for k in ("tokenizer", "text_encoder")}, max_sequence_length=SEQ_LEN["wan"],
                    min_tokenizer_size=MIN_TOK)
    a = WanAdapter(c["transformer"], text, c["vae"], task="i2v", expand_timesteps=layout == "pin")
    assert "i2v" in a.tasks
    shape = a.latent_shape(16, 16, 9)
    assert shape == ((12 if layout == "concat" else 4), 3, 2, 2)
    g = torch.Generator().manual_seed(11)
    noise = torch.randn(2, *shape, generator=g)
    image = torch.rand(1, 3, 16, 16, generator=g)
    cond = a.encode(PROMPTS)
    cond = dataclasses.replace(cond, image=a.encode_condition_images(image.expand(2, -1, -1, -1), shape))
    x = with_condition(a, noise, cond)
    slot, gen = a.condition_index, a.generated_index
    assert torch.equal(x[gen], noise[gen]) and not torch.equal(x[slot], noise[slot])
    assert x[slot].numel() + x[gen].numel() == x.numel()  # slot and generated elements partition the latent

    # the velocity is 0 on the condition slot
    with torch.no_grad():
        v = a.velocity(x, torch.tensor([0.9, 0.4]), cond, 4.0)
    assert v[slot].abs().max() == 0 and v[gen].abs().max() > 0

    pipe, final, media, sigmas = _i2v_pipeline_run(a, c, expand_timesteps=layout == "pin", image=image,
                                                   noise=noise, cond=cond)
    y = generate(a, cond, noise, sigmas.float(), 4.0)  # flowforge's own loop pins the slot from cond.image
    if layout == "pin":  # the pipeline re-pins frame 0 only at the end; compare the generated frames
        torch.testing.assert_close(y[:, :, 1:], final[:, :, 1:], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(y[:, :, :1], x[:, :, :1])
    else:
        torch.testing.assert_close(y[:, : a.z_dim], final, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(y[:, a.z_dim:], x[:, a.z_dim:])
    torch.testing.assert_close(a.decode(y), media.float(), rtol=1e-3, atol=2e-4)
    if layout == "concat":  # an I2V directory loads as an i2v adapter with the same velocity
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            pipe.save_pretrained(d)
            loaded = build_adapter("wan", d, max_sequence_length=SEQ_LEN["wan"], min_tokenizer_size=MIN_TOK)
            assert loaded.task == "i2v" and loaded.tasks == ("i2v",)
            with torch.no_grad():
                torch.testing.assert_close(loaded.velocity(x, torch.tensor([0.9, 0.4]), loaded.encode(PROMPTS), 4.0),
                                           v, rtol=0, atol=1e-6)


def test_wan_i2v_pin_layout_timesteps_per_token():
    from flowforge.models.wan import WanAdapter

    c = tiny.wan_components()
    a = WanAdapter(c["transformer"], None, c["vae"], task="i2v", expand_timesteps=True)
    seen = {}

    def hook(module, args, kwargs):
        seen["timestep"] = kwargs["timestep"].clone()

    handle = a.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        x = torch.randn(2, 4, 3, 2, 2)
        cond = Conditioning(torch.randn(2, 5, 32))
        with torch.no_grad():
            a.velocity(x, torch.tensor([0.25, 0.75]), cond, 1.0)
    finally:
        handle.remove()
    ts = seen["timestep"]
    assert ts.shape == (2, 3)  # one token per latent frame at 2x2 latents with (1, 2, 2) patches
    torch.testing.assert_close(ts, torch.tensor([[0.0, 250.0, 250.0], [0.0, 750.0, 750.0]]))
    with pytest.raises(ValueError, match="needs >= 5 frames"):
        a.latent_shape(16, 16, 1)  # the condition frame alone: nothing to generate
    with pytest.raises(ValueError):
        WanAdapter(c["transformer"], task="i2v")  # a T2V transformer without expand_timesteps has no i2v layout


def test_wan_cfg_runs_two_forwards_as_the_pipeline():
    """``WanPipeline`` runs the conditional and the unconditional forward separately (batch B each); the adapter
    does the same (not one forward over a doubled batch, whose kernels may round differently on a GPU); at guidance
    <= 1 it runs the conditional forward alone."""
    w = _CACHE.setdefault("wan", _build("wan"))
    rows: list[int] = []
    hook = w.adapter.transformer.register_forward_pre_hook(
        lambda m, args, kw: rows.append(kw["hidden_states"].shape[0]), with_kwargs=True)
    x, s = _inputs(w)
    try:
        with torch.no_grad():
            for g in (4.0, 0.5):
                w.adapter.velocity(x, s, _cond(w), g)
    finally:
        hook.remove()
    assert rows == [2, 2, 2]
