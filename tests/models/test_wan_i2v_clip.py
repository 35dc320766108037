"""Wan2.1-I2V-14B-style image-to-video: a transformer with ``image_dim`` reads CLIP image tokens, computed as
``WanImageToVideoPipeline.encode_image`` does, in both CFG branches. Tiny random-init components, nothing
downloaded; the adapter is checked against the real diffusers pipeline built from the same components."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from PIL import Image

from flowforge.models import build_adapter
from flowforge.models.base import Conditioning
from tests.models import tiny_families as tiny

PROMPTS = ["a red cat sitting under a tree", "two dogs"]
MIN_TOK = 10
TEXT_LEN = 512  # an image_dim transformer's cross-attention takes the last 512 context tokens as text
HEIGHT, WIDTH, FRAMES = 16, 32, 9  # not square: the CLIP processor resizes (shortest edge) and center-crops
CLIP_SIZE, CLIP_PATCH, IMAGE_DIM = 8, 4, 16
S_IMG = (CLIP_SIZE // CLIP_PATCH) ** 2 + 1  # patch tokens + class token


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def with_clip(components: dict, seed: int = 0) -> dict:
    """Wan2.1 I2V parts (``tiny.wan_components(i2v=True)``) turned Wan2.1-I2V-14B-style: the transformer gets
    ``image_dim`` (CLIP token width) and ``added_kv_proj_dim`` (= its inner dim, the image tokens' key / value input
    after the image embedder), plus a 2-layer ``CLIPVisionModel`` (``hidden_states[-2]`` is then a real
    intermediate layer) and a ``CLIPImageProcessor`` sized for it."""
    from diffusers import WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed + 1)
    z = 4
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=2 * z + 4, out_channels=z,
        text_dim=32, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32, image_dim=IMAGE_DIM,
        added_kv_proj_dim=16,
    )
    encoder = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=IMAGE_DIM, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        image_size=CLIP_SIZE, patch_size=CLIP_PATCH, projection_dim=IMAGE_DIM,
    ))
    processor = CLIPImageProcessor(size={"shortest_edge": CLIP_SIZE},
                                   crop_size={"height": CLIP_SIZE, "width": CLIP_SIZE})
    return dict(components, transformer=transformer.eval(), image_encoder=encoder.eval(), image_processor=processor)


_PARTS: dict = {}


def _parts():
    """``(components, adapter)`` built once per session (random init is seeded, so identical either way)."""
    if not _PARTS:
        from flowforge.models.wan.adapter import WanAdapter, wan_text

        c = with_clip(tiny.wan_components(i2v=True))
        text = wan_text(components={k: c[k] for k in ("tokenizer", "text_encoder")}, max_sequence_length=TEXT_LEN,
                        min_tokenizer_size=MIN_TOK)
        a = WanAdapter(c["transformer"], text, c["vae"], task="i2v", image_encoder=c["image_encoder"],
                       image_processor=c["image_processor"])
        _PARTS.update(c=c, a=a)
    return _PARTS["c"], _PARTS["a"]


def _image(seed: int = 0):
    """``(PIL image, [1, 3, H, W] float32 in [0, 1])`` of the same 8-bit pixels."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8)
    return Image.fromarray(pixels), torch.from_numpy(pixels).permute(2, 0, 1)[None].float() / 255.0


def _conditioned(a, images, prompts=PROMPTS):
    shape = a.latent_shape(HEIGHT, WIDTH, FRAMES)
    return a.condition_on_images(a.encode(prompts), prompts, images, shape), shape


