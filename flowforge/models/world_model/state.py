"""The latent state of the world model: initializer, transition module B, and their rollout over latent frames.

==============================  ====================================================================================
symbol                          meaning
==============================  ====================================================================================
``s_j`` ``[B, M, Ds]``           the ``M`` state tokens of latent frame ``j``
``a_j`` ``[B, A]``               the actions of bin ``j`` (one-hot, or the bin's histogram of per-frame one-hots)
``s_0 = init(frame_0)``          first-frame patch tokens read by ``M`` learnable queries, then a LayerNorm
``s_{j+1} = B(s_j, a_j, j)``     ``norm(s_j + delta(h))``, ``h = layers(s_j + act(a_j) + step(j))`` (2 self-attention /
                                 MLP layers over the ``M`` tokens)
==============================  ====================================================================================

The rollout over ``f`` latent frames uses the first ``f - 1`` bins (bin ``f - 1`` has no successor frame in the clip);
``out_proj`` maps each state token to the DiT width for the coupling attention of every block.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from flowforge.models.world_model.config import WorldModelConfig
from flowforge.models.world_model.layers import QueryReader, SelfAttentionLayer, patchify


class StateInitializer(nn.Module):
    """First frame ``[B, C, 1, H, W]`` -> state tokens ``s_0 [B, M, Ds]``."""

    def __init__(self, config: WorldModelConfig):
        super().__init__()
        ds = config.state_dim
        self.patch_size = config.patch_size
        self.patch = nn.Linear(config.patch_dim, ds)
        self.pos = nn.Parameter(torch.randn(config.tokens_per_frame, ds) * 0.02)
        self.reader = QueryReader(ds, config.num_heads, config.state_tokens, 4 * ds)
        self.norm = nn.LayerNorm(ds)

    def forward(self, first_frame: Tensor) -> Tensor:
        tokens = self.patch(patchify(first_frame, self.patch_size)[:, 0]) + self.pos
        return self.norm(self.reader(tokens))


class TransitionModule(nn.Module):
    """Transition module B: ``s_{j+1} = norm(s_j + delta(layers(s_j + act(a_j) + step(j))))``, ``[B, M, Ds]``."""

    def __init__(self, config: WorldModelConfig):
        super().__init__()
        ds = config.state_dim
        self.action_embed = nn.Linear(config.num_actions, ds)
        self.step_embed = nn.Embedding(config.max_frames, ds)
        self.layers = nn.ModuleList(SelfAttentionLayer(ds, config.num_heads, 4 * ds)
                                    for _ in range(config.transition_layers))
        self.delta = nn.Linear(ds, ds)
        self.norm = nn.LayerNorm(ds)

    def forward(self, state: Tensor, action: Tensor, step: int) -> Tensor:
        """``state [B, M, Ds]``, ``action [B, A]`` (bin ``step``) -> the next state ``[B, M, Ds]``."""
        step_ids = torch.full((state.shape[0],), step, dtype=torch.long, device=state.device)
        h = state + (self.action_embed(action) + self.step_embed(step_ids))[:, None]
        for layer in self.layers:
            h = layer(h)
        return self.norm(state + self.delta(h))


class LatentStateRollout(nn.Module):
    """``initializer`` + ``transition`` (B) + ``out_proj`` (state width -> DiT width)."""

    def __init__(self, config: WorldModelConfig):
        super().__init__()
        self.initializer = StateInitializer(config)
        self.transition = TransitionModule(config)
        self.out_proj = nn.Linear(config.state_dim, config.dim)

    def forward(self, first_frame: Tensor, bins: Tensor) -> Tensor:
        """States ``[B, f, M, Ds]`` of ``f = bins.shape[1]`` latent frames from ``first_frame [B, C, 1, H, W]`` and
        the action bins ``[B, f, A]`` (the first ``f - 1`` are used)."""
        states = [self.initializer(first_frame)]
        for j in range(bins.shape[1] - 1):
            states.append(self.transition(states[-1], bins[:, j], j))
        return torch.stack(states, dim=1)
