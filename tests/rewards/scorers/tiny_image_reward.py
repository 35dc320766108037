"""Tiny random ImageReward checkpoints shared by the ImageReward test and its official-code recorder.

The weights are a pure function of the key / shape list of the official ``ImageReward`` state dict (recorded in
``data/image_reward_official.json`` by :mod:`tests.rewards.scorers.record_image_reward`): both the recorder (which
builds the official BLIP modules) and the test (which loads them into flowforge's scorer) fill the same keys with the
same numbers, so the official score and flowforge's can be compared without storing the weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

GOLDEN = Path(__file__).parent / "data" / "image_reward_official.json"

IMAGE_SIZE, PATCH, VISION_WIDTH, VISION_DEPTH, VISION_HEADS = 32, 8, 128, 2, 2  # head dim 64 as BLIP's ViT-B / L
TEXT_LENGTH = 35  # the official tokenizer call: padding="max_length", truncation=True, max_length=35

WORDS = ["a", "cat", "dog", "on", "the", "red", "blue", "sofa", "two", "handwritten", "seven", "photo", "of",
         "painting", "in", "style", "##s", ",", "."]
MED_CONFIG = {  # BLIP's med_config.json at a tiny size (the released one: hidden 768, 12 layers, vocab 30524)
    "architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1, "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
    "layer_norm_eps": 1e-12, "max_position_embeddings": 40, "model_type": "bert", "num_attention_heads": 2,
    "num_hidden_layers": 2, "pad_token_id": 0, "type_vocab_size": 2, "vocab_size": 5 + len(WORDS) + 2,
    "encoder_width": VISION_WIDTH, "add_cross_attention": True,
}


def write_tokenizer(directory: Path) -> None:
    """A bert-base-uncased style ``vocab.txt`` (specials + :data:`WORDS`) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")


def write_med_config(path: Path) -> None:
    path.write_text(json.dumps(MED_CONFIG, indent=1))


def fill_state(keys_shapes: list[tuple[str, list[int]]], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 tensors for ``keys_shapes``, in order: ``N(0, 0.2^2)``, LayerNorm-like 1-D ``weight`` keys
    ``1 + N(0, 0.2^2)`` (keeps activations from collapsing), the MLP head ``N(0, 1 / fan_in)`` so scores spread."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for key, shape in keys_shapes:
        value = torch.randn(*shape, generator=generator)
        if key.startswith("mlp.") and key.endswith("weight"):
            value = value / shape[1] ** 0.5
        elif len(shape) == 1 and key.endswith("weight"):
            value = 1.0 + 0.2 * value
        else:
            value = 0.2 * value
        state[key] = value
    return state


def smooth_image(height: int, width: int, seed: int) -> torch.Tensor:
    """``[H, W, 3]`` uint8 smooth random image (bilinear upsampling of a 5 x 6 random grid)."""
    generator = torch.Generator().manual_seed(seed)
    grid = torch.rand(1, 3, 5, 6, generator=generator)
    image = F.interpolate(grid, size=(height, width), mode="bilinear", align_corners=True)[0]
    return (image * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).contiguous()


CASES = [  # (prompt, height, width, image seed): exact size, truncated prompt, torchvision's crop rounding, resize
    ("a photo of a red cat on the sofa", 32, 32, 1),
    ("two dogs , " * 14 + "a cat", 32, 32, 2),
    ("a handwritten seven", 32, 35, 3),
    ("a painting of two blue dogs in the style of a cat", 40, 56, 4),
    ("a photo of a red cat on the sofa", 45, 33, 5),
]
