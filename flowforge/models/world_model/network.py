"""The action-conditioned video world model: a Wan-style video DiT coupled to a latent state rolled by actions.

Forward (:meth:`WorldModel.forward`), for latents ``x [B, C, f, H, W]`` at noise level ``sigma [B]``, actions
``[B, frames, A]`` per video frame and the clean first frame ``[B, C, 1, H, W]``:

==========================  ========================================================================================
step                        computation
==========================  ========================================================================================
action bins                 ``bins [B, f, A]``: bin 0 = frame 0; bin ``j >= 1`` = mean of frames
                            ``(j - 1) r + 1 .. j r`` (``r = temporal_factor``; 1:1 in pixel space)
latent state                ``states [B, f, M, Ds]`` = :class:`~.state.LatentStateRollout` (first ``f - 1`` bins)
tokens                      ``patch_embed(patches) + pos_embed[n] + frame_embed[j]``, ``[B, f, N, D]``
per-frame conditioning      ``c_j = time_embed(sin(1000 sigma_j)) + action_embed(bins_j)`` with ``sigma_0 = 0``
                            (without ``direct_actions``: the timestep term only); with ``action_history`` plus
                            ``history_embed(sum_{i<j} bins_i / f)``, the commands before frame ``j``
                            (the condition slot is clean, as Wan2.2's per-token timestep gives the first frame 0);
                            ``mod_j = time_proj(silu(c_j))`` -> 6 modulation vectors per frame: every bin ``j``
                            (all ``f``) is injected into latent frame ``j``
context                     ``[context tokens (learned) ; action_embed(bins) + frame_embed]``, ``[B, K + f, D]``
                            (without ``direct_actions``: the learned context tokens only, ``[B, K, D]``)
blocks                      :class:`~.dit.VideoBlock` x ``num_layers``, coupling to ``out_proj(states)``
output                      ``proj_out(modulate(norm_out(x), out_modulation + c_j))`` -> velocity, 0 on slot 0
==========================  ========================================================================================

The velocity is the flow-matching target ``noise - x0`` (fp32). Positions are learned (a spatial and a frame table)
where Wan uses 3-D RoPE: the demo has one fixed size.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from flowforge.models.world_model.config import WorldModelConfig
from flowforge.models.world_model.dit import VideoBlock
from flowforge.models.world_model.layers import modulate, patchify, timestep_embedding, unpatchify
from flowforge.models.world_model.state import LatentStateRollout
from flowforge.models.world_model.tokenizer import TransitionPredictor, TransitionTokenizer

TIMESTEP_SCALE = 1000.0
"""Native timestep ``1000 * sigma`` (as Wan)."""


class WorldModel(nn.Module):
    """The world model network (see the module docstring). ``config`` is a :class:`WorldModelConfig`."""

    def __init__(self, config: WorldModelConfig):
        super().__init__()
        self.config = config
        dim = config.dim
        self.patch_embed = nn.Linear(config.patch_dim, dim)
        self.pos_embed = nn.Parameter(torch.randn(config.tokens_per_frame, dim) * 0.02)
        self.frame_embed = nn.Parameter(torch.randn(config.max_frames, dim) * 0.02)
        self.time_embed = nn.Sequential(nn.Linear(config.freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_proj = nn.Linear(dim, 6 * dim)
        # direct_actions=False: no action enters the video but through the latent state (the coupling attention)
        self.action_embed = nn.Linear(config.num_actions, dim) if config.direct_actions else None
        self.context = nn.Parameter(torch.randn(config.context_tokens, dim) * 0.02)
        self.blocks = nn.ModuleList(VideoBlock(config) for _ in range(config.num_layers))
        self.norm_out = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.out_modulation = nn.Parameter(torch.randn(2, dim) / dim ** 0.5)
        self.proj_out = nn.Linear(dim, config.patch_dim)
        self.latent_state_rollout = LatentStateRollout(config)
        self.transition_tokenizer = TransitionTokenizer(config)
        self.transition_predictor = TransitionPredictor(config)
        # created last, so every other parameter's seeded initialisation is the same with and without it
        self.history_embed = nn.Linear(config.num_actions, dim) if config.action_history else None
        self.gradient_checkpointing = False

    def bin_actions(self, actions: Tensor, latent_frames: int) -> Tensor:
        """Per-frame actions ``[B, frames, A]`` -> bins ``[B, f, A]`` (see the module table), fp32.

        Raises:
            ValueError: ``frames != (f - 1) * temporal_factor + 1`` or the wrong number of actions.
        """
        r = self.config.temporal_factor
        b, frames, a = actions.shape
        if a != self.config.num_actions or frames != self.config.video_frames(latent_frames):
            raise ValueError(f"actions must be [B, {self.config.video_frames(latent_frames)}, "
                             f"{self.config.num_actions}] for {latent_frames} latent frames, got {tuple(actions.shape)}")
        actions = actions.float()
        if r == 1:
            return actions
        rest = actions[:, 1:].reshape(b, latent_frames - 1, r, a).mean(2)
        return torch.cat([actions[:, :1], rest], dim=1)

    def frame_conditioning(self, sigma: Tensor, bins: Tensor) -> Tensor:
        """``c [B, f, D]``: the timestep embedding of each latent frame (0 for the condition slot) plus its action bin
        (and, with ``action_history``, the mean of the bins before it over ``f``)."""
        b, f = bins.shape[:2]
        frame_sigma = torch.cat([sigma.new_zeros(b, 1), sigma.float()[:, None].expand(b, f - 1)], dim=1)
        temb = self.time_embed(timestep_embedding(TIMESTEP_SCALE * frame_sigma, self.config.freq_dim))
        if self.action_embed is None:
            return temb
        cond = temb + self.action_embed(bins)
        if self.history_embed is not None:
            before = torch.cat([bins.new_zeros(b, 1, bins.shape[2]), bins[:, :-1].cumsum(1)], dim=1) / f
            cond = cond + self.history_embed(before)
        return cond

    def forward(self, x: Tensor, sigma: Tensor, actions: Tensor, first_frame: Tensor,
                direct_keep: Tensor | None = None) -> Tensor:
        """Velocity ``[B, C, f, H, W]`` fp32 (0 on latent frame 0) at ``x [B, C, f, H, W]``, ``sigma [B]`` in [0, 1],
        ``actions [B, frames, A]`` and ``first_frame [B, C, 1, H, W]`` (the clean condition slot).
        ``direct_keep [B]`` (0 / 1; None = all 1): a row with 0 gives the direct action path (modulation, context,
        history) the null actions while the latent state still rolls the real ones, so that row's actions reach the
        video only through B -> coupling (``sft.direct_action_dropout``; :func:`without_direct_actions`)."""
        b, c, f, h, w = x.shape
        cfg = self.config
        dtype = self.patch_embed.weight.dtype
        bins = self.bin_actions(actions, f).to(dtype)
        states = self.latent_state_rollout(first_frame.to(dtype), bins)
        state_kv = self.latent_state_rollout.out_proj(states)
        if direct_keep is not None:  # null actions (as cond_dropout's) on the direct path only
            bins = bins * direct_keep.to(dtype)[:, None, None]
        frame_embed = self.frame_embed[:f]
        tokens = self.patch_embed(patchify(x.to(dtype), cfg.patch_size)) + self.pos_embed + frame_embed[:, None]
        cond = self.frame_conditioning(sigma, bins).to(dtype)
        mod = self.time_proj(F.silu(cond)).view(b, f, 6, cfg.dim)
        context = self.context.expand(b, -1, -1)
        if self.action_embed is not None:
            context = torch.cat([context, self.action_embed(bins) + frame_embed], dim=1)
        for block in self.blocks:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                tokens = checkpoint(block, tokens, mod, context, state_kv, use_reentrant=False)
            else:
                tokens = block(tokens, mod, context, state_kv)
        shift, scale = (self.out_modulation + cond[:, :, None]).unsqueeze(3).unbind(2)
        out = self.proj_out(modulate(self.norm_out(tokens), shift, scale))
        v = unpatchify(out, c, cfg.patch_size, h, w).float()
        return torch.cat([torch.zeros_like(v[:, :, :1]), v[:, :, 1:]], dim=2)

    def transition_logits(self, first_frame: Tensor, actions: Tensor, latent_frames: int) -> Tensor:
        """Transition-code logits ``[B, f - 1, M, K]`` of the predictor on the rolled states ``s_0 .. s_{f-2}`` and
        bins ``0 .. f - 2`` (the transition anchor's prediction; :meth:`transition_labels` are its targets)."""
        dtype = self.patch_embed.weight.dtype
        bins = self.bin_actions(actions, latent_frames).to(dtype)
        states = self.latent_state_rollout(first_frame.to(dtype), bins)
        return self.transition_predictor(states[:, :-1], bins[:, :-1]).float()

    def transition_labels(self, video: Tensor) -> Tensor:
        """The tokenizer's transition codes ``[B, f - 1, M]`` int64 of clean latents ``video [B, C, f, H, W]``."""
        return self.transition_tokenizer.labels(video.to(self.patch_embed.weight.dtype))


def without_direct_actions(model: WorldModel) -> WorldModel:
    """A copy of ``model`` whose direct action path reads the null actions for every row (its ``action_embed`` /
    ``history_embed`` weights zeroed, biases kept: ``direct_keep = 0`` everywhere), so the actions reach the video
    only through the latent state. The original is untouched; a model without ``direct_actions`` is copied as is."""
    import copy

    out = copy.deepcopy(model)
    with torch.no_grad():
        for layer in (out.action_embed, out.history_embed):
            if layer is not None:
                layer.weight.zero_()
    return out
