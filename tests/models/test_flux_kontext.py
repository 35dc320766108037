"""FLUX.1 Kontext image-to-image (``FluxAdapter(task="i2i")``) against diffusers' own ``FluxKontextPipeline``.

The tiny random FLUX parts (tests/models/tiny_families.py) build both the pipeline and the adapter. The pipeline runs
with ``_auto_resize=False`` and ``max_area = height * width`` (flowforge generates at model.height x model.width and
loads the condition image at that size; see flowforge/models/flux/adapter.py), fixed noise latents and a fixed image;
its final latents must be flowforge's own loop (:func:`flowforge.rollout.generate`) with
``cond.image = adapter.encode_condition_images(...)``.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from flowforge.models import build_adapter
from flowforge.models.base import ImageConditioned
from flowforge.models.common import pack_2x2, unpack_2x2
from tests.models import tiny_families as tiny

PROMPTS = ["a red cat sitting under a tree", "two dogs"]
SEQ_LEN, MIN_TOK = 16, 10
H = W = 16  # pixels; the tiny VAE downsamples 2x -> latent (4, 8, 8), 16 noisy + 16 image tokens



@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


_BUILT: dict[str, tuple] = {}


def _kontext(kind: str):
    """``(adapter (task i2i), components)`` of the tiny FLUX of ``kind`` ("dev" / "cfg"), built once."""
    from flowforge.models.flux.adapter import FluxAdapter, flux_text

    if kind not in _BUILT:
        c = tiny.flux_components(guidance_embeds=kind == "dev")
        text = flux_text(components={k: c[k] for k in ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2")},
                         max_sequence_length=SEQ_LEN, min_tokenizer_size=MIN_TOK)
        adapter = FluxAdapter(c["transformer"], text, c["vae"], scheduler_config=dict(c["scheduler"].config),
                              task="i2i")
        _BUILT[kind] = adapter, c
    return _BUILT[kind]


def _inputs(adapter, seed: int = 11):
    g = torch.Generator().manual_seed(seed)
    shape = adapter.latent_shape(H, W)
    return shape, torch.randn(2, *shape, generator=g), torch.rand(1, 3, H, W, generator=g)


def _with_image(adapter, cond, image, shape):
    return dataclasses.replace(cond, image=adapter.encode_condition_images(image.expand(2, -1, -1, -1), shape))


@pytest.mark.parametrize("kind,g", [("dev", 3.5), ("dev", 0.5), ("cfg", 4.0), ("cfg", 1.0), ("cfg", 0.5)])
def test_kontext_matches_flux_kontext_pipeline(kind, g):
    """dev: the embedded guidance value (any); cfg: true CFG where ``true_cfg_scale > 1``, none at 1 and 0.5."""
    from diffusers import FluxKontextPipeline

    from flowforge.rollout import generate, generated_index, with_condition

    a, c = _kontext(kind)
    assert a.task == "i2i" and "i2i" in a.tasks and a.guidance_embeds == (kind == "dev")
    assert isinstance(a, ImageConditioned) and a.condition_index is None and generated_index(a) == (slice(None),)
    shape, noise, image = _inputs(a)
    assert shape == (4, 8, 8)
    cond = _with_image(a, a.encode(PROMPTS), image, shape)
    assert cond.image.shape == (2, 16, 16) and cond.image.dtype == torch.float32  # [N, (h/2)(w/2), 4C]
    assert with_condition(a, noise, cond) is noise  # the image is not written into the latent

    guidance = dict(guidance_scale=g) if kind == "dev" else dict(true_cfg_scale=g, negative_prompt="")
    pipe = FluxKontextPipeline(**c)
    captured = {}

    def grab(p, i, t, kw):
        captured["latents"] = kw["latents"].detach().clone()
        return {}

    with torch.no_grad():
        out = pipe(image=image, prompt=PROMPTS, height=H, width=W, num_inference_steps=2, latents=pack_2x2(noise),
                   max_sequence_length=SEQ_LEN, _auto_resize=False, max_area=H * W, output_type="pt",
                   callback_on_step_end=grab, callback_on_step_end_tensor_inputs=["latents"], **guidance)
    final = unpack_2x2(captured["latents"].float(), *shape[1:])
    sigmas = pipe.scheduler.sigmas.clone().float()
    torch.testing.assert_close(a.pipeline_sigmas(2, H, W), sigmas)  # mu from the noisy tokens only

    y = generate(a, cond, noise, sigmas, g)
    print(f"FLUX.1 Kontext {kind} guidance {g}: latents max abs diff {(y - final).abs().max().item():.3g}")
    torch.testing.assert_close(y, final, rtol=1e-4, atol=1e-5)
    assert (y - noise).abs().max() > 1e-3
    torch.testing.assert_close(a.decode(y), out.images.float(), rtol=1e-3, atol=2e-4)

    if kind == "cfg" and g > 1:  # the negative branch sees the same image tokens (the pipeline's true-CFG forward)
        x, s = noise, torch.tensor([0.9, 0.4])
        with torch.no_grad():
            v_c = a.velocity(x, s, cond, 1.0)
            v_u = a.velocity(x, s, dataclasses.replace(cond.negative, image=cond.image), 1.0)
            torch.testing.assert_close(a.velocity(x, s, cond, g), v_u + g * (v_c - v_u), rtol=1e-4, atol=1e-5)


def test_kontext_image_changes_the_velocity_and_is_required():
    from flowforge.models.flux.adapter import FluxAdapter

    a, c = _kontext("dev")
    shape, x, image = _inputs(a)
    cond = a.encode(PROMPTS)
    s = torch.tensor([0.8, 0.3])
    other = torch.rand(1, 3, H, W, generator=torch.Generator().manual_seed(5))
    t2i = FluxAdapter(c["transformer"], a.text_encoder, c["vae"])  # same weights, task t2i
    assert t2i.task == "t2i" and t2i.condition_index is None
    with torch.no_grad():
        v = a.velocity(x, s, _with_image(a, cond, image, shape), 3.5)
        v_other = a.velocity(x, s, _with_image(a, cond, other, shape), 3.5)
        v_plain = t2i.velocity(x, s, cond, 3.5)
        # t2i with a cond.image uses it the same way
        torch.testing.assert_close(t2i.velocity(x, s, _with_image(a, cond, image, shape), 3.5), v)
    assert v.shape == x.shape and v.dtype == torch.float32
    assert (v - v_other).abs().max() > 1e-4 and (v - v_plain).abs().max() > 1e-4

    with pytest.raises(ValueError, match="task='i2i' .* needs cond.image"):
        a.velocity(x, s, cond, 3.5)
    with pytest.raises(ValueError, match="packed Kontext image tokens"):  # tokens of another latent size
        a.velocity(x, s, dataclasses.replace(cond, image=torch.zeros(2, 4, 16)), 3.5)
    with pytest.raises(ValueError, match="load them at the model's height x width"):
        a.encode_condition_images(torch.rand(2, 3, 2 * H, 2 * W), shape)
    with pytest.raises(ValueError, match=r"model.task='i2v': the \w+ adapter runs only \['t2i', 'i2i'\]"):
        FluxAdapter(c["transformer"], task="i2v")  # the spec's check (Family.check_task)


def test_kontext_directory_loads_through_the_registry(tmp_path):
    import json

    from diffusers import FluxKontextPipeline

    a, c = _kontext("dev")
    FluxKontextPipeline(**c).save_pretrained(str(tmp_path))
    assert json.loads((tmp_path / "model_index.json").read_text())["_class_name"] == "FluxKontextPipeline"
    loaded = build_adapter("flux", str(tmp_path), task="i2i", max_sequence_length=SEQ_LEN, min_tokenizer_size=MIN_TOK)
    assert loaded.task == "i2i" and loaded.condition_index is None
    shape, x, image = _inputs(loaded)
    cond = loaded.encode(PROMPTS)  # T5 + CLIP of the Kontext directory, through FluxPipeline.encode_prompt
    ref = a.encode(PROMPTS)
    torch.testing.assert_close(cond.prompt_embeds, ref.prompt_embeds)
    torch.testing.assert_close(cond.pooled, ref.pooled)
    cond = _with_image(loaded, cond, image, shape)
    torch.testing.assert_close(cond.image, _with_image(a, ref, image, shape).image)
    s = torch.tensor([0.6, 0.2])
    with torch.no_grad():
        torch.testing.assert_close(loaded.velocity(x, s, cond, 3.5), a.velocity(x, s, cond, 3.5), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"runs only \['t2i', 'i2i'\]"):
        build_adapter("flux", str(tmp_path), task="i2v")
