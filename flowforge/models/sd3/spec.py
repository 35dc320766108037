"""The SD3 family's spec (:class:`flowforge.models.family.Family`): Stable Diffusion 3 / 3.5 and the demo's tiny
MiniLM-conditioned transformer."""

from __future__ import annotations

from torch import Tensor

from flowforge.models.base import Conditioning
from flowforge.models.family import Family, Probe, Randn


def probe_inputs(config, randn: Randn) -> tuple[Tensor, Conditioning]:
    """``x [2, C, side, side]`` (at most 16 patches a side) and seeded T5 / pooled CLIP features."""
    patch = int(config.patch_size)
    cells = min(int(config.pos_embed_max_size or 16), int(config.sample_size) // patch, 16)
    side = max(cells, 1) * patch
    x = randn(2, int(config.in_channels), side, side)
    return x, Conditioning(prompt_embeds=randn(2, 8, int(config.joint_attention_dim)),
                           pooled=randn(2, int(config.pooled_projection_dim)))


FAMILY = Family(
    name="sd3", adapter="flowforge.models.sd3.adapter:SD3Adapter", loader="flowforge.models.sd3.adapter:load_sd3",
    tasks=("t2i",), default_task="t2i", transformer="SD3Transformer2DModel",
    export_pipeline="StableDiffusion3Pipeline", probe=Probe(probe_inputs))