def test_clip_tokens_condition_both_cfg_branches_and_match_the_pipeline():
    from diffusers import WanImageToVideoPipeline

    from flowforge.rollout import generate, with_condition

    c, a = _parts()
    assert a.image_dim == IMAGE_DIM and a.tasks == ("i2v",)
    pil, image = _image()
    images = image.expand(2, -1, -1, -1)
    cond, shape = _conditioned(a, images)
    assert shape == (12, 3, 2, 4)

    # the tokens are the pipeline's encode_image (processor + hidden_states[-2]), one row per image, in both branches
    pipe = WanImageToVideoPipeline(**c)
    with torch.no_grad():
        reference = pipe.encode_image(pil, torch.device("cpu"))  # [1, S_img, image_dim]
    assert reference.shape == (1, S_IMG, IMAGE_DIM)
    tokens = a.encode_image_tokens(image)
    assert tokens.dtype == torch.float32
    torch.testing.assert_close(tokens, reference, rtol=0, atol=1e-6)
    assert cond.pooled.shape == (2, S_IMG * IMAGE_DIM) and cond.pooled.dtype == torch.float32
    torch.testing.assert_close(cond.pooled, reference.flatten(1).expand(2, -1), rtol=0, atol=1e-6)
    assert torch.equal(cond.negative.pooled, cond.pooled)
    last = a.image_encoder(**a.image_processor(images=pil, return_tensors="pt"), output_hidden_states=True)
    assert not torch.allclose(tokens, last.last_hidden_state)  # the penultimate layer, not the last

    # CFG in two forwards (conditional, then negative), as WanImageToVideoPipeline: both get the same image tokens,
    # and they matter
    g = torch.Generator().manual_seed(11)
    noise = torch.randn(2, *shape, generator=g)
    x = with_condition(a, noise, cond)
    seen = []
    handle = a.transformer.register_forward_pre_hook(
        lambda m, args, kw: seen.append(kw["encoder_hidden_states_image"].clone()), with_kwargs=True)
    try:
        with torch.no_grad():
            v = a.velocity(x, torch.tensor([0.9, 0.4]), cond, 4.0)
    finally:
        handle.remove()
    assert len(seen) == 2
    for fed in seen:
        assert fed.shape == (2, S_IMG, IMAGE_DIM)
        torch.testing.assert_close(fed, reference.expand(2, -1, -1), rtol=0, atol=1e-6)
    slot, gen = a.condition_index, a.generated_index
    assert v[slot].abs().max() == 0 and v[gen].abs().max() > 0
    other = a.condition_on_images(a.encode(PROMPTS), PROMPTS, _image(1)[1].expand(2, -1, -1, -1), shape)
    with torch.no_grad():
        v_other = a.velocity(x, torch.tensor([0.9, 0.4]), dataclasses.replace(other, image=cond.image), 4.0)
    assert (v_other - v)[gen].abs().max() > 1e-4  # same latent condition, other CLIP tokens: another velocity

    # 2 Euler steps, guidance 4: flowforge's loop = the pipeline (PIL image in; text embeddings given, because
    # WanImageToVideoPipeline's prompt_clean needs ftfy in diffusers 0.42)
    captured = {}

    def grab(p, i, t, kw):
        captured["latents"] = kw["latents"].detach().clone()
        return {}

    with torch.no_grad():
        out = pipe(image=pil, prompt_embeds=cond.prompt_embeds, negative_prompt_embeds=cond.negative.prompt_embeds,
                   guidance_scale=4.0, height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=2,
                   latents=noise[:, : a.z_dim].clone(), output_type="pt", max_sequence_length=TEXT_LEN,
                   callback_on_step_end=grab, callback_on_step_end_tensor_inputs=["latents"])
    y = generate(a, cond, noise, pipe.scheduler.sigmas.clone().float(), 4.0)
    torch.testing.assert_close(y[:, : a.z_dim], captured["latents"].float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y[:, a.z_dim:], x[:, a.z_dim:])
    assert (y - x)[gen].abs().max() > 1e-3
    torch.testing.assert_close(a.decode(y), out.frames.permute(0, 2, 1, 3, 4).float(), rtol=1e-3, atol=2e-4)


