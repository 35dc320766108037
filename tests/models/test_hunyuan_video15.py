"""HunyuanVideo 1.5 adapter (flowforge/models/hunyuan_video15/adapter.py) against diffusers' ``HunyuanVideo15Pipeline``
and ``HunyuanVideo15ImageToVideoPipeline`` on tiny random pipelines (tests/models/tiny_hunyuan_video15.py): the
encodings are the pipeline's (Qwen2.5-VL and ByT5, glyph text included), the velocity is the pipeline's transformer
call, and a whole ODE generation (flowforge's Euler transition over the adapter's pipeline_sigmas) equals the
pipeline's latents and decoded video, bitwise in fp32, with and without CFG; i2v likewise from the same image."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flowforge.algorithms.sde import transition
from flowforge.models import ADAPTERS, adapter_tasks, build_adapter
from flowforge.models.base import FlowModel
from tests.models import tiny_hunyuan_video15 as tiny

PROMPTS = ["a red cat sitting under a tree", 'a sign with the text "open" on a street']  # the 2nd has glyph text
SEQ_LEN, GLYPH = 24, 16  # the pipeline's tokenizer_max_length / tokenizer_2_max_length, shortened
MIN_TOK = 10
SIZE, FRAMES = (16, 16), 5  # latent [4, 3, 4, 4]
STEPS = 3


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _pipe(cls_name: str, parts: dict):
    import diffusers

    pipe = getattr(diffusers, cls_name)(**parts)
    pipe.tokenizer_max_length, pipe.tokenizer_2_max_length = SEQ_LEN, GLYPH
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _adapter(parts: dict, task: str = "t2v"):
    from flowforge.models.hunyuan_video15.adapter import HunyuanVideo15Adapter
    from flowforge.models.hunyuan_video15.text import TEXT_COMPONENTS, hunyuan_video15_text

    text = hunyuan_video15_text(components={k: parts[k] for k in TEXT_COMPONENTS}, max_sequence_length=SEQ_LEN,
                                glyph_length=GLYPH, min_tokenizer_size=MIN_TOK)
    return HunyuanVideo15Adapter(parts["transformer"], text, parts["vae"], task=task, glyph_length=GLYPH,
                                 scheduler_config=dict(parts["scheduler"].config),
                                 image_encoder=parts.get("image_encoder"),
                                 feature_extractor=parts.get("feature_extractor"))


@pytest.fixture(scope="module")
def t2v():
    parts = tiny.components()
    adapter = _adapter(parts)
    return dict(parts=parts, adapter=adapter, pipe=_pipe("HunyuanVideo15Pipeline", parts),
                cond=adapter.encode(PROMPTS))


def _latents(seed: int, channels: int = 4, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, channels, 3, 4, 4, generator=torch.Generator().manual_seed(seed))


def test_registered_protocol_and_geometry(t2v):
    a = t2v["adapter"]
    assert "hunyuan_video15" in ADAPTERS and isinstance(a, FlowModel)
    assert adapter_tasks("hunyuan_video15") == ("t2v", "i2v")
    assert a.latent_shape(*SIZE, FRAMES) == (4, 3, 4, 4) and a.condition_index is None
    for bad in ((16, 16, 4), (18, 16, 5), (16, 16, None)):
        with pytest.raises(ValueError):
            a.latent_shape(*bad)
    names = [n for n, _ in a.transformer.named_modules()]
    refiner = "context_embedder.token_refiner.refiner_blocks.0."
    for target in a.lora_targets:  # the dual-stream block's attention (+ the token refiner's for to_q/k/v/out)
        expected = [f"transformer_blocks.0.{target}"]
        if "add" not in target:
            expected.insert(0, refiner + target)
        assert [n for n in names if n.endswith(target)] == expected
    assert len(a.blocks()) == 1 and type(a.blocks()[0]).__name__ == "HunyuanVideo15TransformerBlock"


def test_encoding_is_the_pipelines(t2v):
    """cond = [Qwen2.5-VL | ByT5] of HunyuanVideo15Pipeline.encode_prompt; the glyph prompt's ByT5 part is real,
    the other's zero with mask 0; negative = encode_prompt(None) (the "" prompt)."""
    pipe, cond, a = t2v["pipe"], t2v["cond"], t2v["adapter"]
    with torch.no_grad():
        e1, m1, e2, m2 = pipe.encode_prompt(PROMPTS, device="cpu", batch_size=2)
        n1, nm1, n2, nm2 = pipe.encode_prompt(None, device="cpu", batch_size=2)
    got = a.split_text(cond)
    for mine, theirs in zip(got, (e1, m1, e2, m2)):
        assert torch.equal(mine.to(theirs.dtype), theirs)
    assert m2[0].sum() == 0 and m2[1].sum() > 0 and e2[0].abs().max() == 0
    assert (m1.sum(1) > 5).all()  # the crop keeps the prompt's words and the 5 template tokens after them
    assert cond.prompt_embeds.shape == (2, SEQ_LEN + GLYPH, 32)  # features padded to ByT5's 32 (Qwen: 16)
    for mine, theirs in zip(a.split_text(cond.negative), (n1, nm1, n2, nm2)):
        assert torch.equal(mine.to(theirs.dtype), theirs)


