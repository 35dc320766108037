"""FLUX.2 adapter (diffusers ``Flux2Transformer2DModel``): FLUX.2 [klein] (``Flux2KleinPipeline``) and FLUX.2 [dev]
(``Flux2Pipeline``), text-to-image and reference-image editing.

==================  ================================================================================================
flowforge           FLUX.2 Klein (checked against diffusers 0.42 ``pipeline_flux2_klein.py``)
==================  ================================================================================================
``x`` [B,4C,h,w]    the *patchified* latent the pipeline draws (``prepare_latents``: ``shape = (B, 4C, H/2f, W/2f)``,
                    ``f = vae_scale_factor``); tokens are ``x.reshape(B, 4C, hw).permute(0, 2, 1)`` (``_pack_latents``)
                    with ids ``(0, row, col, 0)`` (``_prepare_latent_ids``); the output goes back by the inverse
                    permutation (``_unpack_latents_with_ids`` scatters the same values)
``sigma`` [B]       ``timestep = (1000 sigma) / 1000`` in the latent dtype, as the pipeline forms it from the
                    scheduler's ``t`` (``timestep = t.expand(B).to(latents.dtype)``, ``timestep / 1000``); the
                    transformer scales by 1000 itself
``v`` (fp32)        the transformer output cropped to the noisy tokens (``noise_pred[:, : latents.size(1)]``); the
                    scheduler steps ``x + (sigma_next - sigma) v``: flowforge's velocity
guidance            Klein has no guidance embedding (``guidance=None``). True CFG ``v_u + g (v_c - v_u)`` with two
                    separate forwards (``"cond"`` then ``"uncond"``, as the pipeline), on when ``g > 1`` and the
                    pipeline is not ``is_distilled`` (``do_classifier_free_guidance``); a step-distilled Klein
                    (``is_distilled: true`` in ``model_index.json``) ignores ``guidance_scale`` like the pipeline.
                    Negative prompt ``""`` (``__call__``). The CFG combination is done in fp32 (the pipeline: in the
                    transformer dtype; identical in fp32 runs).
VAE latents         ``AutoencoderKLFlux2``: decode = ``x * sqrt(bn.running_var + batch_norm_eps) + bn.running_mean``,
                    ``_unpatchify_latents``, ``vae.decode`` (``__call__`` after the loop)
text                Qwen3 hidden states of layers ``text_encoder_out_layers`` (default ``(9, 18, 27)``) stacked on
                    channels, chat template with ``enable_thinking=False``, padded to ``max_sequence_length``
                    (``_get_qwen3_prompt_embeds``), through the pipeline's own ``encode_prompt``; no mask (the
                    transformer attends the padded context); ``txt_ids = (0, 0, 0, l)`` (``_prepare_text_ids``)
schedule            ``sigmas = linspace(1, 1/T, T)`` through the scheduler with ``mu = compute_empirical_mu(hw, T)``
                    (the pipeline's own function: depends on the number of steps as well as the token count)
==================  ================================================================================================

FLUX.2 [dev] (checked against diffusers 0.42 ``pipeline_flux2.py``): the same transformer class, latent layout,
timestep, VAE de-normalisation and schedule (``compute_empirical_mu``; ``Flux2Pipeline.__call__`` step 6). Differs in

==================  ================================================================================================
text                Mistral-3 hidden states of layers ``(10, 20, 30)`` stacked on channels, the pipeline's
                    ``SYSTEM_MESSAGE`` chat (``format_input``), padded / truncated to ``max_sequence_length``
                    (``_get_mistral_3_small_prompt_embeds``), through ``Flux2Pipeline.encode_prompt``
                    (:func:`flux2_dev_text`); no negative prompt
guidance            guidance-distilled (``config.guidance_embeds``): ``guidance = full([B], g)`` fp32 into the
                    transformer in one forward (``__call__``: "handle guidance"); no CFG, so a replayed step is one
                    network evaluation. ``guidance_scale`` is the pipeline's (default 4.0)
==================  ================================================================================================

Reference-image editing (``task="i2i"``, both pipelines' ``image=``): :meth:`Flux2Adapter.condition_on_images`
takes each row's reference images as opened (PIL, any size, any number: ``metadata.images``) and does what the
pipelines' ``__call__`` step 4 does with each: ``check_image_input`` (at least 64 px, aspect ratio at most 8), shrunk
to 1024^2 pixels when larger (``_resize_to_target_area``), its size floored to a multiple of ``2 f`` and
``image_processor.preprocess(..., resize_mode="crop")`` at that size, then ``prepare_image_latents``
(``_encode_vae_image``: VAE mode, ``_patchify_latents``, batch-norm normalisation; ``_pack_latents``): ``cond.image``
``[N, L, 4C]`` (the K images' tokens concatenated, rows zero-padded) and ``cond.image_grids`` ``[N, K, 2]``. The
velocity appends a row's tokens after the noisy ones with ids ``_prepare_image_ids`` (``(10 + 10 k, row, col, 0)``
for image k, each on its own grid), keeps ``noise_pred[:, : latents.size(1)]``; the CFG negative forward (Klein) sees
the same tokens (``__call__`` step 7); rows with different reference layouts run in separate forwards. The text
encoders do not read the images (``encode_prompt`` has no image argument; caption upsampling is not used). The
pipelines default the output size to the last image's; flowforge generates at ``model.height x model.width``, so the
pipeline called with the same images and that size is what is reproduced.
The prompt text rows are the t2i ones (the text encoder does not see the image).

Not adapted: a scheduler config with ``use_flow_sigmas``; caption upsampling (``caption_upsample_temperature``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from flowforge.models.base import Conditioning, frozen
from flowforge.models.family import FamilyAdapter
from flowforge.models.load import load_component
from flowforge.models.flux2.spec import FAMILY
from flowforge.models.reference_images import by_image_layout, pad_rows, pil_rows, row_grids
from flowforge.models.common import (
    DEFAULT_MIN_TOKENIZER_SIZE,
    PipelineText,
    check_velocity_inputs,
    encode_with_negative,
    flow_match_pipeline_sigmas,
    has_component,
    pipeline_dir,
    read_json,
    require_negative,
    to_unit_range,
)

FLUX2_TASKS = FAMILY.tasks
REFERENCE_MAX_AREA = 1024 * 1024
"""Both FLUX.2 pipelines shrink a reference image larger than this (pixels) to this area; so does flowforge."""

FLUX2_LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                      "attn.add_v_proj", "attn.to_add_out")
"""Attention projections of the double-stream ``Flux2TransformerBlock`` (image ``to_*``, text ``add_*`` /
``to_add_out``); diffusers' FLUX.2 LoRA module names (``transformer.<module>.lora_A``)."""


