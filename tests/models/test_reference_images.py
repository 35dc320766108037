"""Multi-image edits with reference images at their own sizes (not the model's), against a pipeline loaded
separately: FLUX.2 Klein (``Flux2KleinPipeline``) and Qwen-Image-Edit-2511 (``QwenImageEditPlusPipeline``) built from
their own freshly constructed modules (same seed, no module shared with flowforge's adapter), so a kernel difference
between the two sides (e.g. a frozen VAE) would show. Each prompt lists 2 or 3 images of odd sizes; flowforge runs
both prompts in one batch (rows with different image layouts run in separate forwards), the pipeline one prompt at a
time, given the same PIL images and ``height`` / ``width`` = the model size. Bitwise, fp32."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flowforge.algorithms.sde import transition
from tests.models import tiny_image_families as tiny

PROMPTS = ["a red cat sitting under a tree", "two dogs"]
FLUX_SIZES = [[(73, 90), (101, 70)], [(73, 90), (101, 70), (66, 130)]]  # (h, w), >= 64 px (check_image_input)
QWEN_SIZES = [[(40, 24), (72, 56)], [(40, 24), (72, 56), (24, 40)]]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _pil(sizes, seed):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [[Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in row] for row in sizes]


def _generate(adapter, cond, x, sigmas, guidance):
    y = x.clone()
    with torch.no_grad():
        for i in range(len(sigmas) - 1):
            y = transition("ode", y, adapter.velocity(y, sigmas[i].expand(len(y)), cond, guidance), sigmas[i],
                           sigmas[i + 1], 0.0).x_next
    return y


def _grab():
    captured = {}

    def grab(p, i, t, k):
        captured["latents"] = k["latents"].clone()
        return {}

    return captured, grab


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_flux2_odd_size_references_match_a_separate_pipeline(guidance):
    from diffusers import Flux2KleinPipeline

    from flowforge.models.flux2.adapter import Flux2Adapter, flux2_klein_text

    ours, theirs = tiny.flux2_klein_components(0), tiny.flux2_klein_components(0)  # same seed, separate modules
    text = flux2_klein_text(components={k: ours[k] for k in ("tokenizer", "text_encoder")}, max_sequence_length=32,
                            min_tokenizer_size=10)
    a = Flux2Adapter(ours["transformer"], text, ours["vae"], scheduler_config=dict(ours["scheduler"].config),
                     task="i2i")
    pipe = Flux2KleinPipeline(**theirs)
    assert not any(p is q for p in pipe.vae.parameters() for q in a.vae.parameters())
    pil = _pil(FLUX_SIZES, 1)
    size = (64, 64)
    cond = a.condition_on_images(a.encode(PROMPTS), PROMPTS, pil, a.latent_shape(*size))
    # each at its own size floored to a multiple of 2 f = 4 (the tiny VAE's f = 2; crop): 72x88, 100x68, 64x128
    assert cond.image_grids.tolist() == [[[18, 22], [25, 17], [0, 0]], [[18, 22], [25, 17], [16, 32]]]
    assert cond.image.shape == (2, 396 + 425 + 512, 16) and not cond.image[0, 821:].any()  # row 0 zero-padded
    x = torch.randn(2, 16, 16, 16, generator=torch.Generator().manual_seed(4))
    sigmas = a.pipeline_sigmas(4, *size)
    y = _generate(a, cond, x, sigmas, guidance)
    images = a.decode(y)
    for i, prompt in enumerate(PROMPTS):
        captured, grab = _grab()
        with torch.no_grad():
            ref, _ = pipe.prepare_image_latents(
                [pipe.image_processor.preprocess(im, height=im.height // 4 * 4, width=im.width // 4 * 4,
                                                 resize_mode="crop") for im in pil[i]], 1, None, "cpu", torch.float32)
            out = pipe(prompt=prompt, image=pil[i], height=size[0], width=size[1], num_inference_steps=4,
                       latents=x[i:i + 1].clone(), guidance_scale=guidance, output_type="pt", max_sequence_length=32,
                       callback_on_step_end=grab).images.float()
        length = ref.shape[1]
        assert torch.equal(cond.image[i, :length], ref[0])  # the reference tokens, bitwise
        final = pipe._unpack_latents_with_ids(captured["latents"], pipe._prepare_latent_ids(x[i:i + 1]))
        assert torch.equal(y[i:i + 1], final)  # the generation, bitwise
        diff = float((a.decode(y[i:i + 1]) - out).abs().max())  # decoded alone, as the pipeline does
        batched = float((images[i:i + 1] - out).abs().max())  # decoded in flowforge's batch of 2
        print(f"FLUX.2 decode vs separately loaded pipeline, prompt {i}: max abs diff {diff:.3g} alone, "
              f"{batched:.3g} in a batch of 2")
        assert diff == 0.0  # the frozen VAE decodes as the pipeline's (requires_grad True) one
        assert batched < 1e-5  # torch's CPU kernels may block a batch of 2 differently


@pytest.fixture
def _small_qwen_areas(monkeypatch):
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus

    monkeypatch.setattr(plus, "CONDITION_IMAGE_SIZE", 32 * 32)
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", 32 * 48)


def test_qwen_edit_plus_odd_size_images_match_a_separate_pipeline(_small_qwen_areas):
    from diffusers import QwenImageEditPlusPipeline

    from flowforge.models.qwen_image.adapter import QwenImageAdapter, QwenImageEditPlusText

    ours, theirs = tiny.qwen_edit_plus_components(0), tiny.qwen_edit_plus_components(0)
    text = QwenImageEditPlusText(components={k: ours[k] for k in ("tokenizer", "text_encoder", "processor")},
                                 max_sequence_length=320, min_tokenizer_size=10)
    a = QwenImageAdapter(ours["transformer"], text, ours["vae"], scheduler_config=dict(ours["scheduler"].config),
                         task="i2i", edit_plus=True)
    pipe = QwenImageEditPlusPipeline(**theirs)
    pil = _pil(QWEN_SIZES, 2)
    size = (16, 24)
    cond = a.condition_on_images(a.encode(PROMPTS), PROMPTS, pil, a.latent_shape(*size))
    # calculate_dimensions(32 * 48, w / h) per image: 32x64 -> grid 8x... of its own aspect ratio
    grids = cond.image_grids.tolist()
    assert grids[0][:2] == grids[1][:2] and grids[0][2] == [0, 0] and grids[1][2] != [0, 0]
    assert grids[0][0] != grids[0][1]  # 40x24 and 72x56 differ in aspect ratio: different VAE sizes
    x = torch.randn(2, 4, 8, 12, generator=torch.Generator().manual_seed(5))
    sigmas = a.pipeline_sigmas(3, *size)
    y = _generate(a, cond, x, sigmas, 4.0)
    images = a.decode(y)
    from flowforge.models.common import pack_2x2, unpack_2x2

    for i, prompt in enumerate(PROMPTS):
        captured, grab = _grab()
        with torch.no_grad():
            out = pipe(image=pil[i], prompt=prompt, negative_prompt=" ", true_cfg_scale=4.0, height=size[0],
                       width=size[1], num_inference_steps=3, latents=pack_2x2(x[i:i + 1]), output_type="pt",
                       max_sequence_length=320, callback_on_step_end=grab).images.float()
        final = unpack_2x2(captured["latents"], 8, 12)
        diff = float((y[i:i + 1] - final).abs().max())
        assert torch.equal(y[i:i + 1], final), diff  # the generation, bitwise
        idiff = float((a.decode(y[i:i + 1]) - out).abs().max())  # decoded alone, as the pipeline does
        batched = float((images[i:i + 1] - out).abs().max())
        print(f"Qwen-Edit-Plus decode vs separately loaded pipeline, prompt {i}: max abs diff {idiff:.3g} alone, "
              f"{batched:.3g} in a batch of 2")
        assert idiff == 0.0 and batched < 1e-5
