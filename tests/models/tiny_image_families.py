"""Tiny random-init components of the Z-Image, FLUX.2 and Qwen-Image-Edit-Plus pipelines, built from configs (never
downloaded). Tokenizers are :func:`tests.models.tiny_families.word_tokenizer`; every builder seeds torch."""
from __future__ import annotations

import torch

from tests.models import tiny_families as tiny

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""A Qwen-style chat template over the word tokenizer's vocabulary (every token of it is a word of the vocab)."""


def chat_tokenizer(model_max_length: int = 1024):
    tok = tiny.word_tokenizer(model_max_length, eos=False, pad="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def qwen3_text_encoder(tokenizer, hidden: int = 16, layers: int = 2):
    """A tiny ``Qwen3Model`` (Z-Image's text encoder class; ``hidden_states[-2]`` needs >= 2 layers)."""
    from transformers import Qwen3Config, Qwen3Model

    return Qwen3Model(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)).eval()


def image_vae(latent_channels: int = 4):
    """``AutoencoderKL`` with 2x spatial downsampling and FLUX-like scaling / shift."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=latent_channels, norm_num_groups=4, sample_size=16, scaling_factor=0.3611,
        shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
    ).eval()


def z_image_components(seed: int = 0, *, dynamic: bool = False) -> dict:
    """Z-Image parts. The scheduler is Z-Image-Turbo's kind (static ``shift=3``); ``dynamic=True`` a
    dynamic-shift config (so both branches of the pipeline's ``mu`` handling are exercised)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel

    torch.manual_seed(seed)
    transformer = ZImageTransformer2DModel(
        in_channels=4, dim=32, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=16,
        axes_dims=[4, 6, 6], axes_lens=[1024, 32, 32],
    ).eval()
    tokenizer = chat_tokenizer()
    text_encoder = qwen3_text_encoder(tokenizer)
    vae = image_vae()
    if dynamic:
        scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_image_seq_len=256,
                                                    max_image_seq_len=4096, base_shift=0.5, max_shift=1.15)
    else:
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    return dict(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                scheduler=scheduler)


def flux2_klein_components(seed: int = 0, *, is_distilled: bool = False) -> dict:
    """FLUX.2 Klein parts: a Qwen3ForCausalLM with 28 layers (the pipeline stacks hidden states 9, 18, 27), a
    ``Flux2Transformer2DModel`` without guidance embedding, an ``AutoencoderKLFlux2`` whose latent batch-norm
    statistics are set away from 0 / 1 (so the decode's de-normalisation is exercised) and Klein's dynamic-shift
    scheduler."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    tokenizer = chat_tokenizer()
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=8, intermediate_size=16, num_hidden_layers=28, num_attention_heads=2,
        num_key_value_heads=1, head_dim=4, max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False)).eval()
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=24, timestep_guidance_channels=16, axes_dims_rope=(2, 2, 2, 2),
        guidance_embeds=False).eval()
    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1, latent_channels=4,
        norm_num_groups=4, sample_size=16, use_quant_conv=False, use_post_quant_conv=False).eval()
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.linspace(-0.3, 0.3, vae.bn.running_mean.numel()))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, vae.bn.running_var.numel()))
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0)
    return dict(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                scheduler=scheduler, is_distilled=is_distilled)


def qwen_edit_plus_components(seed: int = 0, *, zero_cond_t: bool = True) -> dict:
    """Qwen-Image-Edit-Plus parts (``QwenImageEditPlusPipeline``): the tiny Qwen-Image-Edit parts
    (:func:`tests.models.tiny_families.qwen_components` with ``edit=True``: Qwen2.5-VL with a vision tower and a
    processor) with a transformer that sets ``zero_cond_t`` as Qwen-Image-Edit-2511's does (``False``: Edit-2509's)."""
    from diffusers import QwenImageTransformer2DModel

    parts = tiny.qwen_components(seed, edit=True)
    torch.manual_seed(seed + 1)
    parts["transformer"] = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, axes_dims_rope=(2, 2, 4), zero_cond_t=zero_cond_t).eval()
    return parts


MISTRAL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}{% if c['type'] == 'text' %}"
    "{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}")
"""A chat template over the word vocabulary for FLUX.2 [dev]'s ``format_input`` messages (content lists of parts)."""


def flux2_dev_components(seed: int = 0) -> dict:
    """FLUX.2 [dev] parts: a ``Mistral3ForConditionalGeneration`` with a 31-layer language model (the pipeline stacks
    hidden states 10, 20, 30) and a 1-layer Pixtral tower, a word tokenizer with a content-list chat template in
    place of the Pixtral processor (the pipeline only calls its ``apply_chat_template``), a guidance-embedding
    ``Flux2Transformer2DModel`` and the Klein VAE / scheduler."""
    from diffusers import Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    parts = flux2_klein_components(seed)
    parts.pop("is_distilled")
    torch.manual_seed(seed + 1)
    tokenizer = tiny.word_tokenizer(1024, eos=False, pad="<|endoftext|>")
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    config = Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=8, intermediate_size=16,
                         num_hidden_layers=31, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                         max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(model_type="pixtral", hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=4, image_size=16, patch_size=4),
        image_token_index=1, spatial_merge_size=1)
    parts["text_encoder"] = Mistral3ForConditionalGeneration(config).eval()
    parts["tokenizer"] = tokenizer
    parts["transformer"] = Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=24, timestep_guidance_channels=16, axes_dims_rope=(2, 2, 2, 2),
        guidance_embeds=True).eval()
    return parts
