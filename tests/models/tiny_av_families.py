"""Tiny random-init components of the LTX-2 audio-video pipeline (diffusers ``LTX2Pipeline``), built from configs
(never downloaded): the transformer, connectors, video VAE, audio VAE and vocoder sizes of diffusers' own LTX-2
fast tests, a two-layer ``Gemma3ForConditionalGeneration`` over the word tokenizer of
:mod:`tests.models.tiny_families`. Every builder seeds torch."""
from __future__ import annotations

import torch

from tests.models import tiny_families as tiny

GEMMA_HIDDEN = 16
GEMMA_LAYERS = 2


def gemma3_text_encoder(tokenizer):
    """A tiny ``Gemma3ForConditionalGeneration`` (LTX-2's text encoder class; the pipeline stacks every hidden
    state, so the connectors' ``text_proj_in_factor`` is ``layers + 1``)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=GEMMA_HIDDEN, intermediate_size=32,
                            num_hidden_layers=GEMMA_LAYERS, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=8, max_position_embeddings=256, sliding_window=16,
                            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id)
    vision = SiglipVisionConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                image_size=8, patch_size=4)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=tokenizer.unk_token_id)
    return Gemma3ForConditionalGeneration(config).eval()


def ltx2_components(seed: int = 0, *, equal_widths: bool = True) -> dict:
    """LTX-2 parts: video latents of 4 channels (VAE 2x spatial, 2x temporal-ish causal), audio latents of 2
    channels x 2 mel bins (packed width 4 = the video width, as LTX-2's 128 / 8 x 16); the audio VAE's latent mean
    / std are set to non-trivial values so normalisation is exercised."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    tokenizer = tiny.word_tokenizer(64, bos=True, eos=False)
    torch.manual_seed(seed)
    text_encoder = gemma3_text_encoder(tokenizer)
    torch.manual_seed(seed)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads",
        caption_channels=GEMMA_HIDDEN, rope_double_precision=False, rope_type="split",
    ).eval()
    torch.manual_seed(seed)
    connectors = LTX2TextConnectors(
        caption_channels=GEMMA_HIDDEN, text_proj_in_factor=GEMMA_LAYERS + 1, video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_theta=10000.0,
        rope_double_precision=False, causal_temporal_positioning=False, rope_type="split",
    ).eval()
    torch.manual_seed(seed)
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
        layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
        upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False, patch_size=1, patch_size_t=1,
        encoder_causal=True, decoder_causal=False,
    ).eval()
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    torch.manual_seed(seed)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8,
    ).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        audio_vae.latents_mean.copy_(0.1 * torch.randn(audio_vae.latents_mean.shape, generator=g))
        audio_vae.latents_std.copy_(0.5 + torch.rand(audio_vae.latents_std.shape, generator=g))
    torch.manual_seed(seed)
    vocoder = LTX2Vocoder(
        in_channels=audio_vae.config.output_channels * audio_vae.config.mel_bins, hidden_channels=32,
        out_channels=2, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2], resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]], leaky_relu_negative_slope=0.1, output_sampling_rate=16000,
    ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_image_seq_len=1024,
                                                max_image_seq_len=4096, base_shift=0.95, max_shift=2.05,
                                                shift_terminal=0.1)
    return dict(transformer=transformer, vae=vae, audio_vae=audio_vae, scheduler=scheduler,
                text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors, vocoder=vocoder)
