"""Configuration of the action-conditioned video world model (:mod:`flowforge.models.world_model`).

The defaults are the reference scale: the video backbone takes the sizes of Wan2.1-T2V-1.3B (diffusers
``WanTransformer3DModel`` config: width 1536 = 12 heads x 128, 30 blocks, FFN 8960, 16 latent channels, patch
(1, 2, 2), sinusoidal timestep of 256 frequencies, VAE temporal factor 4); the world-model parts take the values the
system this family reproduces uses: ``M = 4`` state tokens, a 2-layer transition stack, the coupling gate at 0. The
demo's tiny instance is :func:`flowforge.models.world_model.tiny.tiny_config`.

=========================  ====================================================================================
field                      meaning
=========================  ====================================================================================
``in_channels``            latent channels ``C`` (1: grey pixels in [-1, 1], no VAE)
``sample_size``            latent height = width ``H``
``patch_size``             spatial patch side ``p`` (temporal patch 1: one latent frame per token row)
``max_frames``             latent frames ``f`` the learned frame embedding covers
``temporal_factor``        video frames per latent frame after the first (1 in pixel space; Wan's VAE: 4);
                           ``frames = (f - 1) * temporal_factor + 1``
``dim`` / ``num_heads``    DiT width and heads; ``ffn_dim`` the FFN hidden width
``num_layers``             DiT blocks (each: self-attention, cross-attention, coupling, FFN)
``num_actions``            ``A``: actions are one-hot (or bin histograms) over this many ids
``context_tokens``         learned context tokens the cross-attention reads before the action tokens
``state_tokens``           ``M``, state tokens per latent frame
``state_dim``              width of the state tokens
``transition_layers``      self-attention / MLP layers of the transition module B
``tokenizer_dim``          width of the transition tokenizer
``fsq_levels``             FSQ levels per code dimension (odd); codebook size ``K = prod(levels)``
``freq_dim``               sinusoidal timestep frequencies
``direct_actions``         True: the action bins also enter every frame's modulation and the cross-attention
                           context (the reference design); False: the only path from the actions to the video is
                           the latent state (transition B, read through the gated coupling attention), so the
                           coupling gates must open in training for the actions to matter
``action_history``         True (with ``direct_actions``): every frame's conditioning also carries the actions
                           taken before it, ``history_embed(sum_{i<j} a_i / f)`` (the integrated command, as
                           camera-controlled video models condition on the integrated pose rather than per-frame
                           motion); False: only the frame's own bin
=========================  ====================================================================================
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

ACTIONS = ("NOOP", "LEFT", "RIGHT")
"""The reduced Atari action set of the demo world (:mod:`flowforge.data.atari` records its clips with it): an action
id is an index into it; the default ``action_names`` of
:class:`~flowforge.models.world_model.adapter.WorldModelAdapter`."""


@dataclasses.dataclass(frozen=True)
class WorldModelConfig:
    """Architecture of :class:`~flowforge.models.world_model.network.WorldModel` (see the module table)."""

    in_channels: int = 16
    sample_size: int = 60  # 480 / 8: Wan's 480p latent height
    patch_size: int = 2
    max_frames: int = 21  # (81 - 1) / 4 + 1
    temporal_factor: int = 4
    dim: int = 1536
    num_heads: int = 12
    ffn_dim: int = 8960
    num_layers: int = 30
    num_actions: int = 3
    context_tokens: int = 1
    state_tokens: int = 4
    state_dim: int = 1536
    transition_layers: int = 2
    tokenizer_dim: int = 512
    fsq_levels: tuple[int, ...] = (3, 3, 3)
    freq_dim: int = 256
    direct_actions: bool = True
    action_history: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "fsq_levels", tuple(int(v) for v in self.fsq_levels))
        for flag in ("direct_actions", "action_history"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"world model config: {flag} must be true or false, got {getattr(self, flag)!r}")
        if self.action_history and not self.direct_actions:
            raise ValueError("world model config: action_history needs direct_actions (it is part of the direct "
                             "action path)")
        positive = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                    if f.name not in ("fsq_levels", "direct_actions", "action_history")}
        bad = [k for k, v in positive.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1]
        if bad:
            raise ValueError(f"world model config: {bad} must be positive ints")
        if self.sample_size % self.patch_size:
            raise ValueError(f"sample_size={self.sample_size} is not a multiple of patch_size={self.patch_size}")
        for width, heads in ((self.dim, self.num_heads), (self.state_dim, self.num_heads),
                             (self.tokenizer_dim, self.num_heads)):
            if width % heads:
                raise ValueError(f"width {width} is not divisible by num_heads={heads}")
        if not self.fsq_levels or any(v < 3 or v % 2 == 0 for v in self.fsq_levels):
            raise ValueError(f"fsq_levels must be odd ints >= 3, got {self.fsq_levels}")

    @property
    def codebook_size(self) -> int:
        """``K = prod(fsq_levels)``: the number of distinct transition codes per state token."""
        return math.prod(self.fsq_levels)

    @property
    def patch_dim(self) -> int:
        """Values per patch: ``C * p * p``."""
        return self.in_channels * self.patch_size ** 2

    @property
    def tokens_per_frame(self) -> int:
        """Patches per latent frame ``(H / p) ** 2``."""
        return (self.sample_size // self.patch_size) ** 2

    def video_frames(self, latent_frames: int) -> int:
        """Video frames of ``latent_frames`` latent frames: ``(f - 1) * temporal_factor + 1``."""
        return (latent_frames - 1) * self.temporal_factor + 1

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (tuples as lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorldModelConfig:
        """Inverse of :meth:`to_dict`; keys starting with ``_`` (file metadata) are ignored.

        Raises:
            ValueError: unknown keys (the allowed names are listed).
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if not k.startswith("_")}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"unknown world model config keys {unknown}; allowed: {sorted(fields)}")
        return cls(**data)
