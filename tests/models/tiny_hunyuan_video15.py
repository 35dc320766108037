"""Tiny random-init components of the HunyuanVideo 1.5 pipelines (t2v and i2v), built from configs (never
downloaded). The sizes follow diffusers' own fast test of ``HunyuanVideo15Pipeline`` (VAE 4x spatial / 2x temporal,
4 latent channels); the Qwen2.5-VL text model has 3 layers (the pipeline reads ``hidden_states[-3]``), the Qwen
tokenizer is the word-level :func:`chat_tokenizer`, ByT5's tokenizer is the real byte-level one."""
from __future__ import annotations

import torch

from tests.models import tiny_image_families as tiny_image

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "{% if m['role'] == 'system' %}" + " the" * 10 + "{% endif %}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""tiny_image_families' Qwen-style template with 10 words after the system message, so that the pipeline's system
message and user header are 108 word tokens, the real ``prompt_template_encode_start_idx``: the pipeline's crop
then keeps exactly the user prompt and what follows it, as with the real Qwen2.5 tokenizer."""


def chat_tokenizer():
    tok = tiny_image.chat_tokenizer(2048)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def components(seed: int = 0, *, i2v: bool = False, guidance_scale: float = 1.0, shift: float = 7.0) -> dict:
    """The keyword arguments of ``HunyuanVideo15Pipeline`` (``i2v=True``: ``HunyuanVideo15ImageToVideoPipeline``,
    with a SigLIP image encoder of 16 tokens x 12 and its 16x16 processor); the guider's ``guidance_scale`` is the
    pipeline's CFG scale."""
    from diffusers import AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Transformer3DModel
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16, text_embed_2_dim=32,
        image_embed_dim=12, rope_axes_dim=(2, 2, 4), target_size=16, task_type="i2v" if i2v else "t2v").eval()
    vae = AutoencoderKLHunyuanVideo15(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 16), layers_per_block=1,
        spatial_compression_ratio=4, temporal_compression_ratio=2, downsample_match_channel=False,
        upsample_match_channel=False).eval()
    tokenizer = chat_tokenizer()
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=16, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=2, rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
        rope_theta=1000000.0, max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)).eval()
    tokenizer_2 = ByT5Tokenizer()
    text_encoder_2 = T5EncoderModel(T5Config(vocab_size=len(tokenizer_2), d_model=32, d_kv=8, d_ff=32, num_layers=1,
                                             num_heads=2, feed_forward_proj="gated-gelu")).eval()
    parts = dict(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
                 text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2,
                 tokenizer_2=tokenizer_2, guider=ClassifierFreeGuidance(guidance_scale=guidance_scale))
    if i2v:
        from transformers import SiglipImageProcessorPil, SiglipVisionConfig, SiglipVisionModel

        parts["image_encoder"] = SiglipVisionModel(SiglipVisionConfig(
            hidden_size=12, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, image_size=16,
            patch_size=4)).eval()
        parts["feature_extractor"] = SiglipImageProcessorPil(size={"height": 16, "width": 16})
    return parts
