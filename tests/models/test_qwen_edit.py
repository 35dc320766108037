"""Qwen-Image-Edit image-to-image (``QwenImageAdapter(task="i2i")``) against diffusers' own ``QwenImageEditPipeline``.

The tiny random Qwen-Image-Edit parts (``tests/models/tiny_families.py::qwen_components(edit=True)``: a Qwen2.5-VL
with a vision tower and a ``Qwen2VLProcessor``) build both the pipeline and the adapter. The pipeline resizes its
condition image to about 1024^2 pixels (``calculate_dimensions``); flowforge loads condition images at model.height x
model.width and does not replicate that resize (see flowforge/models/qwen_image/adapter.py). So the parity test patches
the pipeline module's ``calculate_dimensions`` to return the output size and gives it 8-bit PIL images of that size: its
own ``resize`` / ``preprocess`` then leave them unchanged, and its VAE and processor see the images flowforge sees.
Fixed noise latents, two different images (one per prompt), 2 steps, true CFG; the final latents
come from ``callback_on_step_end``.
"""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from flowforge.models import build_adapter
from flowforge.models.base import ImageConditioned
from flowforge.models.common import pack_2x2, unpack_2x2
from tests.models import tiny_families as tiny

PROMPTS = ["a red cat sitting under a tree", "two dogs"]
SEQ_LEN, MIN_TOK = 64, 10
H = W = 16  # pixels; the tiny VAE downsamples 2x -> latent (4, 8, 8): 16 noisy + 16 image tokens
CFG = 4.0


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


_BUILT: dict[str, tuple] = {}


def _edit():
    """``(adapter (task i2i), components)`` of the tiny Qwen-Image-Edit, built once."""
    from flowforge.models.qwen_image.adapter import QwenImageAdapter, QwenImageEditText

    if "edit" not in _BUILT:
        c = tiny.qwen_components(edit=True)
        text = QwenImageEditText(components={k: c[k] for k in ("tokenizer", "text_encoder", "processor")},
                                 max_sequence_length=SEQ_LEN, min_tokenizer_size=MIN_TOK)
        adapter = QwenImageAdapter(c["transformer"], text, c["vae"], scheduler_config=dict(c["scheduler"].config),
                                   task="i2i")
        _BUILT["edit"] = adapter, c
    return _BUILT["edit"]


def _images(seed: int, n: int = 2):
    """``n`` random 8-bit RGB images: as PIL (the pipeline's input) and as ``[n, 3, H, W]`` float32 ``u8 / 255``
    (what :func:`flowforge.data.images.load_condition_images` gives for such files)."""
    from PIL import Image

    arrays = np.random.default_rng(seed).integers(0, 256, (n, H, W, 3), dtype=np.uint8)
    pil = [Image.fromarray(a) for a in arrays]
    return pil, torch.from_numpy(arrays).permute(0, 3, 1, 2).float() / 255.0


