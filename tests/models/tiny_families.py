"""Tiny random-init components of the FLUX, Qwen-Image and Wan pipelines, built from configs (never downloaded).

Tokenizers are word-level ``tokenizers`` models over a fixed vocabulary, wrapped in ``PreTrainedTokenizerFast``, so
they save / load with ``save_pretrained`` like the real ones. Every builder seeds torch so a component is the same
on every call.
"""
from __future__ import annotations

import torch
from transformers import Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin

WORDS = (
    "a an the of and to in on with by at for from is are this that it its photo picture image video drawing "
    "cat dog bird fish horse house car tree flower sky sea river mountain city street road boat train plane "
    "red green blue yellow black white orange purple pink brown gray small big large tiny old new happy sad "
    "one two three four five six seven eight nine ten handwritten number digit written neatly sitting running "
    "system user assistant describe detailing color shape size texture quantity text spatial relationships "
    "objects background sunny day night man woman child playing eating walking under over near beside"
).split()
PUNCT = list(",.:;!?'\"()-")
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "\n"]


def word_tokenizer(model_max_length: int, *, bos: bool = False, eos: bool = True, pad: str = "<pad>",
                   lowercase: bool = True, extra_specials: tuple[str, ...] = (), extra_words: tuple[str, ...] = ()):
    """A word-level fast tokenizer with optional ``<s>`` / ``</s>`` framing.

    Words and punctuation marks are tokens, spaces are dropped, a newline is a token of its own: Qwen-Image's chat
    template prefix (up to the user prompt) is then 34 tokens, the real ``prompt_template_encode_start_idx``.
    ``extra_specials`` (e.g. Qwen2-VL's vision tokens) get ids after every other token and are never split;
    ``extra_words`` (e.g. ``yes``, ``no`` for a VQA score) get ids after the punctuation.
    """
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(WORDS) + PUNCT + list(extra_words) + list(extra_specials))}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase() if lowercase else None
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
        pre_tokenizers.Split("\n", behavior="isolated"),
        pre_tokenizers.Punctuation(),
    ])
    single = " ".join((["<s>"] if bos else []) + ["$A"] + (["</s>"] if eos else []))
    specials = [(t, vocab[t]) for t in ("<s>", "</s>") if t in single]
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=model_max_length, pad_token=pad,
                                   unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *extra_specials]})
    return fast


def vocab_size() -> int:
    return len(SPECIALS) + len(WORDS) + len(PUNCT)


# ---------------------------------------------------------------------------------------------- FLUX

def flux_components(seed: int = 0, guidance_embeds: bool = True) -> dict:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=guidance_embeds,
        axes_dims_rope=(2, 2, 4),
    )
    tokenizer = word_tokenizer(12, bos=True, eos=True)
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=vocab_size(), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=12, projection_dim=16, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, hidden_act="gelu",
    ))
    tokenizer_2 = word_tokenizer(512, eos=True)
    t5 = T5EncoderModel(T5Config(
        vocab_size=vocab_size(), d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=tokenizer_2.pad_token_id,
        eos_token_id=tokenizer_2.eos_token_id, decoder_start_token_id=0,
    ))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=16, scaling_factor=1.5035, shift_factor=0.0609,
        use_quant_conv=False, use_post_quant_conv=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256,
                                                max_image_seq_len=4096, base_shift=0.5, max_shift=1.15)
    return dict(transformer=transformer.eval(), vae=vae.eval(), text_encoder=clip.eval(), tokenizer=tokenizer,
                text_encoder_2=t5.eval(), tokenizer_2=tokenizer_2, scheduler=scheduler)


# ---------------------------------------------------------------------------------------------- Qwen-Image

QWEN_LATENTS_MEAN = [0.1, -0.2, 0.3, -0.4]
QWEN_LATENTS_STD = [1.5, 0.5, 2.0, 1.0]


QWEN_VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
"""Qwen2-VL's vision special tokens (the Edit template's image placeholder; ``<|video_pad|>`` because
``Qwen2VLProcessor`` counts it)."""
QWEN_VL_PATCH = 4
"""Vision patch size of the tiny Qwen2.5-VL (merge size 1): a 16x16 condition image is 4x4 = 16 image tokens."""