def _pipeline_call(pipe, cond_kwargs: dict, x: torch.Tensor, sigma: torch.Tensor, image_embeds: torch.Tensor):
    """The pipeline's denoiser call of one guider branch (``__call__``, "guider_state_batch.noise_pred =")."""
    b = x.shape[0]
    latent_in = torch.cat([x, *pipe.prepare_cond_latents_and_mask(x, torch.float32, "cpu")], dim=1)
    t = (sigma * 1000).expand(b).to(latent_in.dtype)
    return pipe.transformer(hidden_states=latent_in, image_embeds=image_embeds, timestep=t, return_dict=False,
                            **cond_kwargs)[0]


def test_velocity_is_the_pipeline_transformer_call(t2v):
    """v == the transformer on cat([x, zero condition latents, zero mask]) at t = 1000 sigma with the pipeline's
    embeddings and 729 zero image tokens, bitwise; CFG == pred_uncond + g (pred_cond - pred_uncond)."""
    a, pipe = t2v["adapter"], t2v["pipe"]
    x, sigma = _latents(1), torch.tensor(0.63)
    with torch.no_grad():
        e1, m1, e2, m2 = pipe.encode_prompt(PROMPTS, device="cpu", batch_size=2)
        n1, nm1, n2, nm2 = pipe.encode_prompt(None, device="cpu", batch_size=2)
        zeros = torch.zeros(2, 729, 12)
        c = _pipeline_call(pipe, dict(encoder_hidden_states=e1, encoder_attention_mask=m1,
                                      encoder_hidden_states_2=e2, encoder_attention_mask_2=m2), x, sigma, zeros)
        u = _pipeline_call(pipe, dict(encoder_hidden_states=n1, encoder_attention_mask=nm1,
                                      encoder_hidden_states_2=n2, encoder_attention_mask_2=nm2), x, sigma, zeros)
        v1 = a.velocity(x, sigma.expand(2), t2v["cond"], 1.0)
        v6 = a.velocity(x, sigma.expand(2), t2v["cond"], 6.0)
    assert v1.dtype == torch.float32 and torch.equal(v1, c)
    assert torch.equal(v6, u + 6.0 * (c - u))
    with torch.no_grad():
        assert (a.velocity(x, sigma.expand(2), t2v["cond"].index([1, 0]), 1.0) - v1).abs().max() > 1e-5


