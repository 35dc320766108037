"""The tiny world model of the embedded Atari demo (``demo:world``): 32x32 grey Breakout frames, 8 frames per clip.

=======================  =======  =================================================================================
field                    tiny     why
=======================  =======  =================================================================================
``in_channels``          1        grey pixels in [-1, 1] (no VAE), the frames of :mod:`flowforge.data.atari`
``sample_size``          32       the clips' frame size
``patch_size``           8        4 x 4 = 16 tokens per frame, 128 for 8 frames (patch 4 was 3.3x slower on CPU)
``max_frames``           8        clips of 8 frames; ``temporal_factor`` 1: one latent frame per video frame
``dim`` / heads          96 / 4   DiT width; ``ffn_dim`` 384
``num_layers``           4        blocks
``state_tokens``         4        ``M`` (the reference value)
``state_dim``            64       state width; ``transition_layers`` 2 (the reference value)
``tokenizer_dim``        64       transition tokenizer width; FSQ levels (3, 3, 3): 27 codes per state token
``freq_dim``             64       sinusoidal timestep frequencies
=======================  =======  =================================================================================

:func:`test_config` is a smaller instance (2 blocks, width 32, patch 8) of the same contract for unit tests.
"""

from __future__ import annotations

from typing import Any

from flowforge.models.world_model.config import WorldModelConfig
from flowforge.models.world_model.network import WorldModel


def tiny_config(**overrides: Any) -> WorldModelConfig:
    """The demo's :class:`WorldModelConfig`; ``overrides`` replace single fields."""
    fields = dict(in_channels=1, sample_size=32, patch_size=8, max_frames=8, temporal_factor=1, dim=96, num_heads=4,
                  ffn_dim=384, num_layers=4, num_actions=3, context_tokens=1, state_tokens=4, state_dim=64,
                  transition_layers=2, tokenizer_dim=64, fsq_levels=(3, 3, 3), freq_dim=64)
    fields.update(overrides)
    return WorldModelConfig(**fields)


def test_config(**overrides: Any) -> WorldModelConfig:
    """A smaller config of the same contract (2 blocks, width 32) for unit tests that run in seconds."""
    return tiny_config(**{"dim": 32, "num_heads": 2, "ffn_dim": 64, "num_layers": 2,
                          "state_dim": 32, "tokenizer_dim": 32, "freq_dim": 32, **overrides})


test_config.__test__ = False  # not a pytest test despite the name


def build_world_model(config: WorldModelConfig | None = None, *, seed: int | None = None) -> WorldModel:
    """A freshly initialised :class:`WorldModel` (eval mode) from ``config`` (default :func:`tiny_config`).

    ``seed`` makes the initialisation deterministic (a forked RNG; the global one is left untouched).
    """
    import torch

    config = tiny_config() if config is None else config
    if seed is None:
        return WorldModel(config).eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return WorldModel(config).eval()
