"""LTX-2 audio-video adapter (flowforge/models/ltx2/adapter.py) against diffusers' ``LTX2Pipeline`` on a tiny random
pipeline (tests/models/tiny_av_families.py): the velocity of the joint (video | audio) latent == the pipeline's
transformer call taken through its x0 round trip, and a whole ODE generation (flowforge's Euler transition over the
adapter's pipeline_sigmas) == the pipeline's video and audio latents, frames and waveform -- bitwise in fp32, with and
without CFG."""
from __future__ import annotations

import copy

import pytest
import torch

from flowforge.algorithms.sde import transition
from flowforge.models import ADAPTERS, build_adapter, set_sampler_options
from flowforge.models.base import FlowModel
from tests.models import tiny_av_families as tiny

PROMPTS = ["a red cat sitting under a tree", "two dogs"]
SEQ_LEN = 16
MIN_TOK = 10
SIZE = (32, 32, 5)  # pixels, frames; video latent [4, 3, 16, 16] -> 768 tokens, audio 5 tokens of width 4
FPS = 25.0
NO_EXTRA_GUIDANCE = dict(stg_scale=0.0, modality_scale=1.0, audio_stg_scale=0.0, audio_modality_scale=1.0,
                         spatio_temporal_guidance_blocks=None)


@pytest.fixture(scope="module")
def parts():
    from diffusers import LTX2Pipeline

    from flowforge.models.ltx2.adapter import LTX2Adapter, ltx2_text

    c = tiny.ltx2_components()
    text = ltx2_text(components={k: c[k] for k in ("tokenizer", "text_encoder", "connectors")},
                     max_sequence_length=SEQ_LEN, min_tokenizer_size=MIN_TOK)
    adapter = LTX2Adapter(c["transformer"], text, c["vae"], c["audio_vae"], c["vocoder"],
                          scheduler_config=dict(c["scheduler"].config), frame_rate=FPS)
    shape = adapter.latent_shape(*SIZE)
    return dict(components=c, adapter=adapter, pipe=LTX2Pipeline(**c), cond=adapter.encode(PROMPTS), shape=shape)


def _latents(seed: int = 0) -> torch.Tensor:
    return torch.randn(len(PROMPTS), 773, 4, generator=torch.Generator().manual_seed(seed))


def test_registered_protocol_and_geometry(parts):
    a = parts["adapter"]
    assert "ltx2" in ADAPTERS and isinstance(a, FlowModel) and a.tasks == ("t2v",)
    assert parts["shape"] == (3 * 16 * 16 + 5, 4)
    g = a.geometry
    assert (g.latent_frames, g.latent_height, g.latent_width, g.audio_frames, g.mel_bins) == (3, 16, 16, 5, 2)
    with pytest.raises(ValueError, match="frames"):
        a.latent_shape(32, 32, 4)
    with pytest.raises(ValueError, match="multiples of 32"):
        a.latent_shape(48, 32, 5)
    assert a.geometry.tokens == 773  # a refused call leaves the geometry alone
    names = [n for n, _ in a.transformer.named_modules()]
    for target in a.lora_targets:
        assert sum(n.endswith("." + target) for n in names) == 2  # one per block
    assert len(a.blocks()) == 2


def _pipeline_text(pipe, prompts, negative=None):
    """The pipeline's own (Gemma, connectors) outputs for ``prompts`` ([negative; prompts] when negative)."""
    with torch.no_grad():
        pos, pos_mask, neg, neg_mask = pipe.encode_prompt(prompts, negative_prompt=negative,
                                                          do_classifier_free_guidance=negative is not None,
                                                          max_sequence_length=SEQ_LEN)
        if negative is not None:
            pos, pos_mask = torch.cat([neg, pos]), torch.cat([neg_mask, pos_mask])
        return pipe.connectors(pos, pos_mask, padding_side=pipe.tokenizer.padding_side)


def test_encoding_is_the_pipelines_connector_output(parts):
    cond, pipe = parts["cond"], parts["pipe"]
    video, audio, mask = _pipeline_text(pipe, PROMPTS)
    assert torch.equal(cond.prompt_embeds, torch.cat([video, audio], -1)) and torch.equal(cond.mask, mask)
    assert cond.prompt_embeds.shape == (2, SEQ_LEN, 32)  # video (16) | audio (16) connector features
    nv, na, _ = _pipeline_text(pipe, [""])
    assert torch.equal(cond.negative.prompt_embeds[1], torch.cat([nv, na], -1)[0])


