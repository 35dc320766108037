"""The model protocol every adapter implements, and the conditioning record it consumes.

flowforge never talks to a diffusers / transformers model directly outside ``flowforge/models``: the rollout loop,
the objectives and the trainer only see a :class:`FlowModel`. An adapter owns one model family's quirks (native
timestep unit, text encoders, VAE scaling, guidance) and exposes the flow-matching convention below. The members
the rest of flowforge may use are exactly those of :class:`FlowModel` (six required, seven optional hooks whose
defaults live in :class:`AdapterMixin`) and, for image-conditioned tasks, :class:`ImageConditioned`.

Conventions (docs/architecture.md, "Conventions")
-------------------------------------------------

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
CFG                 ``v = v_u + g * (v_c - v_u)`` with ``v_u`` from ``cond.negative`` where the family's pipeline runs
                    CFG (:meth:`AdapterMixin.guidance_use`: ``g > 1`` for most); otherwise conditional only
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
    CFG branches see the same image, so ``negative.image`` stays ``None``. ``image_grids`` (reference-image families
given images at their own sizes: FLUX.2, Qwen-Image-Edit-Plus) is the token grid of each of a row's condition images;
rows may then differ in how many image tokens they have: ``image`` holds each row's tokens from position 0,
zero-padded to the longest row (:meth:`cat` pads), and the adapter runs rows of one layout together.

    All row operations (:meth:`index`, :meth:`repeat_interleave`, :meth:`cat`) apply to ``negative`` as well.
    """

    prompt_embeds: Tensor  # [B, S, D]
    pooled: Tensor | None = None  # [B, P]
    mask: Tensor | None = None  # [B, S] (1 = real token, 0 = padding)
    negative: Conditioning | None = None  # same batch size; for CFG
    image: Tensor | None = None  # [B, *condition] encoded condition image (i2v / i2i), adapter layout
    image_grids: Tensor | None = None  # [B, K, 2] int64 (rows, cols) token grid of each condition image; (0, 0) pads

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
        if self.image_grids is not None and (self.image is None or self.image_grids.ndim != 3
                                             or tuple(self.image_grids.shape[::2]) != (batch, 2)):
            raise ValueError(f"image_grids must be [B={batch}, K, 2] beside an image, got "
                             f"{tuple(self.image_grids.shape)}")

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
            image_grids=_index_rows(self.image_grids, idx),
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
            if not all(present):
                return None
            if name in ("image", "image_grids"):  # rows of different token counts / image counts: zero-padded
                longest = max(v.shape[1] for v in values)
                values = [torch.nn.functional.pad(v, (0, 0) * (v.ndim - 2) + (0, longest - v.shape[1]))
                          if v.ndim >= 2 and v.shape[1] < longest else v for v in values]
            return torch.cat(values, dim=0)

        negatives = [c.negative for c in items]
        if any(n is not None for n in negatives) and not all(n is not None for n in negatives):
            raise ValueError("cannot cat Conditioning records where only some have 'negative'")
        return Conditioning(
            prompt_embeds=cat_field("prompt_embeds"),
            pooled=cat_field("pooled"),
            mask=cat_field("mask"),
            negative=Conditioning.cat(negatives) if negatives[0] is not None else None,
            image=cat_field("image"),
            image_grids=cat_field("image_grids"),
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
            image_grids=move(self.image_grids, False),
        )


REQUIRED_MEMBERS = ("transformer", "blocks", "encode", "latent_shape", "velocity", "decode")
"""The members of :class:`FlowModel` every adapter implements itself (no default)."""

HOOK_MEMBERS = ("encoder_id", "release_text_encoder", "lora_targets", "pipeline_sigmas",
                "enable_gradient_checkpointing", "condition_index", "generated_index")
"""The optional members of :class:`FlowModel`: :class:`AdapterMixin` gives each a default."""


