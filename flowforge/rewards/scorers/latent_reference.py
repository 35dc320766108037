"""``latent_reference``: closeness of the generated latents to a reference latent, scored without any decode.

A latent scorer (``takes_latents = True``, :mod:`flowforge.rewards.base`): it reads the rollout's clean latents
``x_0`` ``[B, *latent]`` (``[B, C, h, w]`` images, ``[B, C, F, h, w]`` video), so a run whose scorers are all latent
ones runs no VAE decode in its rollout. The references come from one safetensors file:

* without ``key``: the file holds exactly one tensor ``[*latent]``, the reference of every sample;
* with ``key`` (a metadata key, e.g. ``digit``): one tensor per value, named ``str(metadata[key])``; a sample whose
  value has no tensor in the file, or has no such key, scores NaN ("not applicable").

=====================  =====================================================================================
``metric="mse"``       ``-mean_e (x_e - r_e)^2`` over the latent elements ``e``: 0 at the reference, lower apart
``metric="cosine"``    ``<x, r> / (||x|| ||r||)`` over the flattened latents, in [-1, 1]
=====================  =====================================================================================

Both are computed in float32 on the latents' device. On the embedded digits default (a pixel-space model: its
latents are the pixels in [-1, 1], ``[1, 32, 32]``) a file of the ten per-digit mean images with ``key: digit``
rewards samples near the typical shape of the requested digit (``docs/guides/latent-and-audio-rewards.md`` builds that
file).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

METRICS = ("mse", "cosine")


class LatentReference:
    """Scores ``[B, *latent]`` latents against the reference(s) in ``reference`` (module docstring).

    Args:
        reference: path of a safetensors file of reference latents (float, ``[*latent]`` each).
        key: metadata key whose value (as ``str``) names each sample's reference; ``None``: the file's one tensor.
        metric: ``"mse"`` (negative mean squared error) or ``"cosine"`` (cosine similarity).

    Raises:
        ValueError: an unknown ``metric``; a file that is missing or not safetensors; without ``key``, a file that
            does not hold exactly one tensor; a reference that is not floating point.
    """

    name = "latent_reference"
    needs_group = False
    takes_latents = True

    def __init__(self, reference: str, key: str | None = None, metric: str = "mse") -> None:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        if metric not in METRICS:
            raise ValueError(f"reward.options.latent_reference.metric must be one of {list(METRICS)}, got {metric!r}")
        path = Path(reference).expanduser()
        if not path.is_file():
            raise ValueError(f"reward.options.latent_reference.reference: no file at {str(path)!r}")
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"reward.options.latent_reference.reference: {str(path)!r} is not a safetensors file "
                             f"({exc})") from None
        if key is None and len(tensors) != 1:
            raise ValueError(f"reward.options.latent_reference: {str(path)!r} holds {len(tensors)} tensors "
                             f"({sorted(tensors)[:5]}...); without key it must hold exactly one")
        bad = sorted(n for n, t in tensors.items() if not t.is_floating_point())
        if bad:
            raise ValueError(f"reward.options.latent_reference: references {bad} are not floating point")
        self.references = {n: t.float() for n, t in tensors.items()}
        self.key, self.metric = key, metric

    def _reference(self, meta: dict[str, Any]) -> Tensor | None:
        if self.key is None:
            return next(iter(self.references.values()))
        return self.references.get(str(meta[self.key])) if self.key in meta else None

    def __call__(self, latents: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """Scores ``[B]`` float32 on ``latents``' device (NaN where a sample has no reference).

        Args:
            latents: ``[B, *latent]`` floating clean latents. prompts / metadata: ``B`` entries each.

        Raises:
            ValueError: ``latents`` not a floating ``[B, ...]`` tensor of ``len(prompts)`` rows; a reference of
                another shape than ``latents[i]``.
        """
        if not isinstance(latents, Tensor) or latents.dim() < 2 or not latents.is_floating_point():
            raise ValueError(f"latent_reference takes floating [B, *latent] latents, got "
                             f"{getattr(latents, 'shape', type(latents).__name__)}")
        if latents.shape[0] != len(prompts) or len(metadata) != len(prompts):
            raise ValueError(f"latents, prompts and metadata must have one entry per sample, got "
                             f"{latents.shape[0]}, {len(prompts)}, {len(metadata)}")
        refs = [self._reference(m) for m in metadata]
        scores = torch.full((latents.shape[0],), float("nan"), dtype=torch.float32, device=latents.device)
        rows = [i for i, r in enumerate(refs) if r is not None]
        if not rows:
            return scores
        wrong = next((refs[i].shape for i in rows if refs[i].shape != latents.shape[1:]), None)
        if wrong is not None:
            raise ValueError(f"latent_reference: a reference of shape {tuple(wrong)} for latents of shape "
                             f"{tuple(latents.shape[1:])} (the model's latent_shape at this height / width)")
        x = latents[rows].detach().float().flatten(1)  # [n, D]
        r = torch.stack([refs[i] for i in rows]).to(x.device).flatten(1)  # [n, D]
        if self.metric == "mse":
            out = -(x - r).pow(2).mean(dim=1)
        else:
            out = torch.nn.functional.cosine_similarity(x, r, dim=1)
        scores[torch.tensor(rows, device=latents.device)] = out
        return scores