def _klein_encode_fn(max_sequence_length: int, out_layers: tuple[int, ...]):
    def encode(pipe, prompts: list[str]) -> tuple[Tensor, None, None]:
        embeds, _ = pipe.encode_prompt(prompt=list(prompts), device=pipe.device,
                                       max_sequence_length=max_sequence_length, text_encoder_out_layers=out_layers)
        return embeds, None, None

    return encode


def _dev_encode_fn(max_sequence_length: int, out_layers: tuple[int, ...]):
    def encode(pipe, prompts: list[str]) -> tuple[Tensor, None, None]:
        embeds, _ = pipe.encode_prompt(prompt=list(prompts), device=pipe.device,
                                       max_sequence_length=max_sequence_length, text_encoder_out_layers=out_layers)
        return embeds, None, None

    return encode


def flux2_dev_text(*, path: str | Path | None = None, components: dict[str, Any] | None = None,
                   max_sequence_length: int = 512, out_layers: Sequence[int] = (10, 20, 30),
                   device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                   encoder_id: str | None = None,
                   min_tokenizer_size: int = DEFAULT_MIN_TOKENIZER_SIZE) -> PipelineText:
    """The Mistral-3 text side of a FLUX.2 [dev] pipeline, through ``Flux2Pipeline.encode_prompt``:
    ``(embeds [B, max_sequence_length, len(out_layers) * D], None, None)``."""
    layers = tuple(int(i) for i in out_layers)
    return PipelineText("Flux2Pipeline", _dev_encode_fn(int(max_sequence_length), layers), path=path,
                        components=components, device=device, dtype=dtype,
                        settings=f"len={int(max_sequence_length)}:layers={list(layers)}", encoder_id=encoder_id,
                        min_tokenizer_size=min_tokenizer_size)


