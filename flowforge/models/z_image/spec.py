"""The Z-Image family's spec (:class:`flowforge.models.family.Family`)."""

from __future__ import annotations

import torch
from torch import Tensor

from flowforge.models.base import Conditioning
from flowforge.models.family import Family, Probe, Randn


def probe_inputs(config, randn: Randn) -> tuple[Tensor, Conditioning]:
    """``x [2, C, 4, 4]`` (H / W multiples of the patch, 2) and 8 seeded caption tokens (all valid)."""
    x = randn(2, int(config.in_channels), 4, 4)
    return x, Conditioning(prompt_embeds=randn(2, 8, int(config.cap_feat_dim)),
                           mask=torch.ones(2, 8, dtype=torch.long))


FAMILY = Family(
    name="z_image", adapter="flowforge.models.z_image.adapter:ZImageAdapter",
    loader="flowforge.models.z_image.adapter:load_z_image", tasks=("t2i",), default_task="t2i",
    transformer="ZImageTransformer2DModel", export_pipeline="ZImagePipeline", probe=Probe(probe_inputs))
