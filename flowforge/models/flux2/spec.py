"""The FLUX.2 family's spec (:class:`flowforge.models.family.Family`): FLUX.2 [dev] and Klein, text or reference
images (i2i)."""

from __future__ import annotations

from torch import Tensor

from flowforge.models.base import Conditioning
from flowforge.models.family import Family, Probe, Randn


def probe_inputs(config, randn: Randn) -> tuple[Tensor, Conditioning]:
    """Patchified latents ``x [2, in_channels, 4, 4]`` and seeded text features."""
    x = randn(2, int(config.in_channels), 4, 4)
    return x, Conditioning(prompt_embeds=randn(2, 8, int(config.joint_attention_dim)))


FAMILY = Family(
    name="flux2", adapter="flowforge.models.flux2.adapter:Flux2Adapter",
    loader="flowforge.models.flux2.adapter:load_flux2", tasks=("t2i", "i2i"), default_task="t2i",
    context_parallel=True, packed_latents=True, transformer="Flux2Transformer2DModel", export_pipeline="Flux2Pipeline",
    probe=Probe(probe_inputs))
