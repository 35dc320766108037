"""The LTX-2 family's spec (:class:`flowforge.models.family.Family`): text to video with its audio."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from flowforge.models.base import Conditioning, FlowModel
from flowforge.models.family import Family, Probe, Randn


def probe_inputs(config, randn: Randn) -> tuple[Tensor, Conditioning]:
    """The joint latent of a 9-frame 32x32 clip (2 video tokens + 9 audio tokens at 24 fps) and seeded connector
    features."""
    x = randn(2, 2 + 9, int(config.in_channels))
    if config.use_prompt_embeddings:  # LTX-2.0: both streams read caption_channels-wide connector features
        width = 2 * int(config.caption_channels)
    else:
        width = (int(config.num_attention_heads) * int(config.attention_head_dim)
                 + int(config.audio_num_attention_heads) * int(config.audio_attention_head_dim))
    return x, Conditioning(prompt_embeds=randn(2, 8, width), mask=torch.ones(2, 8, dtype=torch.long))


def probe_adapter(cls: type, transformer: nn.Module) -> FlowModel:
    # the probe compares the conditional velocity: no CFG (the pipeline default guides the audio at 7), no rescale
    ltx2 = cls(transformer, audio_guidance_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0)
    ltx2.latent_shape(32, 32, 9)  # the probe's geometry (no VAE: LTX-2's compression 32 / 8, 16 kHz audio)
    return ltx2


FAMILY = Family(
    # LTX-2's own _cp_plan splits RoPE tensors of 3 dims only (rope_type="interleaved"; LTX-2 uses "split", 4 dims)
    # and leaves the audio stream whole: flowforge gives diffusers a plan of its own (flowforge.runtime.cp_plans),
    # under ring only (Ulysses is refused there: diffusers 0.42's Ulysses backward breaks its cross-attentions)
    name="ltx2", adapter="flowforge.models.ltx2.adapter:LTX2Adapter", loader="flowforge.models.ltx2.adapter:load_ltx2",
    tasks=("t2v",), default_task="t2v", context_parallel=True,
    transformer="LTX2VideoTransformer3DModel", export_pipeline="LTX2Pipeline", probe=Probe(probe_inputs, probe_adapter))
