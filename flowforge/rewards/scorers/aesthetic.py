"""LAION aesthetic score: an MLP on the L2-normalised CLIP image embedding predicts a 1..10 rating.

    r = MLP(f_I(x) / ||f_I(x)||)            the prompt is not used

``MLP`` is the improved-aesthetic-predictor head: Linear(D, 1024) Dropout(0.2) Linear(1024, 128) Dropout(0.2)
Linear(128, 64) Dropout(0.1) Linear(64, 16) Linear(16, 1), D = CLIP projection dim (768 for L/14). ``f_I`` as in
:mod:`flowforge.rewards.scorers.clip_common`.

Source: Schuhmann, LAION ``improved-aesthetic-predictor`` (``simple_inference.py``; head weights
``sac+logos+ava1-l14-linearMSE.pth`` on ``openai/clip-vit-large-patch14``); flow_grpo's
``flow_grpo/aesthetic_scorer.py`` (same head on the L2-normalised ``get_image_features``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from flowforge.rewards.base import check_inputs
from flowforge.rewards.scorers.clip_common import TransformersClip, local_file


class AestheticHead(nn.Module):
    """The LAION improved-aesthetic-predictor MLP. Parameter names (``layers.0``, ``layers.2``, ``layers.4``,
    ``layers.6``, ``layers.7``) match the released ``sac+logos+ava1-l14-linearMSE.pth`` state dict.

    ``[B, in_features]`` (L2-normalised CLIP image embeddings) -> ``[B, 1]`` predicted rating.
    """

    def __init__(self, in_features: int = 768) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(in_features, 1024), nn.Dropout(0.2),
            nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeddings: Tensor) -> Tensor:
        return self.layers(embeddings)


def load_aesthetic_head(head_path: str | os.PathLike, in_features: int) -> AestheticHead:
    """An eval-mode, frozen :class:`AestheticHead` from a ``.safetensors`` file or a torch ``state_dict`` file
    (loaded with ``weights_only=True``), on the CPU in float32.

    Raises:
        ValueError: not a file, unreadable, or its tensors do not fit a head with ``in_features`` inputs.
    """
    path = local_file(head_path, "head_path", "the improved-aesthetic-predictor head (e.g. "
                       "sac+logos+ava1-l14-linearMSE.pth or a .safetensors export)")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path), device="cpu")
        else:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as error:  # safetensors / pickle raise their own error types for a corrupt file
        raise ValueError(f"could not read the aesthetic head {str(path)!r}: {error}") from error
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    head = AestheticHead(in_features)
    if not isinstance(state, dict):
        raise ValueError(f"{str(path)!r} does not hold a state dict, got {type(state).__name__}")
    try:
        head.load_state_dict(state, strict=True)
    except RuntimeError as error:
        raise ValueError(f"{str(path)!r} is not an aesthetic head for {in_features}-d CLIP embeddings "
                         f"(expected keys {sorted(head.state_dict())}): {error}") from error
    head.eval().requires_grad_(False)
    return head


class AestheticScorer(TransformersClip):
    """LAION aesthetic score: the improved-aesthetic-predictor MLP on the L2-normalised CLIP image embedding
    (predicted 1..10 rating; the prompt is not used).

    Args:
        model_path: local directory of the CLIP model, ``openai/clip-vit-large-patch14`` for the released head.
        head_path: the head weights, ``.safetensors`` or a torch state-dict file (``sac+logos+ava1-l14-linearMSE.pth``).
        processor_path, device, dtype, batch_size: as :class:`~flowforge.rewards.scorers.pickscore.PickScore`.
            The head runs in float32.

    Raises:
        ValueError: a missing path, a bad option, a head whose input size is not the CLIP projection dim.
    """

    name = "aesthetic"

    def __init__(self, model_path: str | os.PathLike | None = None, head_path: str | os.PathLike | None = None,
                 processor_path: str | os.PathLike | None = None, *, device: str | torch.device = "cpu",
                 dtype: str | torch.dtype = "float32", batch_size: int = 32) -> None:
        local_file(head_path, "head_path", "the improved-aesthetic-predictor head")
        super().__init__(model_path, processor_path, device=device, dtype=dtype, batch_size=batch_size,
                         model_hint="openai/clip-vit-large-patch14")
        self.head = load_aesthetic_head(head_path, int(self.model.config.projection_dim)).to(self.device)

    @torch.no_grad()
    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """``media [B, 3, H, W]`` in [0, 1] -> ``[B]`` float32 predicted rating on ``media``'s device."""
        if check_inputs(media, prompts, metadata) == 0:
            return torch.empty(0, dtype=torch.float32, device=media.device)
        return self.head(self.image_embeddings(media)).squeeze(1).float().to(media.device)
