"""The tiny FLUX / Qwen-Image / Wan / SD3 adapters that tests/models/test_families*.py share: each built once from a
config (tests/models/tiny_families.py), its prompts' conditioning encoded once, seeded inputs."""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from flowforge.models.base import Conditioning
from tests.models import tiny_families as tiny
from tests.models.test_sd3 import FakeText

FAMILIES = ["sd3", "flux", "qwen_image", "wan"]
PIPELINE_FAMILIES = ["flux", "qwen_image", "wan"]
PROMPTS = ["a red cat sitting under a tree", "two dogs"]
SEQ_LEN = {"flux": 16, "qwen_image": 64, "wan": 16}
MIN_TOK = 10


@dataclasses.dataclass
class Family:
    name: str
    adapter: Any
    components: dict | None
    size: tuple[int, int, int | None]  # height, width, frames
    latent: tuple[int, ...]
    timestep_scale: float  # native timestep = scale * sigma
    pipeline_kwargs: dict




def build_family(name: str) -> Family:
    if name == "sd3":
        from flowforge.demo.model import build_tiny_sd3, test_sd3_config
        from flowforge.models.sd3.adapter import SD3Adapter

        return Family(name, SD3Adapter(build_tiny_sd3(test_sd3_config(), seed=0), FakeText()), None,
                      (32, 32, None), (1, 32, 32), 1000.0, {})
    if name == "flux":
        from flowforge.models.flux.adapter import FluxAdapter, flux_text

        c = tiny.flux_components()
        text = flux_text(components={k: c[k] for k in ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2")},
                         max_sequence_length=SEQ_LEN[name], min_tokenizer_size=MIN_TOK)
        adapter = FluxAdapter(c["transformer"], text, c["vae"], scheduler_config=dict(c["scheduler"].config))
        return Family(name, adapter, c, (32, 32, None), (4, 16, 16), 1.0, dict(guidance_scale=3.5))
    if name == "qwen_image":
        from flowforge.models.qwen_image.adapter import QwenImageAdapter, qwen_image_text

        c = tiny.qwen_components()
        text = qwen_image_text(components={k: c[k] for k in ("tokenizer", "text_encoder")},
                               max_sequence_length=SEQ_LEN[name], min_tokenizer_size=MIN_TOK)
        adapter = QwenImageAdapter(c["transformer"], text, c["vae"], scheduler_config=dict(c["scheduler"].config))
        return Family(name, adapter, c, (16, 16, None), (4, 8, 8), 1.0,
                      dict(true_cfg_scale=4.0, negative_prompt=" "))
    if name == "wan":
        from flowforge.models.wan.adapter import WanAdapter, wan_text

        c = tiny.wan_components()
        text = wan_text(components={k: c[k] for k in ("tokenizer", "text_encoder")},
                        max_sequence_length=SEQ_LEN[name], min_tokenizer_size=MIN_TOK)
        adapter = WanAdapter(c["transformer"], text, c["vae"], scheduler_config=dict(c["scheduler"].config))
        return Family(name, adapter, c, (16, 16, 9), (4, 3, 2, 2), 1000.0,
                      dict(guidance_scale=4.0, negative_prompt="", num_frames=9))
    raise AssertionError(name)


_COND: dict[str, Conditioning] = {}


def cond_of(f: Family) -> Conditioning:
    if f.name not in _COND:
        _COND[f.name] = f.adapter.encode(PROMPTS)
    return _COND[f.name]


def inputs_of(f: Family, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(PROMPTS), *f.latent, generator=g), torch.tensor([0.37, 0.81])


def strip_negative(cond: Conditioning) -> Conditioning:
    return Conditioning(cond.prompt_embeds, cond.pooled, cond.mask)


def with_transformer(f: Family, transformer) -> Any:
    other = copy.copy(f.adapter)
    other.transformer = transformer
    return other



_CACHE: dict[str, Family] = {}


def family(name: str) -> Family:
    """The tiny adapter of family ``name``, built on first use and shared by every test."""
    if name not in _CACHE:
        _CACHE[name] = build_family(name)
    return _CACHE[name]
