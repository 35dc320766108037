"""Helpers of the world-model tests: a tiny adapter (test config: 2 blocks, width 32, 32x32 grey, 8 frames)."""

import torch

from flowforge.models.world_model.adapter import WorldModelAdapter
from flowforge.models.world_model.tiny import build_world_model, test_config

FRAMES = 8
PROMPTS = ["LEFT LEFT RIGHT NOOP NOOP LEFT RIGHT RIGHT", "NOOP RIGHT RIGHT RIGHT LEFT LEFT NOOP NOOP"]


def make_adapter(**kw):
    model = build_world_model(test_config(), seed=0)
    # non-zero gates, as after SFT, so the coupling path is live in the tests that need it
    with torch.no_grad():
        for block in model.blocks:
            block.coupling.gate.fill_(0.5)
    return WorldModelAdapter(model, **kw)
