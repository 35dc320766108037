"""The HunyuanVideo 1.5 family's spec (:class:`flowforge.models.family.Family`): t2v and i2v."""

from __future__ import annotations

import torch
from torch import Tensor

from flowforge.models.base import Conditioning
from flowforge.models.family import Family, Probe, Randn

GLYPH_LENGTH = 256
"""ByT5 tokens per prompt (``HunyuanVideo15Pipeline.tokenizer_2_max_length``), of its quoted glyph text."""


def probe_inputs(config, randn: Randn) -> tuple[Tensor, Conditioning]:
    """t2v latents ``x [2, z, 2 pt, 2 p, 2 p]`` (the adapter appends the zero condition channels); text: 8 Qwen2.5-VL
    tokens then the :data:`GLYPH_LENGTH` ByT5 tokens, as wide as the wider of the two (the adapter's record
    layout)."""
    p, pt = int(config.patch_size), int(config.patch_size_t)
    x = randn(2, int(config.out_channels), 2 * pt, 2 * p, 2 * p)
    width = max(int(config.text_embed_dim), int(config.text_embed_2_dim))
    return x, Conditioning(prompt_embeds=randn(2, 8 + GLYPH_LENGTH, width),
                           mask=torch.ones(2, 8 + GLYPH_LENGTH, dtype=torch.long))


FAMILY = Family(
    # no HunyuanVideo 1.5 pipeline has a LoRA loader (diffusers 0.42): export_pipeline None
    name="hunyuan_video15", adapter="flowforge.models.hunyuan_video15.adapter:HunyuanVideo15Adapter",
    loader="flowforge.models.hunyuan_video15.adapter:load_hunyuan_video15", tasks=("t2v", "i2v"),
    transformer="HunyuanVideo15Transformer3DModel", probe=Probe(probe_inputs))