@pytest.mark.parametrize("guidance", [0.5, 1.0, 4.0])  # the guider runs CFG at any scale but 1 (0.5 included)
def test_whole_generation_matches_the_pipeline(guidance):
    """3 Euler steps of flowforge's transition("ode") over the adapter's pipeline_sigmas (linspace(1, 0, T+1)[:-1]
    shifted by the scheduler's shift 7) == HunyuanVideo15Pipeline's final latents (batch 2) and, for one prompt, its
    decoded video (the pipeline's VAE decode fails for batch > 1 in diffusers 0.42), bitwise in fp32."""
    parts = tiny.components(guidance_scale=guidance)
    a, pipe = _adapter(parts), _pipe("HunyuanVideo15Pipeline", parts)
    x = _latents(3)
    with torch.no_grad():
        latents = pipe(prompt=PROMPTS, height=SIZE[0], width=SIZE[1], num_frames=FRAMES, num_inference_steps=STEPS,
                       latents=x.clone(), output_type="latent").frames
        video = pipe(prompt=PROMPTS[1:], height=SIZE[0], width=SIZE[1], num_frames=FRAMES,
                     num_inference_steps=STEPS, latents=x[1:].clone(), output_type="pt").frames
    sigmas = a.pipeline_sigmas(STEPS, *SIZE)
    assert torch.equal(sigmas, pipe.scheduler.sigmas) and sigmas[0] == 1 and sigmas[-1] == 0
    cond = a.encode(PROMPTS)

    def generate(y: torch.Tensor, c) -> torch.Tensor:
        for i in range(STEPS):
            v = a.velocity(y, sigmas[i].expand(y.shape[0]), c, guidance)
            y = transition("ode", y, v, sigmas[i], sigmas[i + 1], 0.0).x_next
        return y

    with torch.no_grad():
        y = generate(x.clone(), cond)
        y1 = generate(x[1:].clone(), cond.index([1]))
        decoded = a.decode(y1)
    assert (y - x).abs().max() > 0.5
    assert torch.equal(y, latents)
    assert decoded.shape == (1, 3, FRAMES, *SIZE)
    assert torch.equal(decoded, video.permute(0, 2, 1, 3, 4).float())  # pipeline frames are [B, F, 3, H, W]


def test_i2v_whole_generation_matches_the_image_to_video_pipeline():
    """i2v: the condition slot (VAE latent of the image x scaling_factor in frame 0, mask 1 there) and the SigLIP
    tokens from condition_on_images, then 3 ODE steps at CFG 4 == HunyuanVideo15ImageToVideoPipeline's latents for
    the same image (16x16: its own bucket at target_size 16, so the pipeline's resize keeps it), bitwise."""
    from PIL import Image

    parts = tiny.components(i2v=True, guidance_scale=4.0)
    a, pipe = _adapter(parts, task="i2v"), _pipe("HunyuanVideo15ImageToVideoPipeline", parts)
    pixels = np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    image = torch.from_numpy(pixels).permute(2, 0, 1)[None].float() / 255.0
    noise = _latents(4, batch=1)
    with torch.no_grad():
        latents = pipe(prompt=PROMPTS[:1], image=Image.fromarray(pixels), num_frames=FRAMES,
                       num_inference_steps=STEPS, latents=noise.clone(), output_type="latent").frames
    shape = a.latent_shape(*SIZE, FRAMES)
    assert shape == (9, 3, 4, 4) and a.condition_index == (slice(None), slice(4, None))
    with torch.no_grad():
        cond = a.condition_on_images(a.encode(PROMPTS[:1]), PROMPTS[:1], image, shape)
    assert cond.image.shape == (1, 5, 3, 4, 4) and cond.pooled.shape == (1, 16 * 12)
    assert torch.equal(cond.negative.pooled, cond.pooled)
    assert cond.image[:, 4, 0].eq(1).all() and cond.image[:, 4, 1:].eq(0).all() and cond.image[:, :4, 1:].eq(0).all()
    sigmas = a.pipeline_sigmas(STEPS, *SIZE)
    y = torch.cat([noise, cond.image], dim=1)
    with torch.no_grad():
        for i in range(STEPS):
            v = a.velocity(y, sigmas[i].expand(1), cond, 4.0)
            assert v[a.condition_index].eq(0).all()
            y = transition("ode", y, v, sigmas[i], sigmas[i + 1], 0.0).x_next
    assert torch.equal(y[:, 4:], cond.image)  # the slot never moves
    assert torch.equal(y[:, :4], latents)
    assert a.decode(y).shape == (1, 3, FRAMES, *SIZE)


