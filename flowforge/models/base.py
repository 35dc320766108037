"""The model protocol every adapter implements, and the conditioning record it consumes.

flowforge never talks to a diffusers / transformers model directly outside ``flowforge/models``: the rollout loop,
the objectives and the trainer only see a :class:`FlowModel`. An adapter owns one model family's quirks (native
timestep unit, text encoders, VAE scaling, guidance) and exposes the flow-matching convention below.

Conventions (DESIGN.md §1)
--------------------------

==================  ==========================================================================================
symbol              meaning
==================  ==========================================================================================
``x0``              clean latent (or pixels in [-1, 1] for pixel-space models), ``[B, C, H, W]``
``noise``           standard Gaussian, same shape as ``x0``
``sigma``           noise level in [0, 1], ``1`` = pure noise; ``sigma`` tensors are ``[B]`` float
``x_sigma``         ``(1 - sigma) * x0 + sigma * noise``
``v``               velocity ``noise - x0`` = ``d x_sigma / d sigma``; what :meth:`FlowModel.velocity` returns (fp32)
Euler step          ``x_next = x + (sigma_next - sigma) * v`` with ``sigma_next < sigma`` (``dt < 0``)
native timestep     the value the network is fed; only the adapter knows it (SD3: ``1000 * sigma``)
CFG                 ``v = v_u + g * (v_c - v_u)`` with ``v_u`` from ``cond.negative``; ``g == 1`` is conditional only
==================  ==========================================================================================

The name ``t`` is never used for 0–1000 values outside an adapter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn


def _index_rows(tensor: Tensor | None, idx: Tensor) -> Tensor | None:
    return None if tensor is None else tensor.index_select(0, idx.to(tensor.device))


@dataclasses.dataclass(frozen=True)
class Conditioning:
    """Text conditioning of a batch, as produced by :meth:`FlowModel.encode`.

    The fields are whatever the adapter's transformer consumes; for SD3-style models ``prompt_embeds`` is the
    joint-attention context and ``pooled`` the pooled-projection vector. ``negative`` is the unconditional
    (empty / negative prompt) conditioning used for classifier-free guidance; it has the same batch size.

    ``image`` is the encoded condition image of image-conditioned tasks (i2v / i2i), in the layout the adapter's
    :meth:`ImageConditioned.condition_on_images` sets (Wan i2v: the values of the latent's condition slot;
    FLUX.1 Kontext i2i: packed image tokens the velocity appends to the image stream); ``None`` for t2i / t2v. Both
    CFG branches see the same image, so ``negative.image`` stays ``None``.

    All row operations (:meth:`index`, :meth:`repeat_interleave`, :meth:`cat`) apply to ``negative`` as well.
    """

    prompt_embeds: Tensor  # [B, S, D]
    pooled: Tensor | None = None  # [B, P]
    mask: Tensor | None = None  # [B, S] (1 = real token, 0 = padding)
    negative: Conditioning | None = None  # same batch size; for CFG
    image: Tensor | None = None  # [B, *condition] encoded condition image (i2v / i2i), adapter layout

    def __post_init__(self) -> None:
        batch = self.prompt_embeds.shape[0]
        if self.prompt_embeds.ndim != 3:
            raise ValueError(f"prompt_embeds must be [B, S, D], got shape {tuple(self.prompt_embeds.shape)}")
        if self.pooled is not None and (self.pooled.ndim != 2 or self.pooled.shape[0] != batch):
            raise ValueError(f"pooled must be [B={batch}, P], got shape {tuple(self.pooled.shape)}")
        if self.mask is not None and tuple(self.mask.shape) != tuple(self.prompt_embeds.shape[:2]):
            raise ValueError(
                f"mask must be [B, S] = {tuple(self.prompt_embeds.shape[:2])}, got {tuple(self.mask.shape)}"
            )
        if self.negative is not None and self.negative.batch_size != batch:
            raise ValueError(f"negative has batch size {self.negative.batch_size}, expected {batch}")
        if self.image is not None and self.image.shape[0] != batch:
            raise ValueError(f"image has batch size {self.image.shape[0]}, expected {batch}")

    @property
    def batch_size(self) -> int:
        return int(self.prompt_embeds.shape[0])

    def __len__(self) -> int:
        return self.batch_size

    def index(self, idx: Tensor | Sequence[int] | slice) -> Conditioning:
        """Select rows ``idx`` (int tensor / list of ints / slice / bool mask) of every field."""
        if isinstance(idx, slice):
            idx = torch.arange(self.batch_size)[idx]
        idx = torch.as_tensor(idx)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().flatten()
        idx = idx.long().flatten()
        return Conditioning(
            prompt_embeds=_index_rows(self.prompt_embeds, idx),
            pooled=_index_rows(self.pooled, idx),
            mask=_index_rows(self.mask, idx),
            negative=None if self.negative is None else self.negative.index(idx),
            image=_index_rows(self.image, idx),
        )

    def repeat_interleave(self, k: int) -> Conditioning:
        """Repeat every row ``k`` times consecutively (``[a, b] -> [a, a, b, b]`` for ``k = 2``): prompts → groups."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        return self.index(torch.arange(self.batch_size).repeat_interleave(k))

    @staticmethod
    def cat(items: Sequence[Conditioning]) -> Conditioning:
        """Concatenate along the batch. All items must agree on which optional fields are present."""
        items = list(items)
        if not items:
            raise ValueError("cat needs at least one Conditioning")

        def cat_field(name: str) -> Tensor | None:
            values = [getattr(c, name) for c in items]
            present = [v is not None for v in values]
            if any(present) and not all(present):
                raise ValueError(f"cannot cat Conditioning records where only some have {name!r}")
            return torch.cat(values, dim=0) if all(present) else None

        negatives = [c.negative for c in items]
        if any(n is not None for n in negatives) and not all(n is not None for n in negatives):
            raise ValueError("cannot cat Conditioning records where only some have 'negative'")
        return Conditioning(
            prompt_embeds=cat_field("prompt_embeds"),
            pooled=cat_field("pooled"),
            mask=cat_field("mask"),
            negative=Conditioning.cat(negatives) if negatives[0] is not None else None,
            image=cat_field("image"),
        )

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Conditioning:
        """Move to ``device``; the embeddings are cast to ``dtype`` when given (``mask`` and ``image`` keep theirs:
        the condition image stays fp32 like the latents it is written into)."""

        def move(t: Tensor | None, floating: bool) -> Tensor | None:
            if t is None:
                return None
            return t.to(device=device, dtype=dtype if (floating and dtype is not None) else t.dtype)

        return Conditioning(
            prompt_embeds=move(self.prompt_embeds, True),
            pooled=move(self.pooled, True),
            mask=move(self.mask, False),
            negative=None if self.negative is None else self.negative.to(device, dtype),
            image=move(self.image, False),
        )