class TinyQwen2VLProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` without the video processor.

    transformers 5.x's ``ProcessorMixin`` type-checks every sub-processor, and the video one
    (``VideoProcessorMixin``) is only exported with torchvision, which this environment lacks: the stock class cannot
    be built here, not even with ``video_processor=None``. This subclass only drops that argument; the text / image
    processing (``__call__``, ``replace_image_token``: one ``<|image_pad|>`` per merged patch) is
    ``Qwen2VLProcessor``'s own. It saves with ``save_pretrained`` and loads with ``from_pretrained`` (diffusers
    records ``tests.models.tiny_families`` / ``TinyQwen2VLProcessor`` in model_index.json).
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def qwen_components(seed: int = 0, *, edit: bool = False) -> dict:
    """Qwen-Image parts. ``edit=True``: Qwen-Image-Edit parts (``QwenImageEditPipeline``): the tokenizer also has
    the vision tokens, the Qwen2.5-VL knows their ids (``image_token_id`` ...) and a ``processor`` is added
    (:class:`TinyQwen2VLProcessor` around the PIL ``Qwen2VLImageProcessorPil``: patch 4, merge 1, no temporal
    repeat, min 16 / max 4096 pixels, so a 16x16 image is not resized and gives 16 image tokens)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, axes_dims_rope=(2, 2, 4),
    )
    tokenizer = word_tokenizer(1024 + 64, eos=False, pad="<|endoftext|>",
                               extra_specials=QWEN_VISION_TOKENS if edit else ())
    vocab = len(tokenizer) if edit else vocab_size() + 2
    vision_ids = {}
    if edit:
        ids = tokenizer.convert_tokens_to_ids(list(QWEN_VISION_TOKENS))
        vision_ids = dict(vision_start_token_id=ids[0], image_token_id=ids[1], vision_end_token_id=ids[2],
                          video_token_id=ids[3])
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, rope_theta=10000.0,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16,
                           in_channels=3, patch_size=QWEN_VL_PATCH if edit else 2, spatial_merge_size=1,
                           temporal_patch_size=1, fullatt_block_indexes=[0], window_size=8 if edit else 4),
        vocab_size=vocab, hidden_size=16, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **vision_ids,
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False],
                                 latents_mean=QWEN_LATENTS_MEAN, latents_std=QWEN_LATENTS_STD)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_image_seq_len=256,
                                                max_image_seq_len=8192, base_shift=0.5, max_shift=0.9)
    parts = dict(transformer=transformer.eval(), vae=vae.eval(), text_encoder=text_encoder.eval(),
                 tokenizer=tokenizer, scheduler=scheduler)
    if edit:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        image_processor = Qwen2VLImageProcessorPil(size={"shortest_edge": 16, "longest_edge": 64 * 64},
                                                   patch_size=QWEN_VL_PATCH, temporal_patch_size=1, merge_size=1)
        parts["processor"] = TinyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer)
    return parts


# ---------------------------------------------------------------------------------------------- Wan

WAN_LATENTS_MEAN = [0.2, -0.1, 0.05, -0.3]
WAN_LATENTS_STD = [1.2, 0.8, 2.0, 1.5]


def wan_components(seed: int = 0, *, i2v: bool = False) -> dict:
    """Wan t2v parts; ``i2v=True`` gives a Wan2.1-I2V-style transformer (``in_channels = 2 z + 4``)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    z = 4
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=2 * z + 4 if i2v else z,
        out_channels=z, text_dim=32, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32,
    )
    tokenizer = word_tokenizer(512, eos=True)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=vocab_size(), d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=0,
    ))
    vae = AutoencoderKLWan(base_dim=4, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=WAN_LATENTS_MEAN,
                           latents_std=WAN_LATENTS_STD)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    return dict(transformer=transformer.eval(), vae=vae.eval(), text_encoder=text_encoder.eval(),
                tokenizer=tokenizer, scheduler=scheduler)
