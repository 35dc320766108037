"""Weights an adapter was built with are moved into memory of their own when they sit unaligned (the way a
safetensors file can leave them), so a model loaded from disk computes what the same weights in memory compute."""

from __future__ import annotations

import torch

from flowforge.models.load import ALIGNMENT, own_aligned_storage


class _Adapter:
    def __init__(self, transformer, vae):
        self.transformer, self.vae, self.name = transformer, vae, "not a module"


def test_unaligned_parameters_and_buffers_get_storage_of_their_own():
    base = torch.arange(33, dtype=torch.float32)
    linear = torch.nn.Linear(4, 4)
    linear.weight = torch.nn.Parameter(base[1:17].view(4, 4))  # 4 bytes past an aligned start: unaligned
    linear.register_buffer("scale", base[17:21].clone())  # freshly allocated: aligned, left where it is
    shared = torch.nn.Sequential(linear)
    adapter = _Adapter(shared, shared)  # one module under two names is handled once
    assert linear.weight.data_ptr() % ALIGNMENT and not linear.scale.data_ptr() % ALIGNMENT
    scale_at, weight = linear.scale.data_ptr(), linear.weight
    assert own_aligned_storage(adapter) == 1
    assert linear.weight is weight and linear.weight.data_ptr() % ALIGNMENT == 0  # the same Parameter, new memory
    assert torch.equal(linear.weight, base[1:17].view(4, 4)) and linear.scale.data_ptr() == scale_at
    assert own_aligned_storage(adapter) == 0