def flux2_klein_text(*, path: str | Path | None = None, components: dict[str, Any] | None = None,
                     max_sequence_length: int = 512, out_layers: Sequence[int] = (9, 18, 27),
                     device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                     encoder_id: str | None = None,
                     min_tokenizer_size: int = DEFAULT_MIN_TOKENIZER_SIZE) -> PipelineText:
    """The Qwen3 text side of a FLUX.2 Klein pipeline, through ``Flux2KleinPipeline.encode_prompt``:
    ``(embeds [B, max_sequence_length, len(out_layers) * D], None, None)``."""
    layers = tuple(int(i) for i in out_layers)
    return PipelineText("Flux2KleinPipeline", _klein_encode_fn(int(max_sequence_length), layers), path=path,
                        components=components, device=device, dtype=dtype,
                        settings=f"len={int(max_sequence_length)}:layers={list(layers)}", encoder_id=encoder_id,
                        min_tokenizer_size=min_tokenizer_size)


class Flux2Adapter(FamilyAdapter):
    """:class:`~flowforge.models.base.FlowModel` around a diffusers ``Flux2Transformer2DModel`` driven as
    ``Flux2KleinPipeline`` (no guidance embedding) or ``Flux2Pipeline`` (FLUX.2 [dev]: ``config.guidance_embeds``)
    does (module docstring); ``task="i2i"``: reference images (``ImageConditioned``, consumed in the velocity).

    Args:
        transformer: the ``Flux2Transformer2DModel`` (eval mode; its dtype is the forward dtype).
        text_encoder: :func:`flux2_klein_text` / :func:`flux2_dev_text` or any object with
            ``encode(prompts) -> (embeds, None, None)`` and ``encoder_id``; ``None``: conditioning from a cache.
        vae: the ``AutoencoderKLFlux2`` (``None``: :meth:`decode` and reference images raise).
        negative_prompt: CFG's unconditional prompt (Klein: ``""``); ``None``: none encoded. ``"default"``: ``""``
            for Klein, ``None`` for a guidance-distilled transformer (dev has no CFG).
        scheduler_config: the pipeline's scheduler config.
        is_distilled: the pipeline's ``is_distilled`` flag (step-distilled Klein: guidance is ignored).
        task: ``"t2i"`` or ``"i2i"``.

    Raises:
        ValueError: unknown ``task``.
    """

    family_spec = FAMILY

    family = "FLUX.2"
    tasks: tuple[str, ...] = FLUX2_TASKS
    takes_original_images = True  # each reference image resized as the pipelines do, from the file's own size
    max_condition_images = None  # neither pipeline limits the number of reference images (diffusers 0.42)
    lora_targets: tuple[str, ...] = FLUX2_LORA_TARGETS

    def __init__(self, transformer: nn.Module, text_encoder: Any = None, vae: nn.Module | None = None, *,
                 negative_prompt: str | None = "default", scheduler_config: dict[str, Any] | None = None,
                 is_distilled: bool = False, task: str = "t2i"):
        FAMILY.check_task(task)
        self.task = task
        self.transformer = transformer.eval()
        self.text_encoder = text_encoder
        self.vae = frozen(vae)
        if negative_prompt == "default":
            negative_prompt = None if self.guidance_embeds else ""
        self.negative_prompt = negative_prompt
        self.scheduler_config = dict(scheduler_config or {})
        self.is_distilled = bool(is_distilled)

    cfg_rule = ("guidance_scale > 1 and not a step-distilled Klein (the pipeline's do_classifier_free_guidance); "
                "FLUX.2 [dev] embeds any value")

    def guidance_use(self, guidance_scale: float) -> str:
        """``"embedded"`` for FLUX.2 [dev]; ``"off"`` for a step-distilled Klein; else ``guidance_scale > 1``."""
        if self.guidance_embeds:
            return "embedded"
        return "off" if self.is_distilled else super().guidance_use(guidance_scale)

    @property
    def guidance_embeds(self) -> bool:
        """FLUX.2 [dev]: guidance-distilled (the guidance value is a transformer input; no CFG)."""
        return bool(getattr(self.transformer.config, "guidance_embeds", False))

    @property
    def vae_scale_factor(self) -> int:
        """``2 ** (len(block_out_channels) - 1)``; 8 without a VAE (the pipeline's fallback)."""
        return 8 if self.vae is None else 2 ** (len(self.vae.config.block_out_channels) - 1)

    def latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """Patchified ``(in_channels, H / 2f, W / 2f)`` (``prepare_latents``).

        Raises:
            ValueError: ``frames`` given, or a size not a positive multiple of ``2 f``.
        """
        if frames is not None:
            raise ValueError(f"FLUX.2 is an image model; frames must be None, got {frames}")
        unit = 2 * self.vae_scale_factor
        if height <= 0 or width <= 0 or height % unit or width % unit:
            raise ValueError(f"height and width must be positive multiples of {unit}, got {height}x{width}")
        return (int(self.config.in_channels), height // unit, width // unit)

    def blocks(self) -> list[nn.Module]:
        """The double-stream then the single-stream transformer blocks."""
        return list(self.transformer.transformer_blocks) + list(self.transformer.single_transformer_blocks)

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """Stacked Qwen3 hidden states ``[B, max_sequence_length, 3 D]``; ``negative`` per :attr:`negative_prompt`."""
        return encode_with_negative(self.text_encoder, prompts, self.negative_prompt)

    def schedule_mu(self, height: int, width: int, num_steps: int) -> float:
        """``compute_empirical_mu(hw, num_steps)`` of the pipeline (``hw`` latent tokens)."""
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        _, h, w = self.latent_shape(height, width)
        return compute_empirical_mu(image_seq_len=h * w, num_steps=num_steps)

    def pipeline_sigmas(self, num_steps: int, height: int, width: int) -> Tensor:
        """The exact ``[T+1]`` fp32 schedule of ``Flux2KleinPipeline`` (scheduler config defaults: diffusers')."""
        config = dict(self.scheduler_config)
        config.setdefault("use_dynamic_shifting", False)  # FlowMatchEulerDiscreteScheduler's default
        return flow_match_pipeline_sigmas(config, num_steps, self.schedule_mu(height, width, num_steps))

    def _forward(self, x: Tensor, sigma: Tensor, embeds: Tensor, image: Tensor | None = None,
                 guidance: float | None = None, grids: Sequence[tuple[int, int]] = ()) -> Tensor:
        from diffusers import Flux2KleinPipeline

        dtype, device = self.dtype, x.device
        b, c, h, w = x.shape
        tokens = x.reshape(b, c, h * w).permute(0, 2, 1).to(dtype)
        img_ids = Flux2KleinPipeline._prepare_latent_ids(x).to(device)
        if image is not None:  # reference tokens after the noisy ones, ids (10 + 10 k, row, col, 0)
            ref_ids = Flux2KleinPipeline._prepare_image_ids([torch.empty(1, 1, gh, gw) for gh, gw in grids])
            tokens = torch.cat([tokens, image.to(device=device, dtype=dtype)], dim=1)
            img_ids = torch.cat([img_ids, ref_ids.to(device).expand(b, -1, -1)], dim=1)
        embeds = embeds.to(device=device, dtype=dtype)
        txt_ids = Flux2KleinPipeline._prepare_text_ids(embeds).to(device)
        timestep = (sigma * 1000.0).to(x.dtype) / 1000  # the pipeline's t.to(latents.dtype) / 1000
        g = None if guidance is None else torch.full([b], float(guidance), device=device, dtype=torch.float32)
        out = self.transformer(hidden_states=tokens, timestep=timestep, guidance=g, encoder_hidden_states=embeds,
                               txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        return out[:, : h * w].float().permute(0, 2, 1).reshape(b, c, h, w)

    def _reference_tokens(self, cond: Conditioning, x: Tensor) -> tuple[Tensor | None, list[tuple[int, int]]]:
        if cond.image is None:
            if self.task == "i2i":
                raise ValueError("task='i2i' (FLUX.2 reference images) needs cond.image: the record of "
                                 "condition_on_images (the trainer sets it from each prompt's metadata.image(s))")
            return None, []
        b, c = x.shape[:2]
        grids = row_grids(cond) if cond.image_grids is not None else []
        if not grids or cond.image.ndim != 3 or tuple(cond.image.shape) != (b, sum(h * w for h, w in grids), c):
            raise ValueError(f"cond.image must be the packed reference latents [B, L, {c}] with their grids in "
                             f"cond.image_grids (condition_on_images), got {tuple(cond.image.shape)}")
        return cond.image, grids

    def velocity(self, x: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Velocity at patchified ``x [B, 4C, h, w]``, ``sigma [B]``; fp32, shape of ``x``. Guidance-distilled
        (dev): one forward with ``guidance = g``. Otherwise ``g <= 1`` or a distilled Klein: the conditional forward
        alone; else ``v_u + g (v_c - v_u)`` (two forwards). ``cond.image`` (i2i): reference tokens in every forward;
        rows whose reference images differ in number or size run in separate forwards (``by_image_layout``).

        Raises:
            ValueError: bad shapes; CFG without ``cond.negative``; ``task="i2i"`` without ``cond.image``.
        """
        sigma = check_velocity_inputs(x, sigma, cond, 4)
        if cond.image is None and self.task != "i2i":
            return self._velocity(x, sigma, cond, guidance_scale)
        return by_image_layout(x, sigma, cond, lambda x_, s_, c_: self._velocity(x_, s_, c_, guidance_scale))

    def _velocity(self, x: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        image, grids = self._reference_tokens(cond, x)
        g = float(guidance_scale)
        use = self.guidance_use(g)
        if use == "embedded":
            return self._forward(x, sigma, cond.prompt_embeds, image, guidance=g, grids=grids)
        v_c = self._forward(x, sigma, cond.prompt_embeds, image, grids=grids)
        if use == "off":
            return v_c
        v_u = self._forward(x, sigma, require_negative(cond, g).prompt_embeds, image, grids=grids)
        return v_u + g * (v_c - v_u)

    @torch.no_grad()
    def encode_reference_images(self, images: Tensor | Sequence[Sequence[Any]]) -> tuple[Tensor, Tensor]:
        """Each row's reference images -> ``(tokens [N, L, 4C] fp32, grids [N, K, 2] int64)`` (rows zero-padded to the
        longest, :mod:`flowforge.models.reference_images`), as the pipelines' ``__call__`` step 4 and
        ``prepare_image_latents``: each image checked (``check_image_input``), shrunk to 1024^2 pixels when larger
        (``_resize_to_target_area``), its size floored to a multiple of ``2 f`` and ``image_processor.preprocess(...,
        resize_mode="crop")`` at that size; VAE mode, ``_patchify_latents``, batch-norm normalisation, packed.

        ``images``: one list of PIL images per row (any size, as opened), or ``[N, 3, H, W]`` / ``[N, K, 3, H, W]``
        float in [0, 1] (taken as 8-bit images).

        Raises:
            RuntimeError: no VAE. ValueError: a bad shape; an image the pipelines' ``check_image_input`` refuses
            (under 64 px, aspect ratio beyond 8).
        """
        from diffusers import Flux2KleinPipeline

        self.require_vae()
        pipe = Flux2KleinPipeline(scheduler=None, vae=self.vae, text_encoder=None, tokenizer=None, transformer=None)
        multiple = 2 * self.vae_scale_factor
        tokens, grids = [], []
        for pictures in pil_rows(images):
            for picture in pictures:
                pipe.image_processor.check_image_input(picture)  # the pipelines refuse < 64 px, extreme ratios
            pixels = []
            for picture in pictures:
                if picture.width * picture.height > REFERENCE_MAX_AREA:
                    picture = pipe.image_processor._resize_to_target_area(picture, REFERENCE_MAX_AREA)
                width, height = picture.width // multiple * multiple, picture.height // multiple * multiple
                pixels.append(pipe.image_processor.preprocess(picture, height=height, width=width, resize_mode="crop"))
            row, _ = pipe.prepare_image_latents(pixels, 1, None, self.vae.device, self.vae.dtype)
            tokens.append(row.float())
            grids.append([(p.shape[-2] // multiple, p.shape[-1] // multiple) for p in pixels])
        return pad_rows(tokens, grids)

    def condition_on_images(self, cond: Conditioning, prompts: Sequence[str], images: Tensor | Sequence[Sequence[Any]],
                            latent_shape: Sequence[int]) -> Conditioning:
        """``cond`` with ``image`` / ``image_grids`` = :meth:`encode_reference_images` (``ImageConditioned``; the
        text rows are kept: the FLUX.2 text encoders do not read the images; ``prompts``, ``latent_shape`` unused:
        each reference image keeps its own size, as in the pipelines).

        Raises:
            ValueError: row counts differ; see :meth:`encode_reference_images`.
        """
        image, grids = self.encode_reference_images(images)
        if image.shape[0] != cond.batch_size:
            raise ValueError(f"cond has {cond.batch_size} rows but {image.shape[0]} image sets: one per row")
        device = cond.prompt_embeds.device
        return dataclasses.replace(cond, image=image.to(device), image_grids=grids.to(device))

    def _bn(self, like: Tensor) -> tuple[Tensor, Tensor]:
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(like.device,
                                                                                               like.dtype)
        return mean, std

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Patchified latents ``[B, 4C, h, w]`` → images ``[B, 3, 2 f h, 2 f w]`` float32 in [0, 1]."""
        self.require_vae("decode")
        from diffusers import Flux2KleinPipeline

        mean, std = self._bn(latents)
        z = Flux2KleinPipeline._unpatchify_latents(latents * std + mean)
        return to_unit_range(self.vae.decode(z.to(self.vae.dtype), return_dict=False)[0])



Flux2KleinAdapter = Flux2Adapter
"""The name this adapter had when it ran Klein only."""


def load_flux2(path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               task: str = "t2i", text_encoder: Any = None, negative_prompt: str | None = "default",
               max_sequence_length: int = 512,
               min_tokenizer_size: int = DEFAULT_MIN_TOKENIZER_SIZE) -> Flux2Adapter:
    """Load FLUX.2 from a local ``Flux2KleinPipeline`` (``is_distilled`` read from ``model_index.json``) or
    ``Flux2Pipeline`` (FLUX.2 [dev]) directory, the text side through that pipeline class; never downloads.

    Raises:
        FileNotFoundError: ``path`` is not a pipeline directory. ValueError: ``task`` not in ``("t2i", "i2i")``; a
        directory of another pipeline class.
    """
    from diffusers import Flux2Transformer2DModel

    root = pipeline_dir(path, "FLUX.2")
    index = json.loads((root / "model_index.json").read_text())
    pipeline_class = index.get("_class_name")
    if pipeline_class not in ("Flux2KleinPipeline", "Flux2Pipeline"):
        raise ValueError(f"{path!s} holds a {pipeline_class}; the flux2 adapter loads a Flux2KleinPipeline or "
                         "Flux2Pipeline directory")
    transformer = Flux2Transformer2DModel.from_pretrained(str(root / "transformer"), torch_dtype=dtype,
                                                          local_files_only=True).to(device)
    vae = load_component(root, "vae", dtype=dtype, device=device)
    if text_encoder is None and has_component(root, "text_encoder"):
        make = flux2_dev_text if pipeline_class == "Flux2Pipeline" else flux2_klein_text
        text_encoder = make(path=root, max_sequence_length=max_sequence_length, device=device, dtype=dtype,
                            min_tokenizer_size=min_tokenizer_size)
    return Flux2Adapter(transformer, text_encoder, vae, negative_prompt=negative_prompt,
                             scheduler_config=read_json(root / "scheduler" / "scheduler_config.json"),
                             is_distilled=bool(index.get("is_distilled", False)), task=task)
