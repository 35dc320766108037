"""Tiny random-init CLIP models built offline for the CLIP-tower scorer tests (no download, no torchvision).

Every model is a tiny ``CLIPModel`` from a ``CLIPConfig`` with a CLIP BPE tokenizer written from scratch (byte
alphabet + ``</w>`` forms, two merges), saved with ``save_pretrained`` and loaded back through the scorers.
"""

from __future__ import annotations

import json
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)

IMAGE_SIZE = 32
TEXT_WINDOW = 16
PROJECTION = 16
MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)

PROMPTS = ["a cat", "a handwritten seven", "a cat", "two dogs on a red sofa"]
META = [{}] * 4


def write_tokenizer_files(directory) -> None:
    from tokenizers import pre_tokenizers

    vocab: dict[str, int] = {}
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    for symbol in alphabet:
        vocab[symbol] = len(vocab)
    for symbol in alphabet:
        vocab[symbol + "</w>"] = len(vocab)
    for token in ("ca", "cat</w>", "<|startoftext|>", "<|endoftext|>"):
        vocab[token] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\nc a\nca t</w>\n")


def build_clip_dirs(root):
    """``(model_dir, processor_dir)`` of a tiny CLIP under ``root``; the processor dir holds a tokenizer and an
    image processor."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPTokenizer

    model_dir, processor_dir = root / "model", root / "processor"
    processor_dir.mkdir()
    write_tokenizer_files(processor_dir)
    tokenizer = CLIPTokenizer.from_pretrained(str(processor_dir))
    assert len(tokenizer) == 516 and tokenizer.eos_token_id == 515
    tokenizer.save_pretrained(str(processor_dir))
    CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                       image_mean=list(MEAN), image_std=list(STD)).save_pretrained(str(processor_dir))
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=TEXT_WINDOW,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=IMAGE_SIZE, patch_size=8),
        projection_dim=PROJECTION,
        logit_scale_init_value=4.6052,  # exp = 100, as the released checkpoints
    )
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(str(model_dir))
    return model_dir, processor_dir


def random_media(batch: int, height: int = IMAGE_SIZE, width: int = IMAGE_SIZE, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 3, height, width, generator=generator)


def direct_clip(model_dir, processor_dir, media, prompts):
    """``(logits_per_image diagonal, image_embeds, text_embeds)`` from CLIPModel.forward, pixels normalised by hand."""
    from transformers import AutoTokenizer, CLIPModel

    model = CLIPModel.from_pretrained(str(model_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(processor_dir))
    tokens = tokenizer(list(prompts), padding=True, truncation=True, max_length=TEXT_WINDOW, return_tensors="pt")
    pixels = (media - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    with torch.no_grad():
        out = model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"], pixel_values=pixels)
    return out.logits_per_image.diagonal(), out.image_embeds, out.text_embeds, model
