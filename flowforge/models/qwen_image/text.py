"""Qwen-Image's text conditioning: the Qwen2.5-VL of a Qwen-Image / -Edit / -Edit-Plus pipeline, called through the
pipeline's own ``encode_prompt`` (see :mod:`flowforge.models.qwen_image.adapter` for the conventions and the pipeline
lines they were checked against), and the condition-image helpers the Edit pipelines and FLUX.2 share.

Embeddings: ``[N, max_sequence_length, D]`` in the text encoder's dtype, masks ``[N, max_sequence_length]`` int64
(zero-padded rows; the pipelines do not truncate, so a longer encoding raises ``ValueError``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from flowforge.models.common import DEFAULT_MIN_TOKENIZER_SIZE, PipelineText
from flowforge.models.reference_images import (  # noqa: F401 (condition_pil_images / image_sets re-exported)
    condition_pil_images,
    image_sets,
    pil_rows,
)


def _pad_rows(embeds: Tensor, mask: Tensor | None, max_sequence_length: int) -> tuple[Tensor, Tensor]:
    """Zero-pad ``[B, S, D]`` rows (and their mask, ``None`` = all real) to ``max_sequence_length``."""
    b, s, d = embeds.shape
    if s > max_sequence_length:
        raise ValueError(f"the prompts encode to {s} tokens, more than max_sequence_length={max_sequence_length} "
                         "(Qwen-Image-Edit counts the image tokens too); raise max_sequence_length (at most 1024)")
    if mask is None:  # the pipeline drops an all-ones mask
        mask = torch.ones(b, s, dtype=torch.long, device=embeds.device)
    pad = max_sequence_length - s
    embeds = torch.cat([embeds, embeds.new_zeros(b, pad, d)], dim=1)
    mask = torch.cat([mask.long(), mask.new_zeros(b, pad).long()], dim=1)
    return embeds, mask


def _qwen_encode_fn(max_sequence_length: int):
    def encode(pipe, prompts: list[str]) -> tuple[Tensor, Tensor, None]:
        embeds, mask = pipe.encode_prompt(prompt=prompts, device=pipe.device, num_images_per_prompt=1,
                                          max_sequence_length=max_sequence_length)
        return (*_pad_rows(embeds, mask, max_sequence_length), None)

    return encode


def _qwen_edit_text_only_fn(max_sequence_length: int):
    """Text-only encoding on an Edit pipeline's Qwen2.5-VL: ``QwenImagePipeline.encode_prompt`` (t2i template) on the
    same tokenizer / text encoder (the Edit template needs an image; see the module docstring)."""
    t2i = _qwen_encode_fn(max_sequence_length)

    def encode(pipe, prompts: list[str]) -> tuple[Tensor, Tensor, None]:
        from diffusers import QwenImagePipeline

        text_only = QwenImagePipeline(scheduler=pipe.scheduler, vae=None, text_encoder=pipe.text_encoder,
                                      tokenizer=pipe.tokenizer, transformer=None)
        return t2i(text_only, prompts)

    return encode


def _check_max_sequence_length(max_sequence_length: int) -> int:
    if not 1 <= max_sequence_length <= 1024:
        raise ValueError(f"max_sequence_length must be in 1..1024 (QwenImagePipeline's limit), got "
                         f"{max_sequence_length}")
    return int(max_sequence_length)


def qwen_image_text(*, path: str | Path | None = None, components: dict[str, Any] | None = None,
                    max_sequence_length: int = 512, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, encoder_id: str | None = None,
                    min_tokenizer_size: int = DEFAULT_MIN_TOKENIZER_SIZE) -> PipelineText:
    """Qwen2.5-VL of a Qwen-Image pipeline (directory ``path`` or ``components`` with ``tokenizer`` and
    ``text_encoder``) through ``QwenImagePipeline.encode_prompt``; rows zero-padded to ``max_sequence_length``."""
    max_sequence_length = _check_max_sequence_length(max_sequence_length)
    return PipelineText("QwenImagePipeline", _qwen_encode_fn(max_sequence_length), path=path,
                        components=components, device=device, dtype=dtype,
                        settings=f"max_len={max_sequence_length}", encoder_id=encoder_id,
                        min_tokenizer_size=min_tokenizer_size)


class _QwenEditText(PipelineText):
    """The Qwen2.5-VL (+ ``processor``) of an Edit pipeline class ``pipeline_class``: its prompts-only encoding is
    ``text_only_fn(max_sequence_length)``; subclasses add ``encode_with_images``."""

    pipeline_class: str
    text_only_fn: Any

    def __init__(self, *, path: str | Path | None = None, components: dict[str, Any] | None = None,
                 max_sequence_length: int = 512, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, encoder_id: str | None = None,
                 min_tokenizer_size: int = DEFAULT_MIN_TOKENIZER_SIZE):
        self.max_sequence_length = _check_max_sequence_length(max_sequence_length)
        super().__init__(self.pipeline_class, self.text_only_fn(self.max_sequence_length), path=path,
                         components=components, device=device, dtype=dtype,
                         settings=f"max_len={self.max_sequence_length}", encoder_id=encoder_id,
                         min_tokenizer_size=min_tokenizer_size)


class QwenImageEditText(_QwenEditText):
    """Qwen2.5-VL + ``processor`` of a Qwen-Image-Edit pipeline (directory ``path`` or ``components`` with
    ``tokenizer``, ``text_encoder`` and ``processor``), used through ``QwenImageEditPipeline.encode_prompt``.

    :meth:`encode_with_images` is the Edit conditioning (prompt + image); :meth:`encode` (prompts only) uses the t2i
    template (see the module docstring). Rows are zero-padded to ``max_sequence_length``; the Edit pipeline does not
    truncate, so a longer encoding raises.
    """

    pipeline_class = "QwenImageEditPipeline"
    text_only_fn = staticmethod(_qwen_edit_text_only_fn)

    @torch.no_grad()
    def encode_with_images(self, prompts: Sequence[str], images: Tensor) -> tuple[Tensor, Tensor, None]:
        """``prompts[i]`` read with ``images[i]`` (``[N, 3, H, W]`` float in [0, 1]) ->
        ``(embeds [N, max_sequence_length, D], mask [N, max_sequence_length] int64, None)``.

        Raises:
            ValueError: not one image per prompt; an encoding longer than ``max_sequence_length``.
        """
        if isinstance(prompts, str):
            raise TypeError("prompts must be a sequence of strings, not a single string")
        prompts = list(prompts)
        if len(prompts) != images.shape[0]:
            raise ValueError(f"{len(prompts)} prompts but {images.shape[0]} images: one image per prompt")
        pipe = self.pipeline
        embeds, mask = pipe.encode_prompt(prompt=prompts, image=condition_pil_images(images), device=pipe.device,
                                          num_images_per_prompt=1, max_sequence_length=self.max_sequence_length)
        return (*_pad_rows(embeds, mask, self.max_sequence_length), None)


def edit_plus_sizes(height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((width, height) for the Qwen2.5-VL, (width, height) for the VAE)`` of a condition image of
    ``height x width`` pixels in ``QwenImageEditPlusPipeline.__call__``: ``calculate_dimensions(CONDITION_IMAGE_SIZE,
    w / h)`` and ``calculate_dimensions(VAE_IMAGE_SIZE, w / h)``, read from the pipeline module at call time."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    ratio = width / height
    return (tuple(plus.calculate_dimensions(plus.CONDITION_IMAGE_SIZE, ratio)),
            tuple(plus.calculate_dimensions(plus.VAE_IMAGE_SIZE, ratio)))


class QwenImageEditPlusText(_QwenEditText):
    """Qwen2.5-VL + ``processor`` of a ``QwenImageEditPlusPipeline`` (Qwen-Image-Edit-2509 / -2511), used through its
    own ``encode_prompt`` one prompt at a time (``__call__`` refuses a batch larger than 1).

    :meth:`encode_with_images` reads each prompt with its K images (``"Picture k: <|vision_start|>..."`` per image,
    each resized to ``calculate_dimensions(CONDITION_IMAGE_SIZE, w / h)`` by the pipeline's ``image_processor``);
    :meth:`encode` (prompts only) calls the same ``encode_prompt`` without images (the Plus template needs none).
    Rows are zero-padded to ``max_sequence_length``; a longer encoding raises (the pipeline does not truncate).
    """

    pipeline_class = "QwenImageEditPlusPipeline"
    text_only_fn = staticmethod(_qwen_encode_fn)  # the Plus template encodes prompts without images

    @torch.no_grad()
    def encode_with_images(self, prompts: Sequence[str], images) -> tuple[Tensor, Tensor, None]:
        """``prompts[i]`` read with row ``i`` of ``images`` (a list of PIL images per row, any size, or
        ``[N, 3, H, W]`` / ``[N, K, 3, H, W]`` float in [0, 1]), each image resized to
        ``calculate_dimensions(CONDITION_IMAGE_SIZE, w / h)`` of its own size ->
        ``(embeds [N, max_sequence_length, D], mask [N, max_sequence_length] int64, None)``.

        Raises:
            ValueError: not one image set per prompt; an encoding longer than ``max_sequence_length``.
        """
        if isinstance(prompts, str):
            raise TypeError("prompts must be a sequence of strings, not a single string")
        prompts, sets = list(prompts), pil_rows(images)
        if len(prompts) != len(sets):
            raise ValueError(f"{len(prompts)} prompts but {len(sets)} image sets: one per prompt")
        pipe = self.pipeline
        rows = []
        for prompt, pictures in zip(prompts, sets):
            vl = []
            for picture in pictures:
                (cw, ch), _ = edit_plus_sizes(picture.height, picture.width)
                vl.append(pipe.image_processor.resize(picture, ch, cw))
            embeds, mask = pipe.encode_prompt(prompt=[prompt], image=vl, device=pipe.device, num_images_per_prompt=1,
                                              max_sequence_length=self.max_sequence_length)
            rows.append(_pad_rows(embeds, mask, self.max_sequence_length))
        return torch.cat([e for e, _ in rows]), torch.cat([m for _, m in rows]), None
