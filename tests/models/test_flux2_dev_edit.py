"""FLUX.2 [dev] (``Flux2Pipeline``: Mistral-3 text, guidance embedding) and FLUX.2 reference-image editing
(``task="i2i"``, the ``image=`` argument of ``Flux2Pipeline`` and ``Flux2KleinPipeline``) of
flowforge/models/flux2/adapter.py against diffusers' pipelines on tiny random parts
(tests/models/tiny_image_families.py): velocity == the pipeline's transformer call, and a whole 4-step ODE generation
(flowforge's Euler transition over the pipeline's sigmas) == the pipeline's latents and images, bitwise in fp32. The
reference images are given to the pipeline as 8-bit PIL images at the output size (what flowforge loads from such
files), the same images for every
prompt (the pipelines repeat one image list over the batch)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from flowforge.algorithms.sde import transition
from flowforge.models import build_adapter
from tests.models import tiny_image_families as tiny

PROMPTS = ["a red cat sitting under a tree", "two dogs"]
SEQ_LEN, MIN_TOK = 32, 10
SIZE = (16, 16)  # pixels; patchified latent [16, 4, 4]
REF_SIZE = (64, 64)  # i2i: the pipelines refuse a reference image under 64 px (check_image_input); latent [16, 16, 16]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def parts():
    from diffusers import Flux2KleinPipeline, Flux2Pipeline

    from flowforge.models.flux2.adapter import Flux2Adapter, flux2_dev_text, flux2_klein_text

    built = {}
    for name, components, make_text, pipeline in (("dev", tiny.flux2_dev_components(), flux2_dev_text, Flux2Pipeline),
                                                   ("klein", tiny.flux2_klein_components(), flux2_klein_text,
                                                    Flux2KleinPipeline)):
        text = make_text(components={k: components[k] for k in ("tokenizer", "text_encoder")},
                         max_sequence_length=SEQ_LEN, min_tokenizer_size=MIN_TOK)
        cfg = dict(components["scheduler"].config)
        t2i = Flux2Adapter(components["transformer"], text, components["vae"], scheduler_config=cfg)
        i2i = Flux2Adapter(components["transformer"], text, components["vae"], scheduler_config=cfg, task="i2i")
        built[name] = dict(t2i=t2i, i2i=i2i, pipe=pipeline(**components), cond=t2i.encode(PROMPTS), c=components)
    return built


def _latents(seed: int, size: tuple[int, int] = SIZE) -> torch.Tensor:
    return torch.randn(len(PROMPTS), 16, size[0] // 4, size[1] // 4, generator=torch.Generator().manual_seed(seed))


def _images(seed: int, k: int):
    """``k`` random 8-bit RGB reference images: PIL (the pipeline's input) and ``[k, 3, H, W]`` float32 u8 / 255."""
    from PIL import Image

    arrays = np.random.default_rng(seed).integers(0, 256, (k, *REF_SIZE, 3), dtype=np.uint8)
    return [Image.fromarray(a) for a in arrays], torch.from_numpy(arrays).permute(0, 3, 1, 2).float() / 255.0


def _generate(adapter, cond, x, sigmas, guidance):
    y = x.clone()
    with torch.no_grad():
        for i in range(len(sigmas) - 1):
            v = adapter.velocity(y, sigmas[i].expand(len(y)), cond, guidance)
            y = transition("ode", y, v, sigmas[i], sigmas[i + 1], 0.0).x_next
    return y


def _pipeline_run(pipe, x, guidance, size=SIZE, **kw):
    captured = {}

    def grab(p, i, t, k):
        captured["latents"] = k["latents"].clone()
        return {}

    with torch.no_grad():
        out = pipe(prompt=list(PROMPTS), height=size[0], width=size[1], num_inference_steps=4, latents=x.clone(),
                   guidance_scale=guidance, output_type="pt", max_sequence_length=SEQ_LEN, callback_on_step_end=grab,
                   **kw)
    final = pipe._unpack_latents_with_ids(captured["latents"], pipe._prepare_latent_ids(x))
    return final, out.images.float()


def test_dev_velocity_is_the_pipeline_transformer_call(parts):
    """Mistral-3 layers (10, 20, 30) through ``Flux2Pipeline.encode_prompt``; one forward with the guidance value
    as a transformer input; bitwise."""
    p = parts["dev"]
    a, pipe = p["t2i"], p["pipe"]
    assert a.guidance_embeds and a.negative_prompt is None and p["cond"].negative is None
    x, sigma = _latents(1), torch.tensor([0.37, 0.81])
    with torch.no_grad():
        embeds, text_ids = pipe.encode_prompt(list(PROMPTS), max_sequence_length=SEQ_LEN)
        out = pipe.transformer(hidden_states=pipe._pack_latents(x), timestep=(sigma * 1000) / 1000,
                               guidance=torch.full([2], 4.0), encoder_hidden_states=embeds, txt_ids=text_ids,
                               img_ids=pipe._prepare_latent_ids(x), return_dict=False)[0]
        expected = pipe._unpack_latents_with_ids(out, pipe._prepare_latent_ids(x))
        v = a.velocity(x, sigma, p["cond"], 4.0)
        v_other = a.velocity(x, sigma, p["cond"], 2.5)
    assert p["cond"].prompt_embeds.shape == (2, SEQ_LEN, 24) and torch.equal(p["cond"].prompt_embeds, embeds)
    assert v.dtype == torch.float32 and torch.equal(v, expected)
    assert (v - v_other).abs().max() > 1e-5  # the guidance value reaches the network


@pytest.mark.parametrize("guidance", [4.0, 2.5])  # the pipeline's default and another embedded value
def test_dev_whole_generation_matches_the_pipeline(parts, guidance):
    p = parts["dev"]
    a = p["t2i"]
    x = _latents(3)
    final, images = _pipeline_run(p["pipe"], x, guidance)
    sigmas = a.pipeline_sigmas(4, *SIZE)
    assert torch.equal(sigmas, p["pipe"].scheduler.sigmas)
    y = _generate(a, p["cond"], x, sigmas, guidance)
    assert (y - x).abs().max() > 0.5
    assert torch.equal(y, final)  # max abs diff 0
    assert torch.equal(a.decode(y), images)


@pytest.mark.parametrize("family,guidance", [("klein", 1.0), ("klein", 4.0), ("dev", 4.0)])
@pytest.mark.parametrize("k", [1, 2])  # one reference image (the trainer's rows) and two
def test_reference_image_generation_matches_the_pipeline(parts, family, guidance, k):
    p = parts[family]
    a = p["i2i"]
    pil, images = _images(10 + k, k)
    x = _latents(4, REF_SIZE)
    cond = a.condition_on_images(p["cond"], PROMPTS, images.unsqueeze(0).expand(2, -1, -1, -1, -1),
                                 a.latent_shape(*REF_SIZE))
    assert cond.image.shape == (2, k * 256, 16) and torch.equal(cond.prompt_embeds, p["cond"].prompt_embeds)
    with torch.no_grad():
        image_latents, ref_ids = p["pipe"].prepare_image_latents(
            [p["pipe"].image_processor.preprocess(im, height=64, width=64, resize_mode="crop") for im in pil],
            2, None, "cpu", torch.float32)
    assert torch.equal(cond.image, image_latents)
    assert ref_ids[0, :, 0].unique().tolist() == [10 * (i + 1) for i in range(k)]  # the T coordinate per image
    final, out = _pipeline_run(p["pipe"], x, guidance, size=REF_SIZE, image=pil)
    sigmas = a.pipeline_sigmas(4, *REF_SIZE)
    assert torch.equal(sigmas, p["pipe"].scheduler.sigmas)  # mu from the noisy tokens only
    y = _generate(a, cond, x, sigmas, guidance)
    assert torch.equal(y, final)  # max abs diff 0
    assert torch.equal(a.decode(y), out)
    plain = _generate(p["t2i"], p["cond"], x, sigmas, guidance)
    assert (y - plain).abs().max() > 1e-4  # the reference tokens change the generation


def test_reference_image_errors(parts):
    a, cond = parts["klein"]["i2i"], parts["klein"]["cond"]
    x, s = _latents(5, REF_SIZE), torch.tensor([0.5, 0.9])
    shape = a.latent_shape(*REF_SIZE)
    with pytest.raises(ValueError, match=r"task='i2i' \(FLUX.2 reference images\) needs cond.image"):
        a.velocity(x, s, cond, 1.0)
    with pytest.raises(ValueError, match="packed reference latents"):
        a.velocity(x, s, dataclasses.replace(cond, image=torch.zeros(2, 20, 16)), 1.0)
    with pytest.raises(ValueError, match="Image too small"):  # the pipeline's own check_image_input
        a.condition_on_images(cond, PROMPTS, torch.rand(2, 3, *SIZE), a.latent_shape(*SIZE))
    with pytest.raises(ValueError, match="one per row"):
        a.condition_on_images(cond, PROMPTS, torch.rand(1, 3, *REF_SIZE), shape)


def test_dev_directory_loads_through_the_registry(parts, tmp_path):
    from flowforge.models.flux2.adapter import Flux2Adapter

    p = parts["dev"]
    p["pipe"].save_pretrained(str(tmp_path))
    loaded = build_adapter("flux2", str(tmp_path), max_sequence_length=SEQ_LEN, min_tokenizer_size=MIN_TOK)
    assert type(loaded) is Flux2Adapter and loaded.guidance_embeds and loaded.negative_prompt is None
    assert "Flux2Pipeline" in loaded.encoder_id
    cond = loaded.encode(PROMPTS)
    assert torch.equal(cond.prompt_embeds, p["cond"].prompt_embeds)
    x, s = _latents(6), torch.tensor([0.2, 0.9])
    with torch.no_grad():
        assert torch.equal(loaded.velocity(x, s, cond, 4.0), p["t2i"].velocity(x, s, p["cond"], 4.0))
    i2i = build_adapter("flux2", str(tmp_path), task="i2i", max_sequence_length=SEQ_LEN, min_tokenizer_size=MIN_TOK)
    assert i2i.task == "i2i" and i2i.condition_index is None