def test_velocity_is_the_pipeline_transformer_call(parts):
    """Adapter velocity == the pipeline's ``transformer(...)`` outputs (video | audio) through ``x0 = x - v sigma``,
    ``v = (x - x0) / sigma``, bitwise; it depends on both modalities and on the prompt."""
    a, pipe = parts["adapter"], parts["pipe"]
    x, sigma = _latents(1), torch.tensor([0.37, 0.81])
    video, audio, mask = _pipeline_text(pipe, PROMPTS)
    t = sigma * 1000
    a = copy.copy(a)  # no CFG, no rescale: the raw transformer call (the defaults guide the audio at 7)
    set_sampler_options(a, dict(audio_guidance_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0))
    with torch.no_grad():
        v_video, v_audio = pipe.transformer(
            hidden_states=x[:, :768], audio_hidden_states=x[:, 768:], encoder_hidden_states=video,
            audio_encoder_hidden_states=audio, timestep=t, sigma=t, encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask, num_frames=3, height=16, width=16, fps=FPS, audio_num_frames=5,
            video_coords=pipe.transformer.rope.prepare_video_coords(2, 3, 16, 16, x.device, fps=FPS),
            audio_coords=pipe.transformer.audio_rope.prepare_audio_coords(2, 5, x.device),
            isolate_modalities=False, use_cross_timestep=True, return_dict=False)
        v = a.velocity(x, sigma, parts["cond"], 1.0)
    raw = torch.cat([v_video.float(), v_audio.float()], 1)
    s = sigma.view(-1, 1, 1)
    assert v.dtype == torch.float32 and v.shape == x.shape
    assert torch.equal(v, (x - (x - raw * s)) / s)
    with torch.no_grad():
        assert (a.velocity(x, sigma, parts["cond"].index([1, 0]), 1.0) - v).abs().max() > 1e-5
        y = x.clone()
        y[:, 768:] += 1.0  # the audio tokens move the video velocity (audio-to-video cross-attention)
        assert (a.velocity(y, sigma, parts["cond"], 1.0)[:, :768] - v[:, :768]).abs().max() > 1e-6


def _pipeline_run(pipe, video0, audio0, steps, guidance, options, output_type):
    with torch.no_grad():
        return pipe(prompt=list(PROMPTS), negative_prompt="", height=SIZE[0], width=SIZE[1], num_frames=SIZE[2],
                    num_inference_steps=steps, latents=video0.clone(), audio_latents=audio0.clone(),
                    guidance_scale=guidance, max_sequence_length=SEQ_LEN, output_type=output_type,
                    **options, **NO_EXTRA_GUIDANCE)


NO_CFG = dict(audio_guidance_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0)
RESCALED = dict(audio_guidance_scale=5.0, guidance_rescale=0.7, audio_guidance_rescale=0.7)


