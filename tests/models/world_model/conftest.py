"""Fixtures of the world-model tests: a tiny adapter and a conditioned batch."""

import pytest
import torch
from tests.models.world_model.wm_helpers import FRAMES, PROMPTS, make_adapter


@pytest.fixture
def adapter():
    return make_adapter()


@pytest.fixture
def batch(adapter):
    """``(x [2, 1, 8, 32, 32], sigma [2], cond)`` with the first frames set as ``cond.image``."""
    gen = torch.Generator().manual_seed(0)
    images = torch.rand(2, 3, 32, 32, generator=gen)
    cond = adapter.encode(PROMPTS)
    cond = adapter.condition_on_images(cond, PROMPTS, images, adapter.latent_shape(32, 32, FRAMES))
    x = torch.randn(2, 1, FRAMES, 32, 32, generator=gen)
    return x, torch.tensor([0.7, 0.3]), cond