def _noise(adapter, seed: int = 11):
    shape = adapter.latent_shape(H, W)
    return shape, torch.randn(2, *shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("guidance", [0.5, 1.0, CFG])  # true_cfg_scale <= 1: the pipeline runs no CFG
def test_edit_matches_qwen_image_edit_pipeline(monkeypatch, guidance):
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as edit_module
    from diffusers import QwenImageEditPipeline

    from flowforge.rollout import generate, generated_index, with_condition

    a, c = _edit()
    assert a.task == "i2i" and a.tasks == ("t2i", "i2i")
    assert isinstance(a, ImageConditioned) and a.condition_index is None and generated_index(a) == (slice(None),)
    shape, noise = _noise(a)
    assert shape == (4, 8, 8)
    pil, images = _images(1)
    cond = a.condition_on_images(a.encode(PROMPTS), PROMPTS, images, shape)
    assert cond.image.shape == (2, 16, 16) and cond.image.dtype == torch.float32  # [N, (h/2)(w/2), 4C]
    assert with_condition(a, noise, cond) is noise  # the image is not written into the latent
    # kept tokens: the tiny template's prefix is 67 tokens (drop index 64 keeps "<|im_start|> user \n"), then
    # <|vision_start|> + 16 image tokens (16x16 px, patch 4) + <|vision_end|>, the prompt, 5 closing tokens
    assert cond.mask.sum(1).tolist() == [3 + 18 + 7 + 5, 3 + 18 + 2 + 5]
    assert cond.prompt_embeds.shape == (2, SEQ_LEN, 16)
    assert cond.negative.mask.sum(1).tolist() == [3 + 18 + 0 + 5] * 2  # " " is no token for the word tokenizer

    monkeypatch.setattr(edit_module, "calculate_dimensions", lambda area, ratio: (W, H, None))  # no ~1024^2 resize
    pipe = QwenImageEditPipeline(**c)
    captured = {}

    def grab(p, i, t, kw):
        captured["latents"] = kw["latents"].detach().clone()
        captured["prompt_embeds"] = kw["prompt_embeds"].detach().clone()
        return {}

    with torch.no_grad():
        out = pipe(image=pil, prompt=PROMPTS, negative_prompt=[" "] * 2, true_cfg_scale=guidance, height=H, width=W,
                   num_inference_steps=2, latents=pack_2x2(noise), output_type="pt", callback_on_step_end=grab,
                   callback_on_step_end_tensor_inputs=["latents", "prompt_embeds"])
    embeds = captured["prompt_embeds"]  # the pipeline's image-conditioned text encoding, batch-max length
    torch.testing.assert_close(cond.prompt_embeds[:, : embeds.shape[1]], embeds, rtol=0, atol=1e-6)
    assert cond.prompt_embeds[:, embeds.shape[1]:].abs().max() == 0  # zero-padded to max_sequence_length

    final = unpack_2x2(captured["latents"].float(), *shape[1:])
    sigmas = pipe.scheduler.sigmas.clone().float()
    torch.testing.assert_close(a.pipeline_sigmas(2, H, W), sigmas)  # mu from the noisy tokens only
    y = generate(a, cond, noise, sigmas, guidance)
    decoded = a.decode(y)
    print(f"Qwen-Image-Edit true CFG {guidance}: latents max abs diff {(y - final).abs().max().item():.3g}, "
          f"images {(decoded - out.images.float()).abs().max().item():.3g}")
    torch.testing.assert_close(y, final, rtol=1e-4, atol=1e-5)
    assert (y - noise).abs().max() > 1e-3
    torch.testing.assert_close(decoded, out.images.float(), rtol=1e-3, atol=2e-4)


def test_the_image_changes_text_conditioning_and_velocity():
    from flowforge.models.qwen_image.adapter import QwenImageAdapter

    a, c = _edit()
    shape, x = _noise(a)
    _, images = _images(1)
    _, other = _images(2)
    text_only = a.encode(PROMPTS)
    cond = a.condition_on_images(text_only, PROMPTS, images, shape)
    cond_other = a.condition_on_images(text_only, PROMPTS, other, shape)
    # the Qwen2.5-VL reads the image: prompt and negative embeddings depend on it (the negative sees the same image)
    assert (cond.prompt_embeds - cond_other.prompt_embeds).abs().max() > 1e-4
    assert (cond.negative.prompt_embeds - cond_other.negative.prompt_embeds).abs().max() > 1e-4
    assert not torch.equal(cond.negative.prompt_embeds[0], cond.negative.prompt_embeds[1])  # each row its own image
    s = torch.tensor([0.8, 0.3])
    t2i = QwenImageAdapter(c["transformer"], a.text_encoder, c["vae"])  # same weights, task t2i
    assert t2i.task == "t2i" and t2i.condition_index is None
    with torch.no_grad():
        v = a.velocity(x, s, cond, CFG)
        v_other = a.velocity(x, s, cond_other, CFG)
        # image tokens alone, with the text-only encoding: not the Edit conditioning
        v_tokens_only = a.velocity(x, s, dataclasses.replace(text_only, image=cond.image), CFG)
        v_plain = t2i.velocity(x, s, text_only, CFG)
        torch.testing.assert_close(t2i.velocity(x, s, cond, CFG), v)  # t2i with a cond.image uses it the same way
        # the negative branch sees the same image tokens: plain CFG formula + the pipeline's renormalisation
        v_c = a.velocity(x, s, cond, 1.0)
        v_u = a.velocity(x, s, dataclasses.replace(cond.negative, image=cond.image), 1.0)
    comb = pack_2x2(v_u + CFG * (v_c - v_u))
    comb = comb * (pack_2x2(v_c).norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))
    torch.testing.assert_close(v, unpack_2x2(comb, 8, 8), rtol=1e-4, atol=1e-5)
    assert v.shape == x.shape and v.dtype == torch.float32
    for u in (v_other, v_tokens_only, v_plain):
        assert (v - u).abs().max() > 1e-4
    bf16 = QwenImageAdapter(copy.deepcopy(c["transformer"]).to(torch.bfloat16), task="i2i")  # fp32 record, bf16 net
    with torch.no_grad():
        v16 = bf16.velocity(x, s, cond, CFG)
    assert v16.dtype == torch.float32 and (v16 - v).abs().max() < 0.1 * v.abs().max()


