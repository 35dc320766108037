"""The Wan family's spec (:class:`flowforge.models.family.Family`): Wan 2.1 / 2.2 T2V, I2V (CLIP image tokens),
TI2V and the two-expert A14B."""

from __future__ import annotations

from torch import Tensor, nn

from flowforge.models.base import Conditioning, FlowModel
from flowforge.models.family import Family, Probe, Randn


def probe_inputs(config, randn: Randn) -> tuple[Tensor, Conditioning]:
    """``x [2, C, 2, 2 ph, 2 pw]`` (H / W multiples of the patch) and seeded UMT5 (and CLIP image) features."""
    _, ph, pw = config.patch_size
    x = randn(2, int(config.in_channels), 2, 2 * ph, 2 * pw)
    image_dim = config.image_dim
    # With CLIP image tokens diffusers' Wan attention takes the last 512 context tokens as text (the length the Wan
    # pipelines pad to), so an image-conditioned transformer gets 512 text tokens here.
    text_len = 8 if image_dim is None else 512
    return x, Conditioning(prompt_embeds=randn(2, text_len, int(config.text_dim)),
                           pooled=None if image_dim is None else randn(2, 4 * int(image_dim)))


def probe_adapter(cls: type, transformer: nn.Module) -> FlowModel:
    """The task follows the transformer: i2v when it reads condition channels (``in_channels != out_channels``)."""
    cfg = transformer.config
    return cls(transformer, task="i2v" if cfg.in_channels != cfg.out_channels else "t2v")


FAMILY = Family(
    # the tasks are a checkpoint's (WanAdapter.tasks is per instance: T2V t2v, I2V i2v, TI2V both): the family
    # runs their union, and the loader picks the default from the checkpoint
    name="wan", adapter="flowforge.models.wan.adapter:WanAdapter", loader="flowforge.models.wan.adapter:load_wan",
    tasks=("t2v", "i2v"), context_parallel=True, transformer="WanTransformer3DModel", export_pipeline="WanPipeline",
    probe=Probe(probe_inputs, probe_adapter))
