"""The Qwen-Image family's spec (:class:`flowforge.models.family.Family`): Qwen-Image (t2i) and Qwen-Image-Edit /
Edit-Plus (i2i)."""

from __future__ import annotations

import torch
from torch import Tensor

from flowforge.models.base import Conditioning
from flowforge.models.family import Family, Probe, Randn


def probe_inputs(config, randn: Randn) -> tuple[Tensor, Conditioning]:
    """Unpacked latents ``x [2, in_channels / 4, 4, 4]`` and 8 seeded Qwen2.5-VL tokens (all valid)."""
    x = randn(2, int(config.in_channels) // 4, 4, 4)
    return x, Conditioning(prompt_embeds=randn(2, 8, int(config.joint_attention_dim)),
                           mask=torch.ones(2, 8, dtype=torch.long))


FAMILY = Family(
    name="qwen_image", adapter="flowforge.models.qwen_image.adapter:QwenImageAdapter",
    loader="flowforge.models.qwen_image.adapter:load_qwen_image", tasks=("t2i", "i2i"), default_task="t2i",
    context_parallel=True, packed_latents=True, transformer="QwenImageTransformer2DModel",
    export_pipeline="QwenImagePipeline", probe=Probe(probe_inputs))
