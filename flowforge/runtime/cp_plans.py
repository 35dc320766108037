"""Context-parallel plans flowforge gives diffusers in place of a class's own ``_cp_plan`` where that one does not
split the model correctly (keyed by the diffusers class name; :func:`flowforge.runtime.context_parallel.plan_of`).

``LTX2VideoTransformer3DModel`` (diffusers 0.42.1, ``transformers/transformer_ltx2.py``, ``_cp_plan`` at the class)
splits the video tokens, the text and its mask, and the outputs of ``rope`` as tensors of 3 dims
(``rope_type="interleaved"``: ``[B, S, D]``), and gathers ``proj_out``. Two things break it: LTX-2's checkpoints use
``rope_type="split"``, whose RoPE tensors are ``[B, H, S, D / 2]`` (4 dims), so the plan leaves them whole and the
first attention fails on a shape mismatch (``apply_split_rotary_emb``); and the audio stream is not in the plan, so
the audio tokens stay whole on every rank while every attention processor (audio self-attention, audio-to-text, the
audio <-> video cross-attentions) runs the context-parallel path as if they were split, and the audio part of each
rank's gradient would be the full one, not a share. :func:`ltx2_plan` splits every stream -- video, audio, both
texts and their masks, the four RoPE modules (in either layout) -- and gathers both outputs, so that every
attention call sees a split query and split keys, as the context-parallel path assumes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def ltx2_plan(module: torch.nn.Module) -> dict:
    """The plan of an ``LTX2VideoTransformer3DModel`` (``module``) for its ``config.rope_type``."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    tokens = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
    mask = ContextParallelInput(split_dim=1, expected_dims=2, split_output=False)
    if module.config.rope_type == "split":  # cos / sin [B, H, S, D / 2]
        rope = ContextParallelInput(split_dim=2, expected_dims=4, split_output=True)
    else:  # "interleaved": [B, S, D]
        rope = ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)
    streams = ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "audio_encoder_hidden_states")
    return {
        "": {**{name: tokens for name in streams},
             "encoder_attention_mask": mask, "audio_encoder_attention_mask": mask},
        **{name: {0: rope, 1: rope} for name in ("rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope")},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
        "audio_proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


PLANS: dict[str, Callable[[torch.nn.Module], dict]] = {"LTX2VideoTransformer3DModel": ltx2_plan}
"""diffusers class name -> the plan flowforge uses for a module of that class."""


ULYSSES_REFUSED: dict[str, str] = {
    "LTX2VideoTransformer3DModel": (
        "its cross-attentions (video x text, audio x text, audio <-> video) have queries and keys of different "
        "lengths, and diffusers 0.42's Ulysses backward reshapes the key / value gradients with the query's length "
        "(attention_dispatch.py, TemplatedUlyssesAttention.backward), besides handing its per-head text mask to "
        "H / U heads; use distributed.context_parallel.ring instead"),
}
"""diffusers class name -> why Ulysses cannot split it (ring can)."""


def ulysses_problem(module: torch.nn.Module, ulysses: int) -> str | None:
    """One line when ``ulysses > 1`` cannot split ``module``'s class (:data:`ULYSSES_REFUSED`), else None."""
    why = ULYSSES_REFUSED.get(type(module).__name__)
    if ulysses > 1 and why:
        return f"distributed.context_parallel.ulysses={ulysses} cannot split {type(module).__name__}: {why}"
    return None
