"""Your own reward for the digits demo, as a plain function: ``reward.weights: {"my_rewards:ink": 0.5}``.

flowforge finds this module because it sits next to the config that names it (``examples/digits/own_reward.yaml``);
the working directory is importable too. A function taking ``(media, prompts, metadata)`` is called once per batch
of generated images (a class, or a function taking only your options, is called once to make a scorer instead:
``docs/own_reward.md``). Extra keyword arguments are set from ``reward.options["my_rewards:ink"]``.
"""

from __future__ import annotations

import torch


def ink(media, prompts, metadata, target=0.15, threshold=0.5):
    """Ink coverage, paid up to ``target``: bolder strokes score higher until a fraction ``target`` of the pixels
    is ink; more ink than that earns nothing more (a white canvas is not a better digit).

    Args:
        media: ``[B, 3, H, W]`` float32 in [0, 1], the generated images (the demo draws a white digit on black).
        prompts: B prompt strings (unused here). metadata: B dicts (unused here; e.g. ``metadata[i]["digit"]``).
        target: coverage in (0, 1] worth the full score. threshold: grey level above which a pixel is ink.

    Returns:
        ``[B]`` float32 in [0, 1] (a list of B floats would do as well); NaN would mean "not applicable".
    """
    coverage = (media.mean(dim=1) > threshold).float().mean(dim=(1, 2))  # [B] fraction of ink pixels
    return torch.clamp(coverage / target, max=1.0)
