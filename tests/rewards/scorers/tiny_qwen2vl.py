"""A tiny Qwen2-VL (processor files + config) and random HPSv3 weights, shared by the HPSv3 test and its
official-code recorder (:mod:`tests.rewards.scorers.record_hpsv3`).

The processor directory has the layout of ``Qwen/Qwen2-VL-7B-Instruct``'s: a byte-level BPE ``vocab.json`` /
``merges.txt`` with Qwen's special tokens, the Qwen2-VL chat template and a ``preprocessor_config.json``. The weights
are a pure function of the official state dict's key / shape list (recorded in ``data/hpsv3_official.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

GOLDEN = Path(__file__).parent / "data" / "hpsv3_official.json"

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
MERGES = ["Ġ t", "Ġ a", "h e", "i n", "r e", "o n", "Ġt he", "e r", "a t", "Ġ s", "e n", "o r"]
CHAT_TEMPLATE = (  # Qwen2-VL-7B-Instruct's chat_template.json
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)
MEAN = [0.48145466, 0.4578275, 0.40821073]
STD = [0.26862954, 0.26130258, 0.27577711]


def write_processor(directory: Path) -> int:
    """Write the tokenizer / image processor / chat template files; returns the vocabulary size (specials included,
    before HPSv3's ``<|Reward|>``)."""
    from tokenizers import pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for merge in MERGES:
        vocab["".join(merge.split())] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(MERGES) + "\n")
    added = {str(len(vocab) + i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                                   "single_word": False, "special": True} for i, token in enumerate(SPECIALS)}
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": added, "additional_special_tokens": SPECIALS[1:], "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace",
        "model_max_length": 32768, "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
        "clean_up_tokenization_spaces": False, "processor_class": "Qwen2VLProcessor",
    }))
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    (directory / "preprocessor_config.json").write_text(json.dumps({
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": MEAN,
        "image_std": STD, "image_processor_type": "Qwen2VLImageProcessor", "max_pixels": 12845056,
        "merge_size": 2, "min_pixels": 3136, "patch_size": 14, "processor_class": "Qwen2VLProcessor",
        "resample": 3, "rescale_factor": 0.00392156862745098, "temporal_patch_size": 2,
    }))
    return len(vocab) + len(SPECIALS)


def config_dict(vocab_size: int) -> dict:
    """A Qwen2-VL ``config.json`` (transformers 4.45 layout, as the released one) at a tiny size; ``vocab_size``
    includes the specials (the token ids below follow :data:`SPECIALS`' order after the BPE vocabulary)."""
    first_special = vocab_size - len(SPECIALS)
    ids = {token: first_special + i for i, token in enumerate(SPECIALS)}
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "hidden_act": "silu",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 4096, "max_window_layers": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "sliding_window": 4096, "use_sliding_window": False, "tie_word_embeddings": False, "torch_dtype": "float32",
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True, "vocab_size": vocab_size,
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": first_special + len(SPECIALS), "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_config": {"depth": 2, "embed_dim": 32, "mlp_ratio": 2, "num_heads": 2, "in_chans": 3,
                          "hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    }


def fill_state(keys_shapes: list[tuple[str, list[int]]], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 tensors for ``keys_shapes`` in order: ``N(0, 0.05^2)`` (``N(0, 1 / fan_in)`` for the reward
    head), 1-D ``weight`` keys (norms) ``1 + N(0, 0.1^2)``."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for key, shape in keys_shapes:
        value = torch.randn(*shape, generator=generator)
        if key.startswith("rm_head.") and key.endswith("weight"):
            value = value / shape[1] ** 0.5
        elif len(shape) == 1 and key.endswith("weight"):
            value = 1.0 + 0.1 * value
        else:
            value = 0.05 * value
        state[key] = value
    return state


def smooth_image(height: int, width: int, seed: int) -> torch.Tensor:
    """``[H, W, 3]`` uint8 smooth random image."""
    from tests.rewards.scorers.tiny_image_reward import smooth_image as smooth

    return smooth(height, width, seed)


CASES = [  # (prompt, height, width, image seed); 448 x 448 needs no resize at HPSv3's 256 * 28 * 28 pixels
    ("a photo of the red cat on a sofa", 448, 448, 1),
    ("the handwritten seven", 448, 448, 2),
    ("two dogs in the snow, oil painting", 300, 500, 3),
]
