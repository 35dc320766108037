"""The fixed inputs ``flowforge export --verify`` runs a diffusers family's transformer on, one entry per family.

:data:`PROBES` maps every registered diffusers family (``model.adapter``) to a :class:`Probe`: how to shape seeded
fp32 inputs ``(x [2, *latent], seeded conditioning)`` from the transformer's config, and how to drive a bare
transformer (no text encoder, no VAE) through the family's own adapter, so packing and timestep units are the
family's. ``sigma = [0.3, 0.8]`` and guidance 1 for all. A family registered in :data:`flowforge.models.ADAPTERS`
without its own file format needs an entry here (a test checks).

What the export writes for a family's LoRA (its diffusers pipeline, or none) is the adapter class's own
``export_pipeline`` (:class:`flowforge.models.base.AdapterMixin`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from flowforge.models import adapter_class
from flowforge.models.base import Conditioning, FlowModel

Randn = Callable[..., Tensor]
"""``randn(*shape) -> Tensor`` fp32 from the probe's seeded generator."""

SEED = 20240601
SIGMA = (0.3, 0.8)


@dataclass(frozen=True)
class Probe:
    """One family's verification inputs: ``inputs(config, randn) -> (x [2, *latent], cond)`` and, when the adapter
    class is not simply ``Class(transformer)`` around a bare transformer, ``adapter(family_class, transformer)``."""

    inputs: Callable[[object, Randn], tuple[Tensor, Conditioning]]
    adapter: Callable[[type, nn.Module], FlowModel] | None = None