@pytest.mark.parametrize("guidance,options", [
    (1.0, NO_CFG), (0.5, NO_CFG), (3.0, RESCALED),  # 0.5: the pipeline runs no CFG (both scales <= 1)
    (0.5, dict(audio_guidance_scale=0.5, guidance_rescale=0.7, audio_guidance_rescale=0.7)),  # rescale, no CFG
    (1.0, {}), (0.5, {}), (4.0, {}),  # the pipeline's defaults: audio 7 (CFG at every video scale), rescale 0.7
    (3.0, dict(audio_guidance_scale=2.0, guidance_rescale=0.3)),  # audio rescale left at its default 0.7
], ids=["g1", "g0.5", "g3-a5-r0.7", "g0.5-rescale", "defaults-g1", "defaults-g0.5", "defaults-g4", "g3-a2-r0.3"])
def test_whole_generation_matches_the_pipeline(parts, guidance, options):
    """3 Euler steps of ``transition("ode")`` over the joint latent with the adapter's velocity == LTX2Pipeline's
    video latents, audio latents, decoded frames and waveform (the pipeline given the same initial noise: packed
    video latents as-is, audio latents through its own normalisation), bitwise in fp32. ``options`` are the
    ``sampler`` keys set on the adapter (:func:`set_sampler_options`) and passed to the pipeline; the rest keep
    their defaults on both sides, which must agree (audio guidance 7, rescale 0.7, frame rate 24 vs the test's
    FPS: both take ``frame_rate`` from the ``sampler`` key)."""
    from diffusers import LTX2Pipeline

    pipe, c = parts["pipe"], parts["components"]
    a = copy.copy(parts["adapter"])
    options = {**options, "frame_rate": FPS}
    set_sampler_options(a, options)
    x = _latents(3)
    video0, audio_in = x[:, :768].clone(), x[:, 768:].clone()
    # the pipeline normalises given audio latents ((a - mean) / std); start flowforge at what its loop starts at
    x[:, 768:] = LTX2Pipeline._normalize_audio_latents(audio_in, c["audio_vae"].latents_mean,
                                                       c["audio_vae"].latents_std)
    latent = _pipeline_run(pipe, video0, audio_in, 3, guidance, options, "latent")
    media = _pipeline_run(pipe, video0, audio_in, 3, guidance, options, "pt")
    sigmas = a.pipeline_sigmas(3, *SIZE[:2])
    assert torch.equal(sigmas, pipe.scheduler.sigmas)
    y = x.clone()
    with torch.no_grad():
        for i in range(3):
            v = a.velocity(y, sigmas[i].expand(2), parts["cond"], guidance)
            y = transition("ode", y, v, sigmas[i], sigmas[i + 1], 0.0).x_next
        frames, (wave, rate) = a.decode(y), a.decode_audio(y)
    vae, avae = c["vae"], c["audio_vae"]
    video_latent = LTX2Pipeline._denormalize_latents(LTX2Pipeline._unpack_latents(y[:, :768], 3, 16, 16),
                                                     vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    audio_latent = LTX2Pipeline._unpack_audio_latents(
        LTX2Pipeline._denormalize_audio_latents(y[:, 768:], avae.latents_mean, avae.latents_std), 5, num_mel_bins=2)
    assert (y - x).abs().max() > 0.5
    assert torch.equal(video_latent, latent.frames) and torch.equal(audio_latent, latent.audio)
    assert frames.shape == (2, 3, 5, 32, 32) and torch.equal(frames, media.frames.permute(0, 2, 1, 3, 4))
    assert rate == 16000 and wave.shape == media.audio.shape and torch.equal(wave, media.audio.float())


def test_schedule_counts_video_tokens(parts):
    """mu = calculate_shift(F h w video tokens, 1024, 4096, 0.95, 2.05): a longer video shifts harder."""
    from flowforge.algorithms.schedules import calculate_shift
    from flowforge.models.ltx2.adapter import LTX2Adapter

    c = parts["components"]
    a = LTX2Adapter(c["transformer"], vae=c["vae"], audio_vae=c["audio_vae"], vocoder=c["vocoder"],
                    scheduler_config=dict(c["scheduler"].config), frame_rate=FPS)
    with pytest.raises(RuntimeError, match="latent_shape"):
        a.pipeline_sigmas(4, 32, 32)
    a.latent_shape(32, 32, 9)
    assert a.schedule_mu() == pytest.approx(calculate_shift(5 * 16 * 16, 1024, 4096, 0.95, 2.05))
    assert a.pipeline_sigmas(4, 32, 32)[1] > parts["adapter"].pipeline_sigmas(4, 32, 32)[1]


def test_decode_audio_shape_and_rate(parts):
    a = parts["adapter"]
    wave, rate = a.decode_audio(_latents(6))
    assert wave.dtype == torch.float32 and wave.ndim == 3 and wave.shape[:2] == (2, 2) and rate == 16000


def test_save_pretrained_loads_through_registry(parts, tmp_path):
    parts["pipe"].save_pretrained(str(tmp_path))
    loaded = build_adapter("ltx2", str(tmp_path), max_sequence_length=SEQ_LEN, min_tokenizer_size=MIN_TOK,
                           frame_rate=FPS)
    assert type(loaded) is type(parts["adapter"]) and loaded.video_text_dim == 16
    assert loaded.latent_shape(*SIZE) == parts["shape"]
    cond = loaded.encode(PROMPTS)
    assert torch.equal(cond.prompt_embeds, parts["cond"].prompt_embeds)
    x, s = _latents(5), torch.tensor([0.2, 0.9])
    with torch.no_grad():
        for g in (1.0, 4.0):
            assert torch.equal(loaded.velocity(x, s, cond, g), parts["adapter"].velocity(x, s, parts["cond"], g))
        assert torch.equal(loaded.decode_audio(x)[0], parts["adapter"].decode_audio(x)[0])
    with pytest.raises(ValueError):
        build_adapter("ltx2", str(tmp_path), task="i2v")


def test_sampler_option_defaults_are_the_pipelines():
    """The adapter's (and its loader's) defaults for the ``sampler`` keys it reads are ``LTX2Pipeline.__call__``'s
    (audio guidance 7.0, rescale 0.7 / 0.7, frame rate 24), so a config that sets none samples as the pipeline."""
    import inspect

    from diffusers import LTX2Pipeline

    from flowforge.models.ltx2.adapter import LTX2Adapter, load_ltx2

    call = inspect.signature(LTX2Pipeline.__call__).parameters
    assert LTX2Adapter.sampler_options == ("audio_guidance_scale", "guidance_rescale", "audio_guidance_rescale",
                                           "frame_rate")
    for fn in (LTX2Adapter.__init__, load_ltx2):
        params = inspect.signature(fn).parameters
        assert {k: params[k].default for k in LTX2Adapter.sampler_options} == {
            k: call[k].default for k in LTX2Adapter.sampler_options} == {
            "audio_guidance_scale": 7.0, "guidance_rescale": 0.7, "audio_guidance_rescale": 0.7, "frame_rate": 24.0}
