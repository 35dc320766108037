"""Qwen-Image family adapter (diffusers ``QwenImageTransformer2DModel``, ``QwenImagePipeline``).

==================  ================================================================================================
flowforge           Qwen-Image transformer (checked against diffusers 0.42 ``pipeline_qwenimage.py`` /
                    ``transformer_qwenimage.py``)
==================  ================================================================================================
``sigma`` [B]       ``timestep = sigma`` (model dtype). The pipeline passes ``timestep / 1000``
                    (pipeline_qwenimage.py ``timestep=timestep / 1000``); the transformer's time projection is
                    ``Timesteps(..., scale=1000)`` (``QwenTimestepProjEmbeddings``), so it sees ``1000 * sigma``.
``x`` [B,C,H,W]     unpacked latents (the pipeline's ``[B, 1, C, H, W]`` without the frame axis); packed internally
                    to ``[B, (H/2)(W/2), 4C]`` (``_pack_latents``, same as FLUX) with
                    ``img_shapes = [[(1, H/2, W/2)]] * B``
``v`` (fp32)        the unpacked output; Qwen-Image predicts ``noise - x0`` (FlowMatchEuler steps with it)
CFG                 true CFG over ``cond.negative`` (pipeline ``true_cfg_scale``): ``comb = v_u + g (v_c - v_u)``,
                    then, like the pipeline, ``comb * (|v_c| / |comb|)`` with norms over each packed token's ``4C``
                    values (``cond_norm`` / ``noise_norm`` in pipeline_qwenimage.py). ``cfg_renorm=False`` gives the
                    plain formula. ``guidance_scale == 1``: the conditional forward alone (both forms agree).
VAE latents         per channel: ``z_model = (z_vae - latents_mean) / latents_std``; :meth:`QwenImageAdapter.decode`
                    applies ``z / (1 / latents_std) + latents_mean`` on ``[B, C, 1, H, W]`` and takes frame 0
text                Qwen2.5-VL ``hidden_states[-1]`` of the chat template ``prompt_template_encode`` with the first
                    ``prompt_template_encode_start_idx`` (34) tokens dropped, padding removed per prompt
                    (``_get_qwen_prompt_embeds``), via ``QwenImagePipeline.encode_prompt`` itself. Rows are then
                    zero-padded to ``max_sequence_length`` with ``mask = 0`` so cached chunks concatenate; the
                    velocity trims the columns padded in every row, which restores the pipeline's batch-max length.
schedule            dynamic shift: ``mu = calculate_shift((H/2)(W/2), ...)`` with the scheduler config's values
                    (:meth:`QwenImageAdapter.schedule_mu`); the released Qwen-Image scheduler also sets
                    ``shift_terminal``, which only :meth:`QwenImageAdapter.pipeline_sigmas` reproduces.
==================  ================================================================================================

Image-to-image (``task="i2i"``, Qwen-Image-Edit; checked against diffusers 0.42 ``pipeline_qwenimage_edit.py``)
---------------------------------------------------------------------------------------------------------------

Qwen-Image-Edit is the same ``QwenImageTransformer2DModel``; the condition image enters twice, and both happen in
:meth:`QwenImageAdapter.condition_on_images` (``ImageConditioned``), which returns a new record for the prompts:

* **text**: Qwen2.5-VL reads the prompt *and the image*. ``QwenImageEditPipeline.encode_prompt`` itself
  (``_get_qwen_prompt_embeds``: the Edit chat template ``prompt_template_encode`` with its
  ``<|vision_start|><|image_pad|><|vision_end|>`` placeholder, the pipeline's ``processor`` (``Qwen2VLProcessor``)
  expanding it to one token per merged image patch, ``hidden_states[-1]``, the first
  ``prompt_template_encode_start_idx`` (64) tokens dropped, padding removed per prompt) is called through
  :class:`QwenImageEditText`. The negative prompt is encoded with the *same* image, as the pipeline's true-CFG
  branch does. Rows are zero-padded to ``max_sequence_length`` with ``mask = 0`` (as for t2i);
* **image tokens** -> ``cond.image`` ``[N, (h/2)(w/2), 4C]`` fp32 (:meth:`QwenImageAdapter.encode_condition_images`):
  ``_encode_vae_image`` (``mode(vae.encode(2 image - 1))``, ``(z - latents_mean) / latents_std``) and
  ``prepare_latents`` (``_pack_latents``). :meth:`QwenImageAdapter.velocity` appends them after the noisy tokens
  (``cat([latents, image_latents], dim=1)``), passes ``img_shapes = [[(1, h/2, w/2), (1, h/2, w/2)]] * B`` (noisy
  grid, image grid) and keeps ``noise_pred[:, : latents.size(1)]``; the true-CFG negative forward sees the same image
  tokens; the CFG renormalisation is over the noisy tokens, as in ``__call__``. ``condition_index`` is ``None``: the
  whole latent is generated, and the rollout / objectives treat it as in t2i.

``mu`` is the t2i value (``__call__`` takes ``image_seq_len = latents.shape[1]``, the noisy tokens only).
:meth:`QwenImageAdapter.encode` (text only) cannot use the Edit template -- its processor refuses an image
placeholder without an image -- so it encodes with ``QwenImagePipeline``'s t2i template on the same Qwen2.5-VL; that
record is only the trainer's cache entry: in i2i every velocity needs ``cond.image`` and the text conditioning must
come from :meth:`QwenImageAdapter.condition_on_images` (a ``cond.image`` attached to a text-only record is *not*
what the pipeline computes).

What we do NOT replicate, all in ``QwenImageEditPipeline.__call__``: (1) the condition-image resize
(``calculate_dimensions(1024 * 1024, width / height)``: the image is resized to about 1024^2 pixels at its aspect
ratio, rounded to multiples of 32, for both the VAE and the processor) and (2) the default output size (that same
size). flowforge generates at ``model.height x model.width`` and loads every condition image at that size
(:func:`flowforge.data.images.load_condition_images`), so the image tokens have the noisy latent's grid
(``encode_condition_images`` checks it). The pipeline whose ``calculate_dimensions`` returns ``(width, height)`` of
the output, called with images of that size, is what we reproduce. The processor sees the images as 8-bit RGB PIL
images (``round(255 x)``), as the pipeline receives them; its own resize (``smart_resize`` to multiples of the
vision patch, within its min / max pixels) is the processor's, unchanged. Pre-encoded image latents passed as
``image`` and ``num_images_per_prompt > 1`` are not supported. In bf16 the pipeline normalises and packs the image
latent in the text encoder's dtype; we do it in fp32 and cast at the forward (fp32 runs are identical).

Multi-image editing (``task="i2i"``, ``edit_plus=True``: Qwen-Image-Edit-2509 / -2511; checked against diffusers 0.42
``pipeline_qwenimage_edit_plus.py``)
----------------------------------------------------------------------------------------------------------------------

A ``QwenImageEditPlusPipeline`` directory loads with ``edit_plus=True``. Differences from Edit, each as the pipeline:

==================  ================================================================================================
text                :class:`QwenImageEditPlusText`: the pipeline's ``encode_prompt`` with ``"Picture k: <|vision_start|>
                    <|image_pad|><|vision_end|>"`` per image before the prompt (``_get_qwen_prompt_embeds``), one
                    prompt at a time (``__call__`` refuses ``batch_size > 1``); each image first resized by the
                    pipeline's ``image_processor.resize`` to ``calculate_dimensions(CONDITION_IMAGE_SIZE, w / h)``
                    (384^2 area, multiples of 32; ``__call__`` step 3). The negative is read with the same images.
                    Rows are then batched (shorter ones zero-padded, ``mask = 0``): equal to the per-prompt
                    pipeline up to float summation order (tests: max abs 1.3e-6), bitwise for a batch of one.
image tokens        each image through ``image_processor.preprocess`` at ``calculate_dimensions(VAE_IMAGE_SIZE, w / h)``
                    (1024^2 area), ``_encode_vae_image``, ``_pack_latents``; the K images' tokens concatenated
                    (``prepare_latents``) -> ``cond.image [N, K gh gw, 4C]``
                    (:meth:`QwenImageAdapter.encode_plus_condition_images`); ``img_shapes = [(1, h/2, w/2),
                    (1, gh, gw) x K]`` with ``gh = vae_height // f // 2`` (its own size's)
zero_cond_t         Edit-2511's transformer flag (condition tokens modulated with ``t = 0``); the transformer
                    derives it from ``img_shapes``, so the velocity passes the same ``img_shapes`` and nothing else
schedule, CFG       as Edit: ``mu`` from the noisy tokens, true CFG ``true_cfg_scale`` with the per-token
                    renormalisation, negative prompt ``" "`` (the model card's)
==================  ================================================================================================

The two areas and ``calculate_dimensions`` are read from the pipeline module when used, so flowforge follows the
installed pipeline. Edit-Plus is given each prompt's condition images as opened (``metadata.images``: any number, any
size; ``takes_original_images``) and resizes each from its own size as the pipeline does, so flowforge's image tokens
and text encodings equal the pipeline's given the same files and ``height`` / ``width`` = the model size; rows whose
images differ in number or size run in separate forwards (:mod:`flowforge.models.reference_images`).

Notes on the environment: (a) with transformers 5.x, ``_get_qwen_prompt_embeds`` does not pass the processor's
``mm_token_type_ids`` to the Qwen2.5-VL, which then uses sequential (1-D) rotary positions for the image tokens
instead of its 3-D M-RoPE ones; we call the pipeline's function, so we match the pipeline as installed (and follow it
when it changes), not a hand-written encoder. (b) transformers 5.x builds / loads a ``Qwen2VLProcessor`` only with
its video processor, which needs torchvision. (c) The i2i text encoder runs at every sampling step (each batch's
prompts with their images), so it stays loaded: :meth:`QwenImageAdapter.release_text_encoder` keeps it for i2i.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from flowforge.models.base import Conditioning, frozen
from flowforge.models.family import FamilyAdapter
from flowforge.models.load import load_component
from flowforge.models.lora import JOINT_ATTENTION_LORA_TARGETS
from flowforge.models.qwen_image.spec import FAMILY
from flowforge.models.reference_images import by_image_layout, pad_rows, pil_rows, row_grids
from flowforge.models.common import (
    DEFAULT_MIN_TOKENIZER_SIZE,
    PackedImageLatents,
    check_velocity_inputs,
    dynamic_shift_mu,
    encode_with_negative,
    flow_match_pipeline_sigmas,
    has_component,
    latent_stats,
    pack_2x2,
    pipeline_dir,
    read_json,
    require_negative,
    to_unit_range,
    unpack_2x2,
)
from flowforge.models.qwen_image.text import (
    QwenImageEditPlusText,
    QwenImageEditText,
    edit_plus_sizes,
    qwen_image_text,
)

QWEN_TIMESTEP_SCALE = 1.0
"""Qwen-Image's transformer input is ``sigma`` itself (its time projection scales by 1000)."""