def test_edit_errors():
    from flowforge.models.qwen_image.adapter import QwenImageAdapter, QwenImageEditText, qwen_image_text

    a, c = _edit()
    shape, x = _noise(a)
    _, images = _images(1)
    text_only = a.encode(PROMPTS)
    s = torch.tensor([0.8, 0.3])
    with pytest.raises(ValueError, match=r"task='i2i' \(Qwen-Image-Edit\) needs cond.image"):
        a.velocity(x, s, text_only, CFG)
    with pytest.raises(ValueError, match="packed Edit image latents"):  # tokens of another latent size
        a.velocity(x, s, dataclasses.replace(text_only, image=torch.zeros(2, 4, 16)), CFG)
    with pytest.raises(ValueError, match="load them at the model's height x width"):
        a.condition_on_images(text_only, PROMPTS, torch.rand(2, 3, 2 * H, 2 * W), shape)
    with pytest.raises(ValueError, match="one of each per row"):
        a.condition_on_images(text_only, PROMPTS, images[:1], shape)
    with pytest.raises(ValueError, match=r"model.task='i2v': the \w+ adapter runs only \['t2i', 'i2i'\]"):
        QwenImageAdapter(c["transformer"], task="i2v")  # the spec's check (Family.check_task)
    t2i_text = qwen_image_text(components={k: c[k] for k in ("tokenizer", "text_encoder")},
                               max_sequence_length=SEQ_LEN, min_tokenizer_size=MIN_TOK)
    with pytest.raises(RuntimeError, match="must be a QwenImageEditText"):
        QwenImageAdapter(c["transformer"], t2i_text, c["vae"], task="i2i").condition_on_images(
            text_only, PROMPTS, images, shape)
    short = QwenImageEditText(components={k: c[k] for k in ("tokenizer", "text_encoder", "processor")},
                              max_sequence_length=16, min_tokenizer_size=MIN_TOK)
    with pytest.raises(ValueError, match="raise max_sequence_length"):  # 33 tokens with the image: no truncation
        short.encode_with_images(PROMPTS, images)


def test_edit_directory_loads_through_the_registry(tmp_path):
    import json

    from diffusers import QwenImageEditPipeline, QwenImagePipeline

    from flowforge.models.qwen_image.adapter import QwenImageEditText

    a, c = _edit()
    edit_dir, t2i_dir = tmp_path / "edit", tmp_path / "t2i"
    QwenImageEditPipeline(**c).save_pretrained(str(edit_dir))
    assert json.loads((edit_dir / "model_index.json").read_text())["_class_name"] == "QwenImageEditPipeline"
    loaded = build_adapter("qwen_image", str(edit_dir), task="i2i", max_sequence_length=SEQ_LEN,
                           min_tokenizer_size=MIN_TOK)
    assert loaded.task == "i2i" and loaded.condition_index is None
    assert isinstance(loaded.text_encoder, QwenImageEditText)
    assert "QwenImageEditPipeline" in loaded.encoder_id and str(edit_dir.resolve()) in loaded.encoder_id
    shape, x = _noise(loaded)
    _, images = _images(1)
    cond = loaded.condition_on_images(loaded.encode(PROMPTS), PROMPTS, images, shape)  # processor from disk
    ref = a.condition_on_images(a.encode(PROMPTS), PROMPTS, images, shape)
    for got, want in ((cond, ref), (cond.negative, ref.negative)):
        torch.testing.assert_close(got.prompt_embeds, want.prompt_embeds, rtol=0, atol=1e-6)
        assert torch.equal(got.mask, want.mask)
    torch.testing.assert_close(cond.image, ref.image, rtol=0, atol=1e-6)
    s = torch.tensor([0.6, 0.2])
    with torch.no_grad():
        torch.testing.assert_close(loaded.velocity(x, s, cond, CFG), a.velocity(x, s, ref, CFG), rtol=0, atol=1e-6)
    loaded.release_text_encoder()  # the trainer's release after start-up: i2i keeps the encoder it needs per step
    assert loaded.text_encoder._pipe is not None
    loaded.text_encoder.release()  # released anyway: it reloads lazily from the directory
    again = loaded.condition_on_images(loaded.encode(PROMPTS[:1]), PROMPTS[:1], images[:1], shape)
    torch.testing.assert_close(again.prompt_embeds, cond.prompt_embeds[:1], rtol=0, atol=1e-6)

    with pytest.raises(ValueError, match=r"runs only \['t2i', 'i2i'\]"):
        build_adapter("qwen_image", str(edit_dir), task="i2v")
    with pytest.raises(ValueError, match="load it with task='i2i'"):
        build_adapter("qwen_image", str(edit_dir), task="t2i")
    QwenImagePipeline(**{k: v for k, v in c.items() if k != "processor"}).save_pretrained(str(t2i_dir))
    with pytest.raises(ValueError, match="needs a QwenImageEditPipeline or QwenImageEditPlusPipeline directory"):
        build_adapter("qwen_image", str(t2i_dir), task="i2i")