def _sd3(config, randn: Randn) -> tuple[Tensor, Conditioning]:
    patch = int(config.patch_size)
    cells = min(int(config.pos_embed_max_size or 16), int(config.sample_size) // patch, 16)
    side = max(cells, 1) * patch
    x = randn(2, int(config.in_channels), side, side)
    return x, Conditioning(prompt_embeds=randn(2, 8, int(config.joint_attention_dim)),
                           pooled=randn(2, int(config.pooled_projection_dim)))


def _flux(config, randn: Randn) -> tuple[Tensor, Conditioning]:  # unpacked latents: in_channels = 4 C (2x2 packing)
    x = randn(2, int(config.in_channels) // 4, 4, 4)
    return x, Conditioning(prompt_embeds=randn(2, 8, int(config.joint_attention_dim)),
                           pooled=randn(2, int(config.pooled_projection_dim)))


def _qwen_image(config, randn: Randn) -> tuple[Tensor, Conditioning]:
    x = randn(2, int(config.in_channels) // 4, 4, 4)
    return x, Conditioning(prompt_embeds=randn(2, 8, int(config.joint_attention_dim)),
                           mask=torch.ones(2, 8, dtype=torch.long))


def _ltx2(config, randn: Randn) -> tuple[Tensor, Conditioning]:
    # the joint latent of a 9-frame 32x32 clip: 2 video tokens + 9 audio tokens (24 fps)
    x = randn(2, 2 + 9, int(config.in_channels))
    if config.use_prompt_embeddings:  # LTX-2.0: both streams read caption_channels-wide connector features
        width = 2 * int(config.caption_channels)
    else:
        width = (int(config.num_attention_heads) * int(config.attention_head_dim)
                 + int(config.audio_num_attention_heads) * int(config.audio_attention_head_dim))
    return x, Conditioning(prompt_embeds=randn(2, 8, width), mask=torch.ones(2, 8, dtype=torch.long))


def _ltx2_adapter(cls: type, transformer: nn.Module) -> FlowModel:
    # the probe compares the conditional velocity: no CFG (the pipeline default guides the audio at 7), no rescale
    ltx2 = cls(transformer, audio_guidance_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0)
    ltx2.latent_shape(32, 32, 9)  # the probe's geometry (no VAE: LTX-2's compression 32 / 8, 16 kHz audio)
    return ltx2


def _wan(config, randn: Randn) -> tuple[Tensor, Conditioning]:  # [B, C, F, H, W], H / W multiples of the patch
    _, ph, pw = config.patch_size
    x = randn(2, int(config.in_channels), 2, 2 * ph, 2 * pw)
    image_dim = config.image_dim
    # With CLIP image tokens diffusers' Wan attention takes the last 512 context tokens as text (the length the Wan
    # pipelines pad to), so an image-conditioned transformer gets 512 text tokens here.
    text_len = 8 if image_dim is None else 512
    return x, Conditioning(prompt_embeds=randn(2, text_len, int(config.text_dim)),
                           pooled=None if image_dim is None else randn(2, 4 * int(image_dim)))


def _wan_adapter(cls: type, transformer: nn.Module) -> FlowModel:
    cfg = transformer.config
    return cls(transformer, task="i2v" if cfg.in_channels != cfg.out_channels else "t2v")


def _flux2(config, randn: Randn) -> tuple[Tensor, Conditioning]:  # patchified latents [B, in_channels, h, w]
    x = randn(2, int(config.in_channels), 4, 4)
    return x, Conditioning(prompt_embeds=randn(2, 8, int(config.joint_attention_dim)))


def _z_image(config, randn: Randn) -> tuple[Tensor, Conditioning]:  # [B, C, H, W], H / W multiples of the patch (2)
    x = randn(2, int(config.in_channels), 4, 4)
    return x, Conditioning(prompt_embeds=randn(2, 8, int(config.cap_feat_dim)),
                           mask=torch.ones(2, 8, dtype=torch.long))


def _hunyuan_video15(config, randn: Randn) -> tuple[Tensor, Conditioning]:
    from flowforge.models.hunyuan_video15_text import GLYPH_LENGTH

    # t2v latents [B, z, F, H, W] (the adapter appends the zero condition channels); text: 8 Qwen2.5-VL tokens then
    # the GLYPH_LENGTH ByT5 tokens, as wide as the wider of the two (the adapter's record layout)
    p, pt = int(config.patch_size), int(config.patch_size_t)
    x = randn(2, int(config.out_channels), 2 * pt, 2 * p, 2 * p)
    width = max(int(config.text_embed_dim), int(config.text_embed_2_dim))
    return x, Conditioning(prompt_embeds=randn(2, 8 + GLYPH_LENGTH, width),
                           mask=torch.ones(2, 8 + GLYPH_LENGTH, dtype=torch.long))


PROBES: dict[str, Probe] = {
    "sd3": Probe(_sd3),
    "flux": Probe(_flux),
    "qwen_image": Probe(_qwen_image),
    "wan": Probe(_wan, _wan_adapter),
    "ltx2": Probe(_ltx2, _ltx2_adapter),
    "flux2": Probe(_flux2),
    "z_image": Probe(_z_image),
    "hunyuan_video15": Probe(_hunyuan_video15),
}
"""Registered diffusers family -> its verification probe; the keys are the families export writes diffusers files
for (:data:`flowforge.tools.export.source.SUPPORTED_ADAPTERS`)."""


def probe_inputs(family: str, config) -> tuple[str, Tensor, Tensor, Conditioning]:
    """``(family, x [2, *latent], sigma [2], cond)``: seeded fp32 inputs shaped from transformer ``config``.

    Raises:
        KeyError: ``family`` has no probe (callers check :data:`PROBES` first).
    """
    gen = torch.Generator().manual_seed(SEED)
    x, cond = PROBES[family].inputs(config, lambda *shape: torch.randn(*shape, generator=gen))
    return family, x, torch.tensor(SIGMA), cond


def family_adapter(family: str, transformer: nn.Module) -> FlowModel:
    """The family's adapter around a bare ``transformer`` (no text encoder, no VAE)."""
    cls, make = adapter_class(family), PROBES[family].adapter
    return cls(transformer) if make is None else make(cls, transformer)