@runtime_checkable
class FlowModel(Protocol):
    """What the rest of flowforge needs from a generator (docs/architecture.md, "The adapter contract").

    Six required members (:data:`REQUIRED_MEMBERS`, no ``*args`` / ``**kwargs``) and seven optional hooks
    (:data:`HOOK_MEMBERS`) whose defaults come from :class:`AdapterMixin`. The loop, the policy bank, the rollout,
    the exporter and SFT use nothing else, and use these members directly: an adapter (built-in or
    ``"pkg.module:Class"``) inherits :class:`AdapterMixin` or defines every hook itself;
    :func:`flowforge.models.build_adapter` refuses one that does not (``isinstance(adapter, FlowModel)``).
    """

    # -------------------------------------------------------------------------------------------- required
    transformer: nn.Module  # the trainable module (LoRA / FSDP target); the policy bank may swap it for a copy

    def blocks(self) -> list[nn.Module]:
        """Units for ``fully_shard`` and activation checkpointing (the transformer blocks, in order)."""
        ...

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """Encode prompts with the frozen text encoder(s); ``negative`` holds the negative-prompt encoding."""
        ...

    def latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """Per-sample latent shape (without batch) for ``height x width`` pixels (``frames`` for video)."""
        ...

    def velocity(self, x: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Predicted velocity ``noise - x0`` (fp32, shape of ``x``) at ``x [B, *latent]``, ``sigma [B]`` in [0, 1]."""
        ...

    def decode(self, latents: Tensor) -> Tensor:
        """Latents → images ``[B, 3, H, W]`` (video ``[B, 3, F, H, W]``) float32 in [0, 1]."""
        ...

    # -------------------------------------------------------------------------------------------- hooks
    lora_targets: tuple[str, ...]  # module-name suffixes LoRA wraps when lora.targets is unset; default ()
    condition_index: tuple[slice, ...] | None  # condition slot of a batched latent (ImageConditioned); default None
    generated_index: tuple[slice, ...]  # elements the rollout generates; default (slice(None),): the whole latent

    @property
    def encoder_id(self) -> str:
        """Cache key of :meth:`encode` (:func:`flowforge.data.preprocess.encode_cached`)."""
        ...

    def release_text_encoder(self) -> None:
        """Free the text encoder's weights once the prompts are encoded."""
        ...

    def pipeline_sigmas(self, num_steps: int, height: int, width: int) -> Tensor | None:
        """The family pipeline's own ``[T+1]`` schedule, or ``None`` (use ``sampler``)."""
        ...

    def enable_gradient_checkpointing(self) -> None:
        """Recompute the activations of :meth:`blocks` in the backward pass."""
        ...


@runtime_checkable
class ImageConditioned(Protocol):
    """Optional extension of :class:`FlowModel` for image-conditioned tasks (i2v / i2i).

    Two ways to consume ``cond.image``. *Inside the latent* (Wan i2v): the loop (:mod:`flowforge.rollout`,
    :mod:`flowforge.objectives`) writes ``cond.image`` into ``x[condition_index]`` at the start of every rollout and
    of every forward-process visit, applies transitions to ``x[generated_index]`` only (so the slot never moves: it
    is re-pinned after every step by construction) and takes every log-prob and loss over ``x[generated_index]``
    only (the slot has no gradient path). *Inside the velocity* (FLUX.1 Kontext, Qwen-Image-Edit: extra image
    tokens): ``condition_index = None`` and the whole latent is generated. ``condition_index`` /
    ``generated_index`` are :class:`FlowModel` hooks (defaults: no slot, whole latent); what makes an adapter
    image-conditioned is :meth:`condition_on_images`, which :func:`flowforge.train.preflight.preflight` looks for on
    the adapter class."""

    condition_index: tuple[slice, ...] | None  # index of the condition slot in a batched latent; None: no slot
    generated_index: tuple[slice, ...]  # index of the generated elements in a batched latent

    def condition_on_images(self, cond: Conditioning, prompts: Sequence[str], images: Tensor,
                            latent_shape: Sequence[int]) -> Conditioning:
        """``cond`` -- the text conditioning of ``prompts``, one row per image -- conditioned on ``images
        [N, 3, H, W]`` float32 in [0, 1] for latents of ``latent_shape`` (an adapter with ``takes_original_images =
        True`` is given each row's list of condition images as opened, PIL RGB at their own sizes, and resizes them
        as its pipeline does; ``max_condition_images``: how many a row may list, ``None`` = no limit): sets
        ``cond.image`` (``[N, *slot]`` when
        the adapter has a condition slot, ``x[condition_index]`` being ``[B, *slot]``) and may replace other
        fields (image tokens in ``pooled``; prompts re-encoded by a text encoder that reads the image)."""
        ...


@runtime_checkable
class AudioDecoding(Protocol):
    """Optional extension of :class:`FlowModel` for audio-video families (LTX-2), whose latent also holds the sound:
    :meth:`FlowModel.decode` gives the video, :meth:`decode_audio` the waveform. The trainer decodes both at the
    rollout boundary (:func:`flowforge.rollout.media.decode_audio`) and hands the waveform to the scorers that take
    audio, and the eval report plays it."""

    def decode_audio(self, latents: Tensor) -> tuple[Tensor, int]:
        """Clean latents ``[B, *latent]`` -> ``(waveform [B, C, T] float32, sample_rate in Hz)``."""
        ...


class AdapterMixin:
    """The defaults of :class:`FlowModel`'s optional hooks, and what every diffusers-backed adapter shares (the
    transformer's ``config`` / ``dtype`` / ``device``).

    Expects ``transformer``; ``text_encoder`` (an object with ``encoder_id`` and optionally ``release()``, or
    ``None``) and ``negative_prompt`` when the adapter encodes text. Override a hook by defining it on the adapter
    class (a class attribute, property or method of the same name).
    """

    lora_targets: tuple[str, ...] = ()
    """Module-name suffixes (peft ``target_modules``) that LoRA wraps when ``lora.targets`` is unset, e.g.
    ``("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")``. Default ``()``: none declared, so a LoRA run
    must set ``lora.targets`` (an empty list is refused by :func:`flowforge.models.lora.inject_lora`)."""

    condition_index: tuple[slice, ...] | None = None
    """Index of the condition slot in a batched latent ``[B, *latent]`` (e.g. ``(slice(None), slice(None),
    slice(0, 1))``: latent frame 0), written from ``cond.image`` before every step. Default ``None``: no slot (t2i,
    t2v, or an image consumed inside the velocity)."""

    generated_index: tuple[slice, ...] = (slice(None),)
    """Index of the elements the rollout steps and every log-prob / loss covers: the complement of
    :attr:`condition_index`. Default ``(slice(None),)``: the whole latent."""

    takes_original_images: bool = False  # ImageConditioned: given PIL images as opened, not resized tensors
    max_condition_images: int | None = 1  # ImageConditioned: condition images a prompt may list (None: any)

    sampler_options: tuple[str, ...] = ()
    """``sampler`` keys (of :data:`flowforge.settings.sections.MODEL_OPTIONS`) this family reads: each is an
    attribute the trainer sets from the config when the key is set (:func:`flowforge.models.set_sampler_options`);
    unset keys keep the adapter's defaults, which are its pipeline's. Default ``()``: none."""

    cfg_rule: str = "guidance_scale > 1"
    """The family pipeline's rule for running classifier-free guidance, in words (preflight's warning quotes it);
    :meth:`guidance_use` is that rule as code. Override both together."""

    def guidance_use(self, guidance_scale: float) -> str:
        """What the family's pipeline does with ``guidance_scale``: ``"cfg"`` (unconditional and conditional branch
        combined), ``"embedded"`` (the value is a transformer input, one forward: guidance-distilled models) or
        ``"off"`` (the conditional forward alone, whatever the value). :meth:`FlowModel.velocity` follows it, so a
        value the pipeline treats as "no CFG" gives the pipeline's result, and preflight warns about a value that
        means "off" (:func:`flowforge.train.preflight.loaded.guidance_warnings`). Default: the diffusers rule
        ``guidance_scale > 1`` (``do_classifier_free_guidance`` of the SD3 / Wan pipelines, ``true_cfg_scale > 1``
        of FLUX.1 / Qwen-Image)."""
        return "cfg" if float(guidance_scale) > 1.0 else "off"

    def require_vae(self, use: str | None = None) -> nn.Module:
        """The adapter's ``vae`` (the guard of every VAE call: an adapter may be built without one, e.g. around a bare
        transformer for export verification).

        Raises:
            RuntimeError: ``this <Class> has no VAE`` (``; <use> is unavailable`` appended when ``use`` is given).
        """
        vae = getattr(self, "vae", None)
        if vae is None:
            raise RuntimeError(f"this {type(self).__name__} has no VAE" + (f"; {use} is unavailable" if use else ""))
        return vae

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
        """Cache key of :meth:`FlowModel.encode` (see :func:`flowforge.data.preprocess.encode_cached`): it must
        change whenever the encodings would. Default: ``"<text_encoder.encoder_id>|negative=<negative_prompt!r>"``;
        ``"none"`` once ``text_encoder`` is ``None``; the class name for an adapter without a ``text_encoder``
        attribute (override it when such an adapter's encodings depend on weights or settings)."""
        if not hasattr(self, "text_encoder"):
            return type(self).__name__
        if self.text_encoder is None:
            return "none"
        return f"{self.text_encoder.encoder_id}|negative={self.negative_prompt!r}"

    def release_text_encoder(self) -> None:
        """Free the text encoder's weights after the trainer has encoded (and cached) its prompts. Default: call
        ``text_encoder.release()`` when it has one (a directory-backed encoder reloads lazily on the next
        ``encode``), else nothing."""
        release = getattr(getattr(self, "text_encoder", None), "release", None)
        if release is not None:
            release()

    def pipeline_sigmas(self, num_steps: int, height: int, width: int) -> Tensor | None:
        """The family pipeline's exact ``[num_steps + 1]`` fp32 schedule (sigmas in [0, 1], ending in 0) for
        ``height x width`` pixels, used by the trainer for ``sampler.schedule="dynamic"`` without ``sampler.mu``.
        Default ``None``: the family has no resolution-dependent pipeline schedule; the ``sampler`` section's own
        schedule is used."""
        return None

    def enable_gradient_checkpointing(self) -> None:
        """Recompute the activations of :meth:`FlowModel.blocks` in the backward pass
        (``distributed.activation_checkpointing``). Default: diffusers' ``ModelMixin.enable_gradient_checkpointing``
        on :attr:`transformer`, which keeps parameter names (so LoRA / FSDP / checkpoints are unaffected); override
        it for a transformer that is not a diffusers model."""
        self.transformer.enable_gradient_checkpointing()


def frozen(module: nn.Module | None) -> nn.Module | None:
    """``module`` in eval mode with ``requires_grad=False`` on every parameter (a frozen pipeline component: VAE,
    image encoder, vocoder), or ``None`` for ``None``."""
    return None if module is None else module.eval().requires_grad_(False)


def missing_members(adapter: object) -> list[str]:
    """The :class:`FlowModel` members (required and hooks) ``adapter`` lacks, in declaration order."""
    return [name for name in (*REQUIRED_MEMBERS, *HOOK_MEMBERS) if not hasattr(adapter, name)]


def check_condition_slot(adapter: object) -> None:
    """Refuse an adapter that declares a condition slot but not which elements it generates.

    Raises:
        TypeError: ``adapter.condition_index`` is not ``None`` while ``generated_index`` is missing or ``None``
            (the slot would be stepped and trained as if generated).
    """
    if getattr(adapter, "condition_index", None) is not None and getattr(adapter, "generated_index", None) is None:
        raise TypeError(f"{type(adapter).__name__} declares condition_index but no generated_index; an "
                        "ImageConditioned adapter with a condition slot must declare both")