QWEN_IMAGE_LORA_TARGETS = JOINT_ATTENTION_LORA_TARGETS
"""Joint-attention projections of ``QwenImageTransformerBlock`` (image ``to_*``, text ``add_*`` / ``to_add_out``),
the module names of diffusers' Qwen-Image LoRA format (``QwenImagePipeline.load_lora_weights``)."""


QWEN_IMAGE_TASKS = FAMILY.tasks
"""Tasks of :class:`QwenImageAdapter`: text-to-image and Qwen-Image-Edit image-to-image (same transformer class)."""


class QwenImageAdapter(FamilyAdapter, PackedImageLatents):
    """:class:`~flowforge.models.base.FlowModel` around a diffusers ``QwenImageTransformer2DModel``; image-to-image
    (Qwen-Image-Edit) through :class:`~flowforge.models.base.ImageConditioned` with the image consumed inside the
    velocity and the text encoder (``condition_index = None``; see the module docstring).

    Args:
        transformer: the ``QwenImageTransformer2DModel`` (eval mode; its dtype is the forward dtype).
        text_encoder: :func:`qwen_image_text` (t2i), :class:`QwenImageEditText` / :class:`QwenImageEditPlusText`
            (i2i: also ``encode_with_images(prompts, images) -> (embeds, mask, None)``) or any object with
            ``encode(prompts) -> (embeds, mask, None)`` and ``encoder_id``; ``None``: conditioning must come from a
            cache (and i2i cannot condition on images).
        vae: the ``AutoencoderKLQwenImage`` (``None``: :meth:`decode` and image conditioning raise).
        negative_prompt: the unconditional prompt (the pipeline's examples use ``" "``; ``None`` encodes none).
        cfg_renorm: rescale the CFG output to the conditional norm per token, as ``QwenImagePipeline`` does.
        scheduler_config: the pipeline's scheduler config (for :meth:`schedule_mu`).
        edit_plus: ``QwenImageEditPlusPipeline`` conventions (Qwen-Image-Edit-2509 / -2511; module docstring):
            condition images at their ``VAE_IMAGE_SIZE`` grid, K images per prompt.
        task: ``"t2i"`` or ``"i2i"``. In ``"i2i"`` every velocity needs ``cond.image`` (the packed image latents of
            :meth:`condition_on_images`); in ``"t2i"`` a ``cond.image``, when given, is used the same way.

    Raises:
        ValueError: unknown ``task``; the layered variant (``use_additional_t_cond``, ``use_layer3d_rope``) or
            guidance embeds; ``edit_plus`` without ``task="i2i"``.
    """

    family_spec = FAMILY

    family = "Qwen-Image"
    tasks: tuple[str, ...] = QWEN_IMAGE_TASKS
    lora_targets: tuple[str, ...] = QWEN_IMAGE_LORA_TARGETS

    @property
    def takes_original_images(self) -> bool:
        """Edit-Plus resizes each condition image from its own size, as its pipeline (Edit: at the model size)."""
        return self.edit_plus

    @property
    def max_condition_images(self) -> int | None:
        """Edit: one image per prompt; Edit-Plus: any number (``QwenImageEditPlusPipeline`` sets no limit)."""
        return None if self.edit_plus else 1

    def __init__(self, transformer: nn.Module, text_encoder: Any = None, vae: nn.Module | None = None, *,
                 negative_prompt: str | None = " ", cfg_renorm: bool = True,
                 scheduler_config: dict[str, Any] | None = None, task: str = "t2i", edit_plus: bool = False):
        FAMILY.check_task(task)
        if edit_plus and task != "i2i":
            raise ValueError(f"edit_plus (QwenImageEditPlusPipeline) is image-to-image: task must be 'i2i', got "
                             f"{task!r}")
        cfg = transformer.config
        # zero_cond_t (Edit-2511: condition tokens modulated at t = 0) is the transformer's own, driven by img_shapes
        unsupported = [k for k in ("use_additional_t_cond", "guidance_embeds", "use_layer3d_rope")
                       if getattr(cfg, k, False)]
        if unsupported:
            raise ValueError(f"QwenImageAdapter supports the Qwen-Image / Qwen-Image-Edit(-Plus) transformer only; "
                             f"this one sets {unsupported} (the layered variant is not implemented)")
        self.task = task
        self.edit_plus = bool(edit_plus)
        self.transformer = transformer.eval()
        self.text_encoder = text_encoder
        self.vae = frozen(vae)
        self.negative_prompt = negative_prompt
        self.cfg_renorm = bool(cfg_renorm)
        self.scheduler_config = dict(scheduler_config or {})

    # ------------------------------------------------------------------ properties

    @property
    def latent_channels(self) -> int:
        return int(self.config.in_channels) // 4

    @property
    def vae_scale_factor(self) -> int:
        """``2 ** len(vae.temperal_downsample)`` (8 for Qwen-Image; 8 without a VAE, as the pipeline assumes)."""
        if self.vae is None:
            return 8
        return 2 ** len(self.vae.temperal_downsample)

    # ------------------------------------------------------------------ FlowModel

    def release_text_encoder(self) -> None:
        """Free the text encoder after the start-up encoding (t2i); kept for i2i, where
        :meth:`condition_on_images` re-encodes every step's prompts with their images."""
        if self.task != "i2i":
            super().release_text_encoder()

    def blocks(self) -> list[nn.Module]:
        """The ``QwenImageTransformerBlock`` modules, in order."""
        return list(self.transformer.transformer_blocks)

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """Qwen2.5-VL embeds ``[B, max_sequence_length, D]`` with ``mask`` (1 = real token); ``negative`` from
        :attr:`negative_prompt`. Text only: for i2i the record to sample with is :meth:`condition_on_images`'s."""
        return encode_with_negative(self.text_encoder, prompts, self.negative_prompt)

    def schedule_mu(self, height: int, width: int) -> float:
        """``mu`` as ``QwenImagePipeline.__call__`` computes it: ``calculate_shift(image_seq_len, base_image_seq_len,
        max_image_seq_len, base_shift, max_shift)`` from the scheduler config (fallbacks 256 / 4096 / 0.5 / 1.15).
        The Edit pipeline computes it from the noisy tokens only: the same value."""
        return dynamic_shift_mu(self.scheduler_config, self.image_seq_len(height, width))

    def pipeline_sigmas(self, num_steps: int, height: int, width: int) -> Tensor:
        """The exact ``[T+1]`` fp32 schedule of ``QwenImagePipeline`` (incl. ``shift_terminal``), ending in 0."""
        return flow_match_pipeline_sigmas(self.scheduler_config, num_steps, self.schedule_mu(height, width))

    def _forward_packed(self, x: Tensor, sigma: Tensor, embeds: Tensor, mask: Tensor | None,
                        image: Tensor | None = None, grids: Sequence[tuple[int, int]] = ()) -> Tensor:
        """One transformer forward over unpacked ``x [B, C, H, W]``; returns the packed fp32 prediction of the noisy
        tokens ``[B, (H/2)(W/2), 4C]``. ``image``: Edit image tokens, appended after the noisy tokens with their
        grids ``grids`` (one ``(h, w)`` per condition image) in ``img_shapes`` (``QwenImageEditPipeline.__call__``,
        ``QwenImageEditPlusPipeline.__call__``), output cropped."""
        dtype, device = self.dtype, x.device
        b, _, h, w = x.shape
        if mask is not None:
            mask = mask.to(device)
            used = mask.bool().any(dim=0).nonzero()
            keep = int(used.max()) + 1 if used.numel() else mask.shape[1]
            embeds, mask = embeds[:, :keep], mask[:, :keep]
            if bool(mask.all()):
                mask = None  # as QwenImagePipeline.encode_prompt: an all-ones mask is dropped
        tokens = pack_2x2(x.to(dtype))
        num_noisy = tokens.shape[1]
        shapes = [(1, h // 2, w // 2)]
        if image is not None:
            tokens = torch.cat([tokens, image.to(device=device, dtype=dtype)], dim=1)
            shapes.extend((1, gh, gw) for gh, gw in grids)
        out = self.transformer(
            hidden_states=tokens,
            timestep=(QWEN_TIMESTEP_SCALE * sigma).to(dtype),
            encoder_hidden_states=embeds.to(device=device, dtype=dtype),
            encoder_hidden_states_mask=mask,
            img_shapes=[shapes] * b,
            return_dict=False,
        )[0]
        return out[:, :num_noisy].float()

    def _image_tokens(self, cond: Conditioning, x: Tensor) -> tuple[Tensor | None, list[tuple[int, int]]]:
        if cond.image is None:
            if self.task == "i2i":
                raise ValueError("task='i2i' (Qwen-Image-Edit) needs cond.image: the record of condition_on_images "
                                 "(image tokens + the prompts re-encoded with their images; the trainer sets it from "
                                 "each prompt's metadata.image)")
            return None, []
        b, c, h, w = x.shape
        if self.edit_plus:
            grids = row_grids(cond) if cond.image_grids is not None else []
            if not grids or tuple(cond.image.shape) != (b, sum(gh * gw for gh, gw in grids), 4 * c):
                raise ValueError(f"cond.image must be the packed Edit-Plus image latents [B, L, {4 * c}] with their "
                                 "grids in cond.image_grids (encode_plus_condition_images), got "
                                 f"{tuple(cond.image.shape)}")
            return cond.image, grids
        expected = (b, (h // 2) * (w // 2), 4 * c)
        if tuple(cond.image.shape) != expected:
            raise ValueError(f"cond.image must be the packed Edit image latents [B, (H/2)(W/2), 4C] = {expected} of "
                             f"the latent (encode_condition_images), got {tuple(cond.image.shape)}")
        return cond.image, [(h // 2, w // 2)]  # the condition image's grid: same size as the output

    def velocity(self, x: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Velocity ``noise - x0`` at unpacked ``x [B, C, H, W]``, ``sigma [B]`` in [0, 1]; fp32, shape of ``x``.

        ``guidance_scale > 1`` (the pipeline's ``true_cfg_scale > 1``): true CFG over ``cond.negative`` (two
        forwards, as the pipeline: the two encodings may differ in length), renormalised when :attr:`cfg_renorm`;
        any other value: the conditional forward alone. A missing ``cond.negative`` is an error (the pipeline
        would silently run without CFG).
        ``cond.image`` (i2i: Edit image latents) is appended to both forwards, as in ``QwenImageEditPipeline``.

        Raises:
            ValueError: bad shapes; CFG without ``cond.negative``; ``task="i2i"`` without ``cond.image``.
        """
        sigma = check_velocity_inputs(x, sigma, cond, 4)
        if self.edit_plus:  # rows whose condition images differ in number or size: separate forwards
            return by_image_layout(x, sigma, cond, lambda x_, s_, c_: self._velocity(x_, s_, c_, guidance_scale))
        return self._velocity(x, sigma, cond, guidance_scale)

    def _velocity(self, x: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        image, grids = self._image_tokens(cond, x)
        h, w = x.shape[-2:]
        g = float(guidance_scale)
        v_c = self._forward_packed(x, sigma, cond.prompt_embeds, cond.mask, image, grids)
        if self.guidance_use(g) == "cfg":
            neg = require_negative(cond, g)
            v_u = self._forward_packed(x, sigma, neg.prompt_embeds, neg.mask, image, grids)
            comb = v_u + g * (v_c - v_u)
            if self.cfg_renorm:
                comb = comb * (torch.norm(v_c, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
            v_c = comb
        return unpack_2x2(v_c, h, w)

    # ------------------------------------------------------------------ ImageConditioned (Qwen-Image-Edit)

    def condition_on_images(self, cond: Conditioning, prompts: Sequence[str], images: Tensor,
                            latent_shape: Sequence[int]) -> Conditioning:
        """The Edit conditioning of ``prompts`` with ``images [N, 3, H, W]`` float32 in [0, 1] (one per prompt, at
        the model's pixel size) for latents of ``latent_shape = (C, h, w)``.

        Replaces every text field of ``cond`` (its text-only encoding of the same prompts): ``prompt_embeds`` /
        ``mask`` are ``QwenImageEditPipeline.encode_prompt(prompts, image=images)`` (``[N, max_sequence_length, D]``,
        int64 mask), ``negative`` is :attr:`negative_prompt` encoded with the same images (``None`` when
        :attr:`negative_prompt` is ``None``), and ``image`` = :meth:`encode_condition_images` ``[N, (h/2)(w/2), 4C]``
        fp32. Fields keep ``cond``'s device; the text fields the text encoder's dtype.

        Raises:
            RuntimeError: no Edit text encoder (``encode_with_images``) or no VAE.
            ValueError: ``cond`` / ``prompts`` / ``images`` row counts differ; images not at the model's size.
        """
        if isinstance(prompts, str):
            raise TypeError("prompts must be a sequence of strings, not a single string")
        prompts = list(prompts)
        if self.edit_plus:
            images = pil_rows(images)
        elif images.ndim != 4:
            raise ValueError(f"Qwen-Image-Edit takes one image per prompt [N, 3, H, W], got {tuple(images.shape)} "
                             "(several images per prompt: a QwenImageEditPlusPipeline directory)")
        if not (cond.batch_size == len(prompts) == len(images)):
            raise ValueError(f"cond has {cond.batch_size} rows, {len(prompts)} prompts, {len(images)} images: "
                             "one of each per row")
        encode = getattr(self.text_encoder, "encode_with_images", None)
        if encode is None:
            raise RuntimeError("Qwen-Image i2i re-encodes the prompts with their images: the text encoder must be a "
                               "QwenImageEditText (a QwenImageEditPipeline directory loaded with task='i2i'), got "
                               f"{type(self.text_encoder).__name__}")
        device, grids = cond.prompt_embeds.device, None
        if self.edit_plus:
            image, grids = self.encode_plus_condition_images(images)
            image, grids = image.to(device), grids.to(device)
        else:
            image = self.encode_condition_images(images, latent_shape).to(device)
        embeds, mask, _ = encode(prompts, images)
        negative = None
        if self.negative_prompt is not None:
            e_u, m_u, _ = encode([self.negative_prompt] * len(prompts), images)
            negative = Conditioning(prompt_embeds=e_u.to(device), mask=m_u.to(device))
        return dataclasses.replace(cond, prompt_embeds=embeds.to(device), mask=mask.to(device), pooled=None,
                                   negative=negative, image=image, image_grids=grids)

    @torch.no_grad()
    def encode_plus_condition_images(self, images) -> tuple[Tensor, Tensor]:
        """Edit-Plus condition images (one list of PIL images per row, any size, or ``[N, (K,) 3, H, W]`` float in
        [0, 1]) -> ``(tokens [N, L, 4C] fp32, grids [N, K, 2] int64)`` (rows zero-padded,
        :mod:`flowforge.models.reference_images`), as ``QwenImageEditPlusPipeline.__call__``: each image through
        ``image_processor.preprocess`` at ``calculate_dimensions(VAE_IMAGE_SIZE, w / h)`` of its own size,
        ``_encode_vae_image`` (VAE mode, ``(z - latents_mean) / latents_std``), ``_pack_latents``, a row's images'
        tokens concatenated in order (``prepare_latents``); grid ``(vae_height // f // 2, vae_width // f // 2)``.

        Raises:
            RuntimeError: no VAE.
        """
        from diffusers import QwenImageEditPlusPipeline

        self.require_vae()
        pipe = QwenImageEditPlusPipeline(scheduler=None, vae=self.vae, text_encoder=None, tokenizer=None,
                                         processor=None, transformer=None)
        tokens, grids = [], []
        for pictures in pil_rows(images):
            row, shapes = [], []
            for picture in pictures:
                _, (vw, vh) = edit_plus_sizes(picture.height, picture.width)
                pixels = pipe.image_processor.preprocess(picture, vh, vw).unsqueeze(2)
                z = pipe._encode_vae_image(pixels.to(device=self.vae.device, dtype=self.vae.dtype), None)
                row.append(pipe._pack_latents(z, 1, z.shape[1], z.shape[3], z.shape[4]))
                shapes.append((z.shape[3] // 2, z.shape[4] // 2))  # img_shapes: vae_height // f // 2
            tokens.append(torch.cat(row, dim=1).float())
            grids.append(shapes)
        return pad_rows(tokens, grids)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Unpacked latents ``[B, C, h, w]`` → images ``[B, 3, h f, w f]`` float32 in [0, 1]."""
        self.require_vae("decode")
        z = latents.unsqueeze(2).to(self.vae.dtype)
        mean, inv_std = latent_stats(self.vae, z)
        z = z / inv_std + mean
        return to_unit_range(self.vae.decode(z, return_dict=False)[0][:, :, 0])

    @torch.no_grad()
    def encode_images(self, images: Tensor) -> Tensor:
        """Images ``[B, 3, H, W]`` in [0, 1] → model latents ``(mode(z) - mean) / std`` fp32 ``[B, C, h, w]``."""
        self.require_vae()
        pixels = (images.to(device=self.vae.device, dtype=torch.float32) * 2.0 - 1.0).to(self.vae.dtype)
        z = self.vae.encode(pixels.unsqueeze(2)).latent_dist.mode()
        mean, inv_std = latent_stats(self.vae, z)
        return ((z - mean) * inv_std)[:, :, 0].float()



def load_qwen_image(path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                    task: str = "t2i", text_encoder: Any = None, negative_prompt: str | None = " ",
                    cfg_renorm: bool = True, max_sequence_length: int = 512,
                    min_tokenizer_size: int = DEFAULT_MIN_TOKENIZER_SIZE) -> QwenImageAdapter:
    """Load Qwen-Image from a local diffusers pipeline directory: ``QwenImagePipeline.save_pretrained`` for
    ``task="t2i"``, ``QwenImageEditPipeline.save_pretrained`` or ``QwenImageEditPlusPipeline.save_pretrained``
    (Edit-2509 / -2511), with its ``processor``, for ``task="i2i"``.

    The transformer and VAE load now; the Qwen2.5-VL text encoder (and, for i2i, the processor) lazily on the first
    encode, through the directory's own pipeline class. Never downloads.

    Raises:
        FileNotFoundError: ``path`` is not a pipeline directory.
        ValueError: ``task`` not in ``("t2i", "i2i")``; an i2i directory that is not a Qwen-Image-Edit one or a t2i
            directory that is.
    """
    from diffusers import QwenImageTransformer2DModel

    root = pipeline_dir(path, "Qwen-Image")
    pipeline_class = read_json(root / "model_index.json").get("_class_name")
    edit_plus = pipeline_class == "QwenImageEditPlusPipeline"
    if task == "i2i" and pipeline_class not in ("QwenImageEditPipeline", "QwenImageEditPlusPipeline"):
        raise ValueError(f"task='i2i' needs a QwenImageEditPipeline or QwenImageEditPlusPipeline directory "
                         f"(Qwen-Image-Edit, -2509 / -2511); {path!s} holds a {pipeline_class}")
    if task == "t2i" and str(pipeline_class).startswith("QwenImageEdit"):
        raise ValueError(f"{path!s} holds a {pipeline_class} (Qwen-Image-Edit): load it with task='i2i'")
    transformer = QwenImageTransformer2DModel.from_pretrained(str(root / "transformer"), torch_dtype=dtype,
                                                              local_files_only=True).to(device)
    vae = load_component(root, "vae", dtype=dtype, device=device)
    if text_encoder is None and has_component(root, "text_encoder"):
        make = (QwenImageEditPlusText if edit_plus else QwenImageEditText) if task == "i2i" else qwen_image_text
        text_encoder = make(path=root, max_sequence_length=max_sequence_length, device=device, dtype=dtype,
                            min_tokenizer_size=min_tokenizer_size)
    return QwenImageAdapter(transformer, text_encoder, vae, negative_prompt=negative_prompt, cfg_renorm=cfg_renorm,
                            scheduler_config=read_json(root / "scheduler" / "scheduler_config.json"), task=task,
                            edit_plus=edit_plus)