def test_few_step_sde_first_sigma(t2v):
    """A 4-step grid: the SDE step at sigma = 1 has std eta exactly and replays to the same log-prob."""
    a = t2v["adapter"]
    sigmas = a.pipeline_sigmas(4, *SIZE)
    x, s = _latents(5), sigmas[0].expand(2)
    with torch.no_grad():
        v = a.velocity(x, s, t2v["cond"], 1.0)
        step = transition("sde", x, v, s, sigmas[1], 0.5, generator=torch.Generator().manual_seed(0))
        replay = transition("sde", x, v, s, sigmas[1], 0.5, x_next=step.x_next)
    torch.testing.assert_close(step.std, torch.full((2,), 0.5), rtol=1e-5, atol=0)
    assert torch.equal(replay.log_prob, step.log_prob)


def test_refusals():
    from flowforge.models.hunyuan_video15.adapter import HunyuanVideo15Adapter

    parts = tiny.components()
    with pytest.raises(ValueError, match="task"):
        HunyuanVideo15Adapter(parts["transformer"], task="t2i")
    with pytest.raises(ValueError, match="image_encoder"):
        HunyuanVideo15Adapter(parts["transformer"], vae=parts["vae"], task="i2v")
    from diffusers import HunyuanVideo15Transformer3DModel

    meanflow = HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_refiner_layers=1, text_embed_dim=16, text_embed_2_dim=32, image_embed_dim=12, rope_axes_dim=(2, 2, 4),
        use_meanflow=True)
    with pytest.raises(ValueError, match="use_meanflow"):
        HunyuanVideo15Adapter(meanflow)


@pytest.mark.parametrize("i2v", [False, True])
def test_save_pretrained_loads_through_registry(i2v, tmp_path):
    import diffusers

    parts = tiny.components(i2v=i2v)
    cls = "HunyuanVideo15ImageToVideoPipeline" if i2v else "HunyuanVideo15Pipeline"
    getattr(diffusers, cls)(**parts).save_pretrained(str(tmp_path))
    loaded = build_adapter("hunyuan_video15", str(tmp_path), max_sequence_length=SEQ_LEN, glyph_length=GLYPH,
                           min_tokenizer_size=MIN_TOK)
    assert loaded.task == ("i2v" if i2v else "t2v") and (loaded.image_encoder is not None) == i2v
    ref = _adapter(parts, task=loaded.task)
    cond, expected = loaded.encode(PROMPTS), ref.encode(PROMPTS)
    assert torch.equal(cond.prompt_embeds, expected.prompt_embeds) and torch.equal(cond.mask, expected.mask)
    x = _latents(6, channels=9 if i2v else 4)
    if i2v:  # the loaded SigLIP encoder / processor and VAE give the same condition as the in-memory ones
        image = torch.rand(2, 3, *SIZE, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            cond = loaded.condition_on_images(cond, PROMPTS, image, x.shape[1:])
            expected = ref.condition_on_images(expected, PROMPTS, image, x.shape[1:])
        assert torch.equal(cond.pooled, expected.pooled) and torch.equal(cond.image, expected.image)
        x[:, 4:] = cond.image
    with torch.no_grad():
        for g in (1.0, 5.0):
            assert torch.equal(loaded.velocity(x, torch.tensor([0.2, 0.9]), cond, g),
                               ref.velocity(x, torch.tensor([0.2, 0.9]), expected, g))
