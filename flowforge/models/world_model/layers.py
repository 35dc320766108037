"""Building blocks of the world model: attention, feed-forward, timestep embedding, patches, FSQ.

Shapes: video latents ``[B, C, F, H, W]``; patch tokens ``[B, F, N, D]`` with ``N = (H / p) * (W / p)`` per latent
frame, row-major over the patch grid. Attention is ``torch.nn.functional.scaled_dot_product_attention`` (no dropout:
the trained policy must be deterministic).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F


def timestep_embedding(t: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    """Sinusoidal embedding ``[..., dim]`` fp32 of ``t [...]`` (``[cos(t w_i), sin(t w_i)]``, ``w_i = max_period **
    (-i / (dim / 2))``; Vaswani et al. 2017, in the cos-first order diffusers' Wan time embedding uses)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[..., None] * freqs
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """AdaLN modulation ``x * (1 + scale) + shift`` (DiT, Peebles & Xie 2023)."""
    return x * (1.0 + scale) + shift


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dim (the query / key norm of Wan's attention)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Multi-head attention with projections ``to_q / to_k / to_v / to_out`` (diffusers' Wan names) and RMS
    query / key norms.

    Args:
        dim: query width (and output width). heads: number of heads (``dim % heads == 0``).
        kv_dim: width of the key / value source (default ``dim``).
    """

    def __init__(self, dim: int, heads: int, kv_dim: int | None = None):
        super().__init__()
        kv_dim = dim if kv_dim is None else kv_dim
        self.heads = heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(kv_dim, dim)
        self.to_v = nn.Linear(kv_dim, dim)
        self.to_out = nn.Linear(dim, dim)
        self.norm_q = RMSNorm(dim)
        self.norm_k = RMSNorm(dim)

    def forward(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        """``x [B, L, dim]`` attends to ``context [B, S, kv_dim]`` (``x`` itself when None) -> ``[B, L, dim]``."""
        context = x if context is None else context
        q = split_heads(self.norm_q(self.to_q(x)), self.heads)
        k = split_heads(self.norm_k(self.to_k(context)), self.heads)
        v = split_heads(self.to_v(context), self.heads)
        return self.to_out(merge_heads(F.scaled_dot_product_attention(q, k, v)))


def split_heads(x: Tensor, heads: int) -> Tensor:
    """``[B, L, D] -> [B, heads, L, D / heads]``."""
    b, n, d = x.shape
    return x.view(b, n, heads, d // heads).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """``[B, heads, L, d] -> [B, L, heads * d]``."""
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)


class FeedForward(nn.Module):
    """``fc2(gelu_tanh(fc1(x)))`` (Wan's FFN)."""

    def __init__(self, dim: int, hidden: int, out_dim: int | None = None):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim if out_dim is None else out_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class QueryReader(nn.Module):
    """``n`` learnable queries read a token set by cross-attention, then an MLP (both residual, pre-norm):
    ``[B, L, dim] -> [B, n, dim]`` (the Perceiver / Q-Former read-out)."""

    def __init__(self, dim: int, heads: int, n: int, hidden: int):
        super().__init__()
        self.queries = nn.Parameter(torch.randn(n, dim) * dim ** -0.5)
        self.norm_q = nn.LayerNorm(dim)
        self.norm_kv = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm_mlp = nn.LayerNorm(dim)
        self.mlp = FeedForward(dim, hidden)

    def forward(self, tokens: Tensor) -> Tensor:
        q = self.queries.expand(tokens.shape[0], -1, -1)
        h = q + self.attn(self.norm_q(q), self.norm_kv(tokens))
        return h + self.mlp(self.norm_mlp(h))


class SelfAttentionLayer(nn.Module):
    """Pre-norm transformer layer: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``, ``[B, L, dim]``."""

    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = FeedForward(dim, hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def patchify(x: Tensor, p: int) -> Tensor:
    """Video ``[B, C, F, H, W]`` -> patches ``[B, F, N, C * p * p]`` (patch grid row-major)."""
    b, c, f, h, w = x.shape
    x = x.reshape(b, c, f, h // p, p, w // p, p).permute(0, 2, 3, 5, 1, 4, 6)
    return x.reshape(b, f, (h // p) * (w // p), c * p * p)


def unpatchify(tokens: Tensor, channels: int, p: int, height: int, width: int) -> Tensor:
    """Inverse of :func:`patchify`: ``[B, F, N, C * p * p] -> [B, C, F, H, W]``."""
    b, f = tokens.shape[:2]
    x = tokens.reshape(b, f, height // p, width // p, channels, p, p).permute(0, 4, 1, 2, 5, 3, 6)
    return x.reshape(b, channels, f, height, width)


def fsq(z: Tensor, levels: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """Finite scalar quantization (Mentzer et al., "Finite Scalar Quantization: VQ-VAE Made Simple", ICLR 2024).

    Each of the ``len(levels)`` channels of ``z [..., d]`` is bounded to ``(L - 1) / 2 * tanh(z)`` and rounded to the
    nearest of its ``L`` (odd) integer levels, with a straight-through gradient.

    Returns:
        ``(codes [..., d]`` fp32 in ``[-(L-1)/2, (L-1)/2]`` (straight-through), ``index [...]`` int64 in
        ``[0, prod(levels))``: the mixed-radix number of the shifted digits, first channel most significant).
    """
    half = torch.tensor([(lv - 1) / 2 for lv in levels], dtype=torch.float32, device=z.device)
    bounded = torch.tanh(z.float()) * half
    codes = bounded + (torch.round(bounded) - bounded).detach()
    digits = (torch.round(bounded) + half).long()
    index = torch.zeros(digits.shape[:-1], dtype=torch.long, device=z.device)
    for i, lv in enumerate(levels):
        index = index * lv + digits[..., i]
    return codes, index
