"""The tiny text-to-digit policy of the embedded default: a diffusers ``SD3Transformer2DModel`` in pixel space.

Same architecture as Stable Diffusion 3 (MM-DiT joint attention over image patches and text tokens, AdaLN-Zero
modulated by timestep + pooled text embedding), scaled down so that SFT and RL run on two CPU cores:

=========================  ==========  ==================================================================
field                      tiny        why
=========================  ==========  ==================================================================
``sample_size``            32          32x32 pixels, no VAE (the latent *is* the image in [-1, 1])
``in/out_channels``        1           grey digits; ``decode`` repeats the channel to RGB
``patch_size``             4           8x8 = 64 image tokens of 16 pixels each (patch 2 = 256 tokens of 4
                                       pixels was measured ~4x slower per SFT step and learned far slower)
``num_layers``             4           joint blocks (the last is context-pre-only, as in SD3)
``num_attention_heads``    4           x ``attention_head_dim`` 32 = inner width 128
``joint_attention_dim``    384         MiniLM token embeddings (the context)
``pooled_projection_dim``  384         MiniLM sentence embedding (the pooled vector)
``caption_projection_dim`` 128         must equal the inner width
``pos_embed_max_size``     8           = sample_size / patch_size
=========================  ==========  ==================================================================

``tiny_sd3_config()`` has 2,362,128 parameters. ``test_sd3_config()`` (2 layers, width 32) is for unit tests.
The diffusers SD3 transformer has no dropout, so the trained policy is deterministic.
"""

from __future__ import annotations

from typing import Any

TEXT_DIM = 384  # MiniLM hidden size: joint_attention_dim and pooled_projection_dim
TEXT_MAX_LENGTH = 16  # context tokens the demo policy sees (every demo prompt fits)


def tiny_sd3_config(**overrides: Any) -> dict[str, Any]:
    """Keyword arguments of ``SD3Transformer2DModel`` for the demo policy (32x32x1, 2.36M parameters).

    ``overrides`` replace single fields; ``caption_projection_dim`` follows the inner width unless given.
    """
    config = dict(
        sample_size=32,
        patch_size=4,
        in_channels=1,
        out_channels=1,
        num_layers=4,
        attention_head_dim=32,
        num_attention_heads=4,
        joint_attention_dim=TEXT_DIM,
        pooled_projection_dim=TEXT_DIM,
        pos_embed_max_size=8,
    )
    config.update(overrides)
    config.setdefault("caption_projection_dim", config["num_attention_heads"] * config["attention_head_dim"])
    return config


def test_sd3_config(**overrides: Any) -> dict[str, Any]:
    """A much smaller config of the same shape contract (2 layers, width 32), for unit tests that run in seconds."""
    return tiny_sd3_config(**{"num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2, **overrides})


test_sd3_config.__test__ = False  # not a pytest test despite the name


def build_tiny_sd3(config: dict[str, Any] | None = None, *, seed: int | None = None):
    """A freshly initialised ``SD3Transformer2DModel`` (eval mode) from ``config`` (default ``tiny_sd3_config()``).

    ``seed`` makes the initialisation deterministic (it seeds a forked RNG, leaving the global one untouched).
    """
    import torch
    from diffusers import SD3Transformer2DModel

    config = tiny_sd3_config() if config is None else dict(config)
    if seed is None:
        return SD3Transformer2DModel(**config).eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return SD3Transformer2DModel(**config).eval()
