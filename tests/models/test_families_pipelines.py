"""FLUX / Qwen-Image / Wan adapters against the real diffusers pipelines (``FluxPipeline``, ``QwenImagePipeline``,
``WanPipeline``, ``WanImageToVideoPipeline``) built from the same tiny components: latents / images of the adapter's
Euler steps and decode compared with the pipeline's; saving and reloading through the registry; Wan image-to-video.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from flowforge.models import build_adapter
from flowforge.models.base import Conditioning
from flowforge.models.common import pack_2x2, unpack_2x2
from tests.models import tiny_families as tiny
from tests.models.families import MIN_TOK, PIPELINE_FAMILIES, PROMPTS, SEQ_LEN, Family, cond_of, family, inputs_of


@pytest.fixture(params=PIPELINE_FAMILIES)
def pfam(request) -> Family:
    return family(request.param)


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

    x, _ = inputs_of(pfam, seed=3)
    g = {"0.5": 0.5, "1": 1.0, "family": _guidance(pfam)}[scale]
    key = "true_cfg_scale" if "true_cfg_scale" in pfam.pipeline_kwargs else "guidance_scale"
    final, media, sigmas = _run_pipeline(pfam, x, steps=2, **{key: g})
    cond = cond_of(pfam)
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
    x, s = inputs_of(pfam, seed=5)
    cond = loaded.encode(PROMPTS)
    torch.testing.assert_close(cond.prompt_embeds, cond_of(pfam).prompt_embeds)
    with torch.no_grad():
        for g in (1.0, _guidance(pfam)):
            torch.testing.assert_close(loaded.velocity(x, s, cond, g), pfam.adapter.velocity(x, s, cond_of(pfam), g),
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
    from flowforge.models.wan.adapter import wan_text

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
    from flowforge.models.wan.adapter import WanAdapter, wan_text
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
    from flowforge.models.wan.adapter import WanAdapter

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
    w = family("wan")
    rows: list[int] = []
    hook = w.adapter.transformer.register_forward_pre_hook(
        lambda m, args, kw: rows.append(kw["hidden_states"].shape[0]), with_kwargs=True)
    x, s = inputs_of(w)
    try:
        with torch.no_grad():
            for g in (4.0, 0.5):
                w.adapter.velocity(x, s, cond_of(w), g)
    finally:
        hook.remove()
    assert rows == [2, 2, 2]
