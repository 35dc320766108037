"""The FLUX.1 family's spec (:class:`flowforge.models.family.Family`): FLUX.1 [dev] / [schnell] (t2i) and FLUX.1
Kontext (i2i)."""

from __future__ import annotations

from torch import Tensor

from flowforge.models.base import Conditioning
from flowforge.models.family import Family, Probe, Randn


def probe_inputs(config, randn: Randn) -> tuple[Tensor, Conditioning]:
    """Unpacked latents ``x [2, in_channels / 4, 4, 4]`` (2x2 packing) and seeded T5 / pooled CLIP features."""
    x = randn(2, int(config.in_channels) // 4, 4, 4)
    return x, Conditioning(prompt_embeds=randn(2, 8, int(config.joint_attention_dim)),
                           pooled=randn(2, int(config.pooled_projection_dim)))


FAMILY = Family(
    name="flux", adapter="flowforge.models.flux.adapter:FluxAdapter", loader="flowforge.models.flux.adapter:load_flux",
    tasks=("t2i", "i2i"), default_task="t2i", context_parallel=True, packed_latents=True,
    transformer="FluxTransformer2DModel", export_pipeline="FluxPipeline", probe=Probe(probe_inputs))
