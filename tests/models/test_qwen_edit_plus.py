"""Qwen-Image-Edit-2511 (``QwenImageAdapter(task="i2i", edit_plus=True)``) against diffusers' own
``QwenImageEditPlusPipeline`` on a tiny random pipeline (tests/models/tiny_image_families.py: the tiny
Qwen-Image-Edit parts with a ``zero_cond_t`` transformer, as Edit-2511's).

The pipeline resizes every condition image twice: to ``calculate_dimensions(CONDITION_IMAGE_SIZE = 384^2, w / h)``
for the Qwen2.5-VL and ``calculate_dimensions(VAE_IMAGE_SIZE = 1024^2, w / h)`` for the VAE. flowforge does the same
(it reads both constants and the function from the pipeline module). A 1024^2 VAE image is too big for a CPU test, so
the tests set both areas small in the pipeline module (``monkeypatch``; both sides read the patched values): a
16x24-pixel condition image becomes 32x32 for the VL and 32x64 for the VAE, so the image-token grid (8x16) differs
from the noisy grid (4x6) and the aspect ratio is changed on the way, as at full size for a non-square image. The
pipeline runs one prompt at a time (``__call__`` refuses a batch > 1), so each comparison is per prompt; fixed noise
latents, true CFG 4 with negative ``" "``, 3 steps; the final latents come from ``callback_on_step_end``.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from flowforge.models import build_adapter
from flowforge.models.common import pack_2x2, unpack_2x2
from tests.models import tiny_image_families as tiny

PROMPTS = ["a red cat sitting under a tree", "two dogs"]
SEQ_LEN, MIN_TOK = 192, 10
H, W = 16, 24  # pixels; the tiny VAE downsamples 2x -> latent (4, 8, 12): 24 noisy tokens
CFG = 4.0


@pytest.fixture(autouse=True)
def _small_areas(monkeypatch):
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus

    torch.set_num_threads(1)
    monkeypatch.setattr(plus, "CONDITION_IMAGE_SIZE", 32 * 32)
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", 32 * 48)


@pytest.fixture(scope="module")
def parts():
    from flowforge.models.qwen_image.adapter import QwenImageAdapter, QwenImageEditPlusText

    c = tiny.qwen_edit_plus_components()
    text = QwenImageEditPlusText(components={k: c[k] for k in ("tokenizer", "text_encoder", "processor")},
                                 max_sequence_length=SEQ_LEN, min_tokenizer_size=MIN_TOK)
    adapter = QwenImageAdapter(c["transformer"], text, c["vae"], scheduler_config=dict(c["scheduler"].config),
                               task="i2i", edit_plus=True)
    return dict(adapter=adapter, c=c)


def _images(seed: int, n: int = 2, k: int = 1):
    """``n x k`` random 8-bit RGB images ``H x W``: as PIL lists (the pipeline's input, one list per prompt) and as
    ``[n, k, 3, H, W]`` float32 ``u8 / 255`` (what flowforge loads from such files)."""
    from PIL import Image

    arrays = np.random.default_rng(seed).integers(0, 256, (n, k, H, W, 3), dtype=np.uint8)
    pil = [[Image.fromarray(a) for a in row] for row in arrays]
    return pil, torch.from_numpy(arrays).permute(0, 1, 4, 2, 3).float() / 255.0


def _noise(adapter, seed: int = 11):
    shape = adapter.latent_shape(H, W)
    return shape, torch.randn(2, *shape, generator=torch.Generator().manual_seed(seed))


def test_sizes_follow_the_pipeline_constants(parts, monkeypatch):
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus

    from flowforge.models.qwen_image.adapter import edit_plus_sizes

    a = parts["adapter"]
    assert edit_plus_sizes(H, W) == ((32, 32), (64, 32))
    assert a.encode_plus_condition_images(_images(0)[1])[1].tolist() == [[[8, 16]]] * 2  # (vae size) // f // 2
    monkeypatch.setattr(plus, "CONDITION_IMAGE_SIZE", 384 * 384)  # the released values
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", 1024 * 1024)
    assert edit_plus_sizes(1024, 1024) == ((384, 384), (1024, 1024))
    assert edit_plus_sizes(768, 1344) == ((512, 288), (1344, 768))  # 16:9: the VL image keeps about 384^2 pixels


def test_velocity_is_the_pipeline_transformer_call(parts):
    """One prompt with two condition images: the pipeline's own ``encode_prompt`` / ``prepare_latents`` /
    ``img_shapes`` into its transformer == the adapter's velocity (conditional and true-CFG), bitwise."""
    from diffusers import QwenImageEditPlusPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    a, c = parts["adapter"], parts["c"]
    pipe = QwenImageEditPlusPipeline(**c)
    pil, images = _images(1, n=1, k=2)
    shape, noise = _noise(a)
    x, sigma = noise[:1], torch.tensor([0.63])
    cond = a.condition_on_images(a.encode(PROMPTS[:1]), PROMPTS[:1], images, shape)
    assert cond.image.shape == (1, 2 * 128, 16) and cond.image.dtype == torch.float32
    with torch.no_grad():
        vl = [pipe.image_processor.resize(p, 32, 32) for p in pil[0]]
        embeds, mask = pipe.encode_prompt(prompt=PROMPTS[:1], image=vl, max_sequence_length=SEQ_LEN)
        neg, neg_mask = pipe.encode_prompt(prompt=[" "], image=vl, max_sequence_length=SEQ_LEN)
        vae_images = [pipe.image_processor.preprocess(p, 32, 64).unsqueeze(2) for p in pil[0]]
        latents, image_latents = pipe.prepare_latents(vae_images, 1, 4, H, W, embeds.dtype, "cpu", None,
                                                      pack_2x2(x))
        shapes = [[(1, 4, 6), (1, 8, 16), (1, 8, 16)]]
        model_input = torch.cat([latents, image_latents], dim=1)

        def call(e, m):
            return pipe.transformer(hidden_states=model_input, timestep=sigma, encoder_hidden_states_mask=m,
                                    encoder_hidden_states=e, img_shapes=shapes, return_dict=False)[0][:, :24]

        v_c, v_u = call(embeds, mask), call(neg, neg_mask)
        comb = v_u + CFG * (v_c - v_u)
        comb = comb * (torch.norm(v_c, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
        v1 = a.velocity(x, sigma, cond, 1.0)
        v4 = a.velocity(x, sigma, cond, CFG)
    assert torch.equal(cond.image, image_latents)
    assert torch.equal(cond.prompt_embeds[:, : embeds.shape[1]], embeds) and mask is None  # one row: no padding
    assert torch.equal(v1, unpack_2x2(v_c, 8, 12)) and torch.equal(v4, unpack_2x2(comb, 8, 12))
    assert plus.CONDITION_IMAGE_SIZE == 32 * 32


@pytest.mark.parametrize("k", [1, 2])  # one condition image (the trainer's rows) and a two-image edit
def test_whole_generation_matches_the_pipeline(parts, k):
    from diffusers import QwenImageEditPlusPipeline

    from flowforge.rollout import generate

    a, c = parts["adapter"], parts["c"]
    pipe = QwenImageEditPlusPipeline(**c)
    pil, images = _images(2 + k, n=2, k=k)
    shape, noise = _noise(a)
    cond = a.condition_on_images(a.encode(PROMPTS), PROMPTS, images[:, 0] if k == 1 else images, shape)
    assert cond.image.shape == (2, k * 128, 16)
    sigmas = a.pipeline_sigmas(3, H, W)
    for i, prompt in enumerate(PROMPTS):
        captured = {}

        def grab(p, step, t, kw):
            captured["latents"] = kw["latents"].detach().clone()
            return {}

        with torch.no_grad():
            out = pipe(image=pil[i], prompt=prompt, negative_prompt=" ", true_cfg_scale=CFG, height=H, width=W,
                       num_inference_steps=3, latents=pack_2x2(noise[i: i + 1]), output_type="pt",
                       callback_on_step_end=grab, max_sequence_length=SEQ_LEN)
            assert torch.equal(sigmas, pipe.scheduler.sigmas)  # mu from the 24 noisy tokens only
            y = generate(a, cond.index([i]), noise[i: i + 1], sigmas, CFG)
            image = a.decode(y)
        final = unpack_2x2(captured["latents"], *shape[1:])
        assert (y - noise[i: i + 1]).abs().max() > 0.1
        assert torch.equal(y, final)  # max abs diff 0
        assert torch.equal(image, out.images.float())


def test_plus_conditioning_depends_on_each_image_and_checks_shapes(parts):
    from flowforge.models.qwen_image.adapter import QwenImageAdapter

    a, c = parts["adapter"], parts["c"]
    shape, x = _noise(a)
    _, two = _images(5, n=2, k=2)
    text_only = a.encode(PROMPTS)
    both = a.condition_on_images(text_only, PROMPTS, two, shape)
    swapped = a.condition_on_images(text_only, PROMPTS, two.flip(1), shape)  # "Picture 1" / "Picture 2" order
    assert (both.prompt_embeds - swapped.prompt_embeds).abs().max() > 1e-4
    assert torch.equal(both.image[:, :128], swapped.image[:, 128:])
    s = torch.tensor([0.8, 0.3])
    with torch.no_grad():
        assert (a.velocity(x, s, both, CFG) - a.velocity(x, s, swapped, CFG)).abs().max() > 1e-4
    with pytest.raises(ValueError, match="Edit-Plus image latents"):
        a.velocity(x, s, dataclasses.replace(both, image=both.image[:, :100]), CFG)
    # another size is resized from its own size, as the pipeline does (tests/models/test_reference_images.py)
    assert a.condition_on_images(text_only, PROMPTS, torch.rand(2, 3, 2 * H, 2 * W), shape).image.shape == (2, 128, 16)
    with pytest.raises(ValueError, match="one of each per row"):
        a.condition_on_images(text_only, PROMPTS, two[:1], shape)
    with pytest.raises(ValueError, match="task must be 'i2i'"):
        QwenImageAdapter(c["transformer"], edit_plus=True)
    edit = QwenImageAdapter(c["transformer"], a.text_encoder, c["vae"], task="i2i")  # Edit conventions
    with pytest.raises(ValueError, match="one image per prompt"):
        edit.condition_on_images(text_only, PROMPTS, two, shape)


def test_plus_directory_loads_through_the_registry(parts, tmp_path):
    import json

    from diffusers import QwenImageEditPlusPipeline

    from flowforge.models.qwen_image.adapter import QwenImageEditPlusText

    a, c = parts["adapter"], parts["c"]
    QwenImageEditPlusPipeline(**c).save_pretrained(str(tmp_path))
    assert json.loads((tmp_path / "model_index.json").read_text())["_class_name"] == "QwenImageEditPlusPipeline"
    loaded = build_adapter("qwen_image", str(tmp_path), task="i2i", max_sequence_length=SEQ_LEN,
                           min_tokenizer_size=MIN_TOK)
    assert loaded.edit_plus and isinstance(loaded.text_encoder, QwenImageEditPlusText)
    assert loaded.transformer.config.zero_cond_t
    shape, x = _noise(loaded)
    _, images = _images(6, n=2, k=1)
    cond = loaded.condition_on_images(loaded.encode(PROMPTS), PROMPTS, images[:, 0], shape)
    ref = a.condition_on_images(a.encode(PROMPTS), PROMPTS, images[:, 0], shape)
    torch.testing.assert_close(cond.prompt_embeds, ref.prompt_embeds, rtol=0, atol=1e-6)
    torch.testing.assert_close(cond.image, ref.image, rtol=0, atol=1e-6)
    s = torch.tensor([0.6, 0.2])
    with torch.no_grad():
        torch.testing.assert_close(loaded.velocity(x, s, cond, CFG), a.velocity(x, s, ref, CFG), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="load it with task='i2i'"):
        build_adapter("qwen_image", str(tmp_path), task="t2i")


def test_batched_rows_equal_the_per_prompt_pipeline_up_to_rounding(parts):
    """The pipeline encodes and denoises one prompt at a time; flowforge batches rows, padding the shorter encoding
    with ``mask = 0``. The masked keys get zero attention weight, so a batched row equals its own batch-1 velocity up
    to float summation order (measured max abs 1.3e-6 at |v| ~ 2; tolerance 1e-5)."""
    a = parts["adapter"]
    _, images = _images(3, n=2, k=2)
    shape, x = _noise(a)
    cond = a.condition_on_images(a.encode(PROMPTS), PROMPTS, images, shape)
    lengths = cond.mask.sum(1).tolist()
    assert lengths[0] != lengths[1]  # the second row is padded in the batch
    s = torch.tensor([0.7, 0.4])
    with torch.no_grad():
        batched = a.velocity(x, s, cond, CFG)
        rows = [a.velocity(x[i: i + 1], s[i: i + 1], cond.index([i]), CFG) for i in range(2)]
    torch.testing.assert_close(batched, torch.cat(rows), rtol=0, atol=1e-5)
