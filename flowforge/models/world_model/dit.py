"""The video DiT block of the world model (Wan-style) with its coupling attention to the latent state.

One block, on tokens ``x [B, f, N, D]`` (``N`` patches per latent frame), per-frame conditioning ``mod [B, f, 6, D]``
(timestep + action, see :mod:`~flowforge.models.world_model.network`), context ``[B, S, D]`` and state tokens
``[B, f, M, D]``::

    shift1, scale1, gate1, shift2, scale2, gate2 = modulation + mod                 (Wan's scale_shift_table + temb)
    x = x + gate1 * self_attn(modulate(norm1(x), shift1, scale1))                   video self-attention, all f*N
    x = x + cross_attn(norm2(x), context)                                           "text" cross-attention
    x = x + gate * out(attn(q(norm(x)), k(s), v(s)))                                coupling, per latent frame
    x = x + gate2 * ffn(modulate(norm3(x), shift2, scale2))

The coupling attention lets the video tokens of latent frame ``j`` (queries) read the ``M`` state tokens of frame
``j`` (keys / values). Its four linears are named exactly ``q``, ``k``, ``v``, ``out`` so LoRA can target them and
nothing else; its scalar ``gate`` starts at 0, so a freshly added coupling leaves the block's output unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from flowforge.models.world_model.config import WorldModelConfig
from flowforge.models.world_model.layers import Attention, FeedForward, merge_heads, modulate, split_heads

COUPLING_LINEARS = ("q", "k", "v", "out")
"""Names of the coupling attention's linears (the LoRA targets of ``parameter_mode="lora"``)."""


class CouplingAttention(nn.Module):
    """Video tokens ``[B, f, N, D]`` attend to the state tokens ``[B, f, M, D]`` of their own latent frame; the
    result enters the residual stream through the scalar ``gate`` (0 at init)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.gate = nn.Parameter(torch.zeros(1))  # shape [1], not [], so FSDP can shard it like any parameter

    def forward(self, x: Tensor, state: Tensor) -> Tensor:
        b, f, n, d = x.shape
        m = state.shape[2]
        q = split_heads(self.q(self.norm(x)).reshape(b * f, n, d), self.heads)
        k = split_heads(self.k(state).reshape(b * f, m, d), self.heads)
        v = split_heads(self.v(state).reshape(b * f, m, d), self.heads)
        attended = self.out(merge_heads(F.scaled_dot_product_attention(q, k, v))).view(b, f, n, d)
        return x + self.gate * attended


class VideoBlock(nn.Module):
    """One DiT block (see the module docstring)."""

    def __init__(self, config: WorldModelConfig):
        super().__init__()
        dim, heads = config.dim, config.num_heads
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.self_attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.cross_attn = Attention(dim, heads)
        self.coupling = CouplingAttention(dim, heads)
        self.norm3 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ffn = FeedForward(dim, config.ffn_dim)
        self.modulation = nn.Parameter(torch.randn(6, dim) / dim ** 0.5)

    def forward(self, x: Tensor, mod: Tensor, context: Tensor, state: Tensor) -> Tensor:
        """``x [B, f, N, D]``, ``mod [B, f, 6, D]``, ``context [B, S, D]``, ``state [B, f, M, D]`` -> ``[B, f, N, D]``."""
        b, f, n, d = x.shape
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation + mod).unsqueeze(3).unbind(2)
        h = modulate(self.norm1(x), shift1, scale1).reshape(b, f * n, d)
        x = x + gate1 * self.self_attn(h).view(b, f, n, d)
        x = x + self.cross_attn(self.norm2(x).reshape(b, f * n, d), context).view(b, f, n, d)
        x = self.coupling(x, state)
        return x + gate2 * self.ffn(modulate(self.norm3(x), shift2, scale2))