def test_saved_pipeline_loads_with_its_image_encoder(tmp_path):
    from diffusers import WanImageToVideoPipeline

    c, a = _parts()
    WanImageToVideoPipeline(**c).save_pretrained(str(tmp_path))
    pil, image = _image(2)
    images = torch.cat([image, _image(3)[1]])  # a different image per row
    cond, shape = _conditioned(a, images)
    x = torch.randn(2, *shape, generator=torch.Generator().manual_seed(5))
    sigma = torch.tensor([0.7, 0.3])
    with torch.no_grad():
        expected = {g: a.velocity(x, sigma, cond, g) for g in (1.0, 4.0)}

    index = json.loads((tmp_path / "model_index.json").read_text())
    # as saved here (no torchvision: CLIPImageProcessorPil), then as the released Wan2.1-I2V repos name it
    for name in (index["image_processor"][1], "CLIPImageProcessor"):
        (tmp_path / "model_index.json").write_text(json.dumps({**index, "image_processor": ["transformers", name]}))
        loaded = build_adapter("wan", str(tmp_path), task="i2v", max_sequence_length=TEXT_LEN,
                               min_tokenizer_size=MIN_TOK)
        assert loaded.task == "i2v" and loaded.image_encoder is not None
        assert type(loaded.image_processor).__name__.startswith("CLIPImageProcessor")
        got, _ = _conditioned(loaded, images)
        assert loaded.text_encoder._pipe.image_encoder is None  # text encoding never loads the vision model
        torch.testing.assert_close(got.pooled, cond.pooled, rtol=0, atol=1e-6)
        assert torch.equal(got.negative.pooled, got.pooled)
        with torch.no_grad():
            for g, v in expected.items():
                torch.testing.assert_close(loaded.velocity(x, sigma, got, g), v, rtol=0, atol=1e-6)
        # diffusers loading the same directory computes the same tokens
        pipe = WanImageToVideoPipeline.from_pretrained(str(tmp_path))
        assert type(pipe.image_processor) is type(loaded.image_processor)
        with torch.no_grad():
            torch.testing.assert_close(loaded.encode_image_tokens(image), pipe.encode_image(pil, torch.device("cpu")),
                                       rtol=0, atol=1e-6)

    # a directory without the image encoder fails at load time, not at the first forward
    (tmp_path / "model_index.json").write_text(json.dumps({**index, "image_encoder": [None, None]}))
    with pytest.raises(ValueError, match="image_encoder"):
        build_adapter("wan", str(tmp_path), task="i2v", max_sequence_length=TEXT_LEN, min_tokenizer_size=MIN_TOK)


def test_clip_transformer_errors():
    from flowforge.models.wan.adapter import WanAdapter, wan_text

    c, a = _parts()
    with pytest.raises(ValueError, match="image_encoder"):
        WanAdapter(c["transformer"], None, c["vae"], task="i2v")
    with pytest.raises(ValueError, match="image_encoder"):
        WanAdapter(c["transformer"], None, c["vae"], task="i2v", image_encoder=c["image_encoder"])
    bare = WanAdapter(c["transformer"], task="i2v")  # velocity only (no VAE): reads cond.pooled as given
    with pytest.raises(RuntimeError):
        bare.encode_image_tokens(_image()[1])
    short = wan_text(components={k: c[k] for k in ("tokenizer", "text_encoder")}, max_sequence_length=16,
                     min_tokenizer_size=MIN_TOK)
    shape = a.latent_shape(HEIGHT, WIDTH, FRAMES)
    with pytest.raises(ValueError, match="max_sequence_length=512"):
        a.condition_on_images(Conditioning(short.encode(PROMPTS[:1])[0]), PROMPTS[:1], _image()[1], shape)
    with pytest.raises(ValueError, match="cond.pooled"):
        a.velocity(torch.zeros(1, *shape), torch.tensor([0.5]), a.encode(PROMPTS[:1]), 1.0)
