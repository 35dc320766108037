"""Transition tokenizer (discrete labels of what changed between two frames) and the transition predictor.

The tokenizer is a latent-action model in the manner of Genie (Bruce et al., ICML 2024): adjacent clean frames
``(x_t, x_{t+1})`` become patch tokens tagged with a pair-role embedding (0 = earlier, 1 = later); ``M`` learnable
queries read them and each query's ``len(levels)`` channels are FSQ-quantized (:func:`~.layers.fsq`), giving ``M``
codes in ``[0, K)``, ``K = prod(levels)``. Its own training signal is reconstruction: a decoder sees ``x_t`` and
the quantized codes and predicts ``x_{t+1}`` (:meth:`TransitionTokenizer.reconstruction_loss`), so the codes must
carry what ``x_t`` does not tell: the transition. Frozen after SFT, its codes are the labels of the transition
anchor.

The predictor reads the state ``s_t`` of the latent-state rollout plus its *own* embedding of the action bin
``a_t`` and outputs logits ``[B, f - 1, M, K]`` of the code of the transition ``t -> t + 1``; with its own action
embedding, step ``t = 0`` (``s_0`` from the initializer) depends on no weight of the transition module B.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from flowforge.models.world_model.config import WorldModelConfig
from flowforge.models.world_model.layers import FeedForward, QueryReader, SelfAttentionLayer, fsq, patchify


class TransitionTokenizer(nn.Module):
    """Pairs of frames ``[B, C, H, W]`` -> ``M`` FSQ codes; see the module docstring."""

    def __init__(self, config: WorldModelConfig):
        super().__init__()
        dt = config.tokenizer_dim
        self.levels = config.fsq_levels
        self.patch_size = config.patch_size
        self.in_channels = config.in_channels
        self.patch = nn.Linear(config.patch_dim, dt)
        self.pos = nn.Parameter(torch.randn(config.tokens_per_frame, dt) * 0.02)
        self.role = nn.Embedding(2, dt)
        self.reader = QueryReader(dt, config.num_heads, config.state_tokens, 4 * dt)
        self.to_code = nn.Linear(dt, len(config.fsq_levels))
        self.code_in = nn.Linear(len(config.fsq_levels), dt)
        self.decoder = SelfAttentionLayer(dt, config.num_heads, 4 * dt)
        self.decoder_norm = nn.LayerNorm(dt)
        self.to_patch = nn.Linear(dt, config.patch_dim)

    def _tokens(self, frame: Tensor) -> Tensor:
        return self.patch(patchify(frame.unsqueeze(2), self.patch_size)[:, 0]) + self.pos

    def encode(self, prev: Tensor, nxt: Tensor) -> tuple[Tensor, Tensor]:
        """Frames ``prev``, ``nxt`` ``[B, C, H, W]`` -> ``(codes [B, M, d]`` fp32 straight-through, ``index [B, M]``
        int64 in ``[0, K))``."""
        roles = self.role.weight
        tokens = torch.cat([self._tokens(prev) + roles[0], self._tokens(nxt) + roles[1]], dim=1)
        return fsq(self.to_code(self.reader(tokens)), self.levels)

    def reconstruct(self, prev: Tensor, codes: Tensor) -> Tensor:
        """Prediction ``[B, C, H, W]`` of the next frame from ``prev [B, C, H, W]`` and ``codes [B, M, d]``."""
        b, c, h, w = prev.shape
        tokens = self._tokens(prev)
        hidden = self.decoder(torch.cat([tokens, self.code_in(codes)], dim=1))[:, :tokens.shape[1]]
        patches = self.to_patch(self.decoder_norm(hidden))  # [B, N, C p p]
        p = self.patch_size
        out = patches.reshape(b, h // p, w // p, c, p, p).permute(0, 3, 1, 4, 2, 5)
        return out.reshape(b, c, h, w)

    def reconstruction_loss(self, video: Tensor) -> Tensor:
        """Mean squared error (fp32 scalar) of :meth:`reconstruct` over every adjacent pair of ``video [B, C, f, H,
        W]`` (clean latents): the tokenizer's own training loss."""
        prev, nxt = _pairs(video)
        codes, _ = self.encode(prev, nxt)
        return F.mse_loss(self.reconstruct(prev, codes).float(), nxt.float())

    @torch.no_grad()
    def labels(self, video: Tensor) -> Tensor:
        """Transition codes ``[B, f - 1, M]`` int64 of every adjacent pair of ``video [B, C, f, H, W]``."""
        b, f = video.shape[0], video.shape[2]
        prev, nxt = _pairs(video)
        return self.encode(prev, nxt)[1].view(b, f - 1, -1)


def _pairs(video: Tensor) -> tuple[Tensor, Tensor]:
    """``video [B, C, f, H, W]`` -> ``(prev, next)``, each ``[B * (f - 1), C, H, W]`` (pairs of one video together)."""
    prev = video[:, :, :-1].transpose(1, 2).flatten(0, 1)
    nxt = video[:, :, 1:].transpose(1, 2).flatten(0, 1)
    return prev, nxt


class TransitionPredictor(nn.Module):
    """States ``[B, T, M, Ds]`` + action bins ``[B, T, A]`` -> transition-code logits ``[B, T, M, K]``."""

    def __init__(self, config: WorldModelConfig):
        super().__init__()
        ds = config.state_dim
        self.action_embed = nn.Linear(config.num_actions, ds)
        self.layer = SelfAttentionLayer(ds, config.num_heads, 4 * ds)
        self.norm = nn.LayerNorm(ds)
        self.head = FeedForward(ds, 4 * ds, out_dim=config.codebook_size)

    def forward(self, states: Tensor, bins: Tensor) -> Tensor:
        b, t, m, ds = states.shape
        h = (states + self.action_embed(bins)[:, :, None]).reshape(b * t, m, ds)
        return self.head(self.norm(self.layer(h))).view(b, t, m, -1)