@runtime_checkable
class FlowModel(Protocol):
    """What the rest of flowforge needs from a generator (DESIGN.md §3). Six members, no ``*args`` / ``**kwargs``."""

    transformer: nn.Module  # the trainable module (LoRA / FSDP target)

    def blocks(self) -> list[nn.Module]:
        """Units for ``fully_shard`` and activation checkpointing (the transformer blocks)."""
        ...

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """Encode prompts with the frozen text encoder(s); ``negative`` holds the empty-prompt encoding."""
        ...

    def latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """Per-sample latent shape (without batch) for an image of ``height x width`` pixels."""
        ...

    def velocity(self, x: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Predicted velocity ``noise - x0`` (fp32, shape of ``x``) at ``x [B, *latent]``, ``sigma [B]`` in [0, 1]."""
        ...

    def decode(self, latents: Tensor) -> Tensor:
        """Latents → images ``[B, 3, H, W]`` (video ``[B, 3, F, H, W]``) float32 in [0, 1]."""
        ...


@runtime_checkable
class ImageConditioned(Protocol):
    """Optional extension of :class:`FlowModel` for image-conditioned tasks whose condition lives *inside the
    latent* (Wan i2v). The loop (:mod:`flowforge.rollout`, :mod:`flowforge.objectives`) writes ``cond.image`` into
    ``x[condition_index]`` at the start of every rollout and of every forward-process visit, applies transitions
    to ``x[generated_index]`` only (so the slot never moves: it is re-pinned after every step by construction) and
    takes every log-prob and loss over ``x[generated_index]`` only (the slot has no gradient path). An adapter
    without these members is treated as all-generated. An adapter that consumes ``cond.image`` inside its velocity
    instead (FLUX.1 Kontext: extra image tokens) sets ``condition_index = None`` and generates the whole latent."""

    condition_index: tuple[slice, ...] | None  # index of the condition slot in a batched latent; None: no slot
    generated_index: tuple[slice, ...]  # index of the generated elements in a batched latent

    def condition_on_images(self, cond: Conditioning, prompts: Sequence[str], images: Tensor,
                            latent_shape: Sequence[int]) -> Conditioning:
        """``cond`` -- the text conditioning of ``prompts``, one row per image -- conditioned on ``images
        [N, 3, H, W]`` float32 in [0, 1] for latents of ``latent_shape``: sets ``cond.image`` (``[N, *slot]`` when
        the adapter has a condition slot, ``x[condition_index]`` being ``[B, *slot]``) and may replace other
        fields (image tokens in ``pooled``; prompts re-encoded by a text encoder that reads the image)."""
        ...


class AdapterMixin:
    """What every diffusers-backed adapter shares: the transformer's config / dtype / device, the text-encoder cache
    key and releasing the text encoder. Expects ``transformer``, ``text_encoder`` and ``negative_prompt``."""

    @property
    def config(self):
        return self.transformer.config

    @property
    def dtype(self) -> torch.dtype:
        return next(self.transformer.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def encoder_id(self) -> str:
        """Cache key of the text encoder + negative prompt (see :func:`flowforge.data.preprocess.encode_cached`)."""
        if self.text_encoder is None:
            return "none"
        return f"{self.text_encoder.encoder_id}|negative={self.negative_prompt!r}"

    def release_text_encoder(self) -> None:
        """Free the text encoder's weights (a directory-backed encoder reloads lazily on the next ``encode``)."""
        release = getattr(self.text_encoder, "release", None)
        if release is not None:
            release()
