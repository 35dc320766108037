"""FLUX.1 family adapter (diffusers ``FluxTransformer2DModel``, ``FluxPipeline``).

==================  ================================================================================================
flowforge           FLUX transformer (checked against diffusers 0.42 ``pipeline_flux.py`` / ``transformer_flux.py``)
==================  ================================================================================================
``sigma`` [B]       ``timestep = sigma`` (model dtype). The pipeline passes ``timestep / 1000`` with scheduler
                    timesteps ``1000 * sigma`` (pipeline_flux.py ``timestep=timestep / 1000``); the transformer
                    multiplies by 1000 itself (transformer_flux.py ``timestep = timestep.to(...) * 1000``).
``x`` [B,C,H,W]     unpacked latents; packed internally to ``[B, (H/2)(W/2), 4C]`` tokens (``_pack_latents``) with
                    ``img_ids`` from ``_prepare_latent_image_ids`` and ``txt_ids = zeros(S, 3)``
``v`` (fp32)        the unpacked transformer output; FLUX predicts ``noise - x0`` (the scheduler steps
                    ``x + (sigma_next - sigma) * v``), i.e. flowforge's velocity
guidance            FLUX.1-dev (``config.guidance_embeds``): ``guidance_scale`` is fed to the guidance embedding
                    (``guidance = full([B], g)`` fp32, scaled by 1000 inside the transformer) in a *single* forward.
                    This is distilled guidance, **not** CFG: the velocity is one network evaluation, so a replayed
                    step is exact. Models without a guidance embedding (FLUX.1-schnell) use true CFG
                    ``v_u + g (v_c - v_u)`` with ``cond.negative`` (the pipeline's ``true_cfg_scale`` path).
VAE latents         ``z_model = (z_vae - shift_factor) * scaling_factor``; :meth:`FluxAdapter.decode` applies
                    ``z / scaling_factor + shift_factor`` (pipeline_flux.py, before ``vae.decode``)
text                pooled CLIP (``pooler_output``) → ``cond.pooled``; T5 ``last_hidden_state`` padded to
                    ``max_sequence_length`` → ``cond.prompt_embeds``; via ``FluxPipeline.encode_prompt`` itself.
                    FLUX attends the whole T5 context (pad tokens included); no mask is passed.
schedule            dynamic shift: ``mu = calculate_shift((H/2)(W/2), base_image_seq_len, max_image_seq_len,
                    base_shift, max_shift)`` from the scheduler config (:meth:`FluxAdapter.schedule_mu`); Kontext
                    computes ``mu`` from the noisy tokens only (``image_seq_len = latents.shape[1]``): the t2i value
==================  ================================================================================================

Image-to-image (``task="i2i"``, FLUX.1 Kontext; checked against diffusers 0.42 ``pipeline_flux_kontext.py``)
---------------------------------------------------------------------------------------------------------------

Kontext is the same ``FluxTransformer2DModel``; the condition image enters as *extra tokens* of the transformer's
image stream, not inside the latent. So the adapter consumes ``cond.image`` inside :meth:`FluxAdapter.velocity`:
``condition_index`` is ``None``, the whole latent is generated, and the rollout / objectives treat the latent exactly
as in t2i (every element is stepped, scored and trained). What we replicate from ``FluxKontextPipeline``:

* ``_encode_vae_image``: ``z = mode(vae.encode(2 * image - 1))`` (``retrieve_latents(..., sample_mode="argmax")``),
  ``(z - shift_factor) * scaling_factor`` -- :meth:`FluxAdapter.encode_condition_images`;
* ``prepare_latents``: the image latent is 2x2-packed (``_pack_latents``) to ``[N, (h/2)(w/2), 4C]`` and its
  ``image_ids`` are ``_prepare_latent_image_ids`` of the image's latent grid with coordinate 0 set to 1;
* ``__call__``: ``hidden_states = cat([latents, image_latents], dim=1)``, ``img_ids = cat([latent_ids, image_ids])``,
  the prediction is ``noise_pred[:, : latents.size(1)]`` (the noisy tokens); the true-CFG negative forward uses the
  same image tokens and ids; distilled guidance (``guidance_embeds``) is one forward as in t2i.

What we do NOT replicate, both in ``__call__``: (1) the input-image preprocessing (step 3, "Preprocess image"):
with ``_auto_resize=True`` it resizes the image to the ``PREFERRED_KONTEXT_RESOLUTIONS`` entry closest in aspect
ratio and rounds to a multiple of ``vae_scale_factor * 2``, independently of the output size; (2) the output size:
it rescales ``height x width`` to the area ``max_area`` (default ``1024**2``) at the same aspect ratio. flowforge
generates at ``model.height x model.width`` and loads every condition image at that size
(:func:`flowforge.data.images.load_condition_images`), so the image tokens have the same grid as the noisy latent
(``encode_condition_images`` checks this). The pipeline called with ``_auto_resize=False``,
``max_area = height * width`` and an image of the output size is what we reproduce. IP-adapter image embeddings and
pre-encoded ``image`` latents passed to the pipeline are not supported either. In bf16 the pipeline shifts / scales
and packs the image latent in the VAE dtype; we do it in fp32 and cast at the forward (fp32 runs are identical).

Note on the schedule: ``FluxPipeline`` passes ``sigmas = linspace(1, 1/T, T)`` to the scheduler and shifts those;
:func:`flowforge.algorithms.schedules.flow_match_sigmas` (kind "dynamic") starts from ``linspace(1, 1/N_train, T)``
like the scheduler's own default. :meth:`FluxAdapter.pipeline_sigmas` returns the pipeline's exact schedule.
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
from flowforge.models.flux.spec import FAMILY
from flowforge.models.common import (
    DEFAULT_MIN_TOKENIZER_SIZE,
    PackedImageLatents,
    PipelineText,
    check_velocity_inputs,
    dynamic_shift_mu,
    encode_with_negative,
    flow_match_pipeline_sigmas,
    has_component,
    pack_2x2,
    pipeline_dir,
    read_json,
    require_negative,
    unpack_2x2,
    vae_decode_scaled,
    vae_encode_scaled,
)

FLUX_TIMESTEP_SCALE = 1.0
"""FLUX's transformer input is ``sigma`` itself (it scales by 1000 internally)."""

FLUX_LORA_TARGETS = JOINT_ATTENTION_LORA_TARGETS
"""Attention projections of ``FluxTransformerBlock`` (image ``to_*``, text ``add_*`` / ``to_add_out``) and
``FluxSingleTransformerBlock`` (``to_q/k/v``; single blocks have no ``to_out``). These are the module names of the
diffusers FLUX LoRA format that ``FluxPipeline.load_lora_weights`` reads (``transformer.<module>.lora_A``)."""


def _flux_encode_fn(max_sequence_length: int):
    def encode(pipe, prompts: list[str]) -> tuple[Tensor, Tensor | None, Tensor]:
        embeds, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, device=pipe.device,
                                               num_images_per_prompt=1, max_sequence_length=max_sequence_length)
        return embeds, None, pooled

    return encode


def flux_text(*, path: str | Path | None = None, components: dict[str, Any] | None = None,
              max_sequence_length: int = 512, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
              encoder_id: str | None = None, min_tokenizer_size: int = DEFAULT_MIN_TOKENIZER_SIZE) -> PipelineText:
    """CLIP + T5 of a FLUX pipeline (directory ``path`` or ``components`` with ``tokenizer``, ``text_encoder``,
    ``tokenizer_2``, ``text_encoder_2``), encoding through ``FluxPipeline.encode_prompt``."""
    return PipelineText("FluxPipeline", _flux_encode_fn(int(max_sequence_length)), path=path, components=components,
                        skip=("image_encoder", "feature_extractor"), device=device, dtype=dtype,
                        settings=f"t5_len={int(max_sequence_length)}", encoder_id=encoder_id,
                        min_tokenizer_size=min_tokenizer_size)


FLUX_TASKS = FAMILY.tasks
"""Tasks of :class:`FluxAdapter`: text-to-image and FLUX.1 Kontext image-to-image (same transformer class)."""


class FluxAdapter(FamilyAdapter, PackedImageLatents):
    """:class:`~flowforge.models.base.FlowModel` around a diffusers ``FluxTransformer2DModel``; image-to-image
    (FLUX.1 Kontext) through :class:`~flowforge.models.base.ImageConditioned` with the image consumed inside the
    velocity (``condition_index = None``; see the module docstring).

    Args:
        transformer: the ``FluxTransformer2DModel`` (put in eval mode; its dtype is the forward dtype).
        text_encoder: a :class:`~flowforge.models.common.PipelineText` (see :func:`flux_text`) or any object with
            ``encode(prompts) -> (embeds, mask | None, pooled)`` and ``encoder_id``; ``None``: conditioning must
            come from a cache.
        vae: the ``AutoencoderKL`` (``None``: :meth:`decode` raises).
        negative_prompt: CFG's unconditional prompt; ``"default"`` means ``None`` (no negative encoded) for
            guidance-embedding models and ``""`` otherwise.
        scheduler_config: the pipeline's scheduler config (for :meth:`schedule_mu`); ``None``: pipeline defaults.
        task: ``"t2i"`` or ``"i2i"``. In ``"i2i"`` every velocity needs ``cond.image`` (the Kontext image tokens of
            :meth:`encode_condition_images`); in ``"t2i"`` a ``cond.image``, when given, is used the same way.

    Raises:
        ValueError: unknown ``task``.
    """

    family_spec = FAMILY

    family = "FLUX"
    tasks: tuple[str, ...] = FLUX_TASKS
    lora_targets: tuple[str, ...] = FLUX_LORA_TARGETS

    def __init__(self, transformer: nn.Module, text_encoder: Any = None, vae: nn.Module | None = None, *,
                 negative_prompt: str | None = "default", scheduler_config: dict[str, Any] | None = None,
                 task: str = "t2i"):
        FAMILY.check_task(task)
        self.task = task
        self.transformer = transformer.eval()
        self.text_encoder = text_encoder
        self.vae = frozen(vae)
        if negative_prompt == "default":
            negative_prompt = None if self.guidance_embeds else ""
        self.negative_prompt = negative_prompt
        self.scheduler_config = dict(scheduler_config or {})

    # ------------------------------------------------------------------ properties

    cfg_rule = "guidance_scale > 1 (the pipeline's true_cfg_scale); a guidance-embedding model embeds any value"

    def guidance_use(self, guidance_scale: float) -> str:
        """``"embedded"`` for guidance-embedding models, else the pipeline's ``true_cfg_scale > 1``."""
        return "embedded" if self.guidance_embeds else super().guidance_use(guidance_scale)

    @property
    def guidance_embeds(self) -> bool:
        """True for guidance-distilled models (FLUX.1-dev): ``guidance_scale`` feeds the guidance embedding."""
        return bool(self.config.guidance_embeds)

    @property
    def latent_channels(self) -> int:
        return int(self.config.in_channels) // 4

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent cell: ``2 ** (len(block_out_channels) - 1)`` (8 for FLUX; 8 without a VAE, as the
        pipeline assumes)."""
        if self.vae is None:
            return 8
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    # ------------------------------------------------------------------ FlowModel

    def blocks(self) -> list[nn.Module]:
        """The double-stream ``FluxTransformerBlock`` then the single-stream ``FluxSingleTransformerBlock`` modules."""
        return list(self.transformer.transformer_blocks) + list(self.transformer.single_transformer_blocks)

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """T5 embeds ``[B, max_sequence_length, D]`` + pooled CLIP ``[B, P]``; ``negative`` per
        :attr:`negative_prompt`."""
        return encode_with_negative(self.text_encoder, prompts, self.negative_prompt)

    def schedule_mu(self, height: int, width: int) -> float:
        """Dynamic-shift ``mu`` for ``height x width`` pixels, as ``FluxPipeline.__call__`` computes it:
        ``calculate_shift(image_seq_len, base_image_seq_len, max_image_seq_len, base_shift, max_shift)`` with the
        scheduler config's values (pipeline defaults 256 / 4096 / 0.5 / 1.15)."""
        return dynamic_shift_mu(self.scheduler_config, self.image_seq_len(height, width))

    def pipeline_sigmas(self, num_steps: int, height: int, width: int) -> Tensor:
        """The exact ``[T+1]`` fp32 schedule of ``FluxPipeline`` (diffusers' scheduler on ``linspace(1, 1/T, T)``
        with :meth:`schedule_mu`), ending in 0."""
        return flow_match_pipeline_sigmas(self.scheduler_config, num_steps, self.schedule_mu(height, width))

    def _forward(self, x: Tensor, sigma: Tensor, cond: Conditioning, guidance: Tensor | None) -> Tensor:
        """One transformer forward over unpacked ``x [B, C, H, W]``; with ``cond.image`` (Kontext tokens
        ``[B, (H/2)(W/2), 4C]``) appended to the image stream with ids ``(1, row, col)``, output cropped to the
        noisy tokens (``FluxKontextPipeline.__call__``). Returns the unpacked fp32 velocity."""
        if cond.pooled is None:
            raise ValueError("FLUX needs a pooled CLIP embedding (cond.pooled is None)")
        from diffusers import FluxPipeline

        dtype, device = self.dtype, x.device
        b, _, h, w = x.shape
        embeds = cond.prompt_embeds.to(device=device, dtype=dtype)
        tokens = pack_2x2(x.to(dtype))
        num_noisy = tokens.shape[1]
        img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, device, dtype)
        if cond.image is not None:
            image = self._image_tokens(cond.image, tokens.shape)
            tokens = torch.cat([tokens, image.to(device=device, dtype=dtype)], dim=1)
            image_ids = img_ids.clone()
            image_ids[..., 0] = 1  # prepare_latents: "image ids are the same as latent ids with the first dim 1"
            img_ids = torch.cat([img_ids, image_ids], dim=0)
        out = self.transformer(
            hidden_states=tokens,
            timestep=(FLUX_TIMESTEP_SCALE * sigma).to(dtype),
            guidance=guidance,
            pooled_projections=cond.pooled.to(device=device, dtype=dtype),
            encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=device, dtype=dtype),
            img_ids=img_ids,
            return_dict=False,
        )[0]
        return unpack_2x2(out[:, :num_noisy].float(), h, w)

    @staticmethod
    def _image_tokens(image: Tensor, token_shape: Sequence[int]) -> Tensor:
        if tuple(image.shape) != tuple(token_shape):
            raise ValueError(f"cond.image must be the packed Kontext image tokens [B, (H/2)(W/2), 4C] = "
                             f"{tuple(token_shape)} of the latent (encode_condition_images), got {tuple(image.shape)}")
        return image

    def velocity(self, x: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Velocity ``noise - x0`` at unpacked ``x [B, C, H, W]``, ``sigma [B]`` in [0, 1]; fp32, shape of ``x``.

        Guidance-embedding models: one forward with ``guidance = guidance_scale`` (distilled guidance, not CFG).
        Otherwise ``guidance_scale > 1`` is true CFG ``v_u + g (v_c - v_u)`` over ``cond.negative`` (the pipeline's
        ``true_cfg_scale > 1``; one forward over the doubled batch) and any other value the conditional branch
        alone. ``cond.image`` (i2i, Kontext image tokens) conditions both branches: the negative branch sees the
        same image, as in ``FluxKontextPipeline``'s true-CFG forward.

        Raises:
            ValueError: bad shapes; CFG without ``cond.negative``; missing pooled embedding; ``task="i2i"`` without
                ``cond.image``.
        """
        sigma = check_velocity_inputs(x, sigma, cond, 4)
        if self.task == "i2i" and cond.image is None:
            raise ValueError("task='i2i' (FLUX.1 Kontext) needs cond.image: the condition image tokens from "
                             "encode_condition_images (the trainer sets them from each prompt's metadata.image)")
        g = float(guidance_scale)
        if self.guidance_use(g) == "embedded":
            guidance = torch.full((x.shape[0],), g, device=x.device, dtype=torch.float32)
            return self._forward(x, sigma, cond, guidance)
        if self.guidance_use(g) == "off":
            return self._forward(x, sigma, cond, None)
        neg = require_negative(cond, g)
        if neg.pooled is None or cond.pooled is None:
            raise ValueError("FLUX needs a pooled CLIP embedding in cond and cond.negative")
        device = cond.prompt_embeds.device
        image = None if cond.image is None else torch.cat([cond.image, cond.image])
        both = Conditioning(prompt_embeds=torch.cat([neg.prompt_embeds.to(device), cond.prompt_embeds]),
                            pooled=torch.cat([neg.pooled.to(device), cond.pooled.to(device)]), image=image)
        v_u, v_c = self._forward(torch.cat([x, x]), torch.cat([sigma, sigma]), both, None).chunk(2)
        return v_u + g * (v_c - v_u)

    def condition_on_images(self, cond: Conditioning, prompts: Sequence[str], images: Tensor,
                            latent_shape: Sequence[int]) -> Conditioning:
        """``cond`` with ``image`` = :meth:`encode_condition_images` (``ImageConditioned``; ``prompts`` unused)."""
        return dataclasses.replace(cond, image=self.encode_condition_images(images, latent_shape))

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Unpacked latents ``[B, C, h, w]`` → images ``[B, 3, h f, w f]`` float32 in [0, 1]."""
        self.require_vae("decode")
        return vae_decode_scaled(self.vae, latents)

    @torch.no_grad()
    def encode_images(self, images: Tensor) -> Tensor:
        """Images ``[B, 3, H, W]`` in [0, 1] → model latents ``(mode(z) - shift_factor) * scaling_factor`` fp32."""
        self.require_vae()
        return vae_encode_scaled(self.vae, images)



def load_flux(path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
              task: str = "t2i", text_encoder: Any = None, negative_prompt: str | None = "default",
              max_sequence_length: int = 512, min_tokenizer_size: int = DEFAULT_MIN_TOKENIZER_SIZE) -> FluxAdapter:
    """Load a FLUX model from a local diffusers pipeline directory (``FluxPipeline.save_pretrained`` or, for
    ``task="i2i"``, ``FluxKontextPipeline.save_pretrained``); never downloads.

    The transformer and VAE are loaded now; the text encoders lazily, on the first :meth:`FluxAdapter.encode`. A
    Kontext directory has the same components as a ``FluxPipeline`` one (only ``model_index.json``'s
    ``_class_name`` differs), so its text encoders load through ``FluxPipeline`` as well.

    Raises:
        FileNotFoundError: ``path`` is not a pipeline directory.
        ValueError: ``task`` not in ``("t2i", "i2i")``.
    """
    from diffusers import FluxTransformer2DModel

    root = pipeline_dir(path, "FLUX")
    transformer = FluxTransformer2DModel.from_pretrained(str(root / "transformer"), torch_dtype=dtype,
                                                         local_files_only=True).to(device)
    vae = load_component(root, "vae", dtype=dtype, device=device)
    if text_encoder is None and has_component(root, "text_encoder_2"):
        text_encoder = flux_text(path=root, max_sequence_length=max_sequence_length, device=device, dtype=dtype,
                                 min_tokenizer_size=min_tokenizer_size)
    scheduler_config = read_json(root / "scheduler" / "scheduler_config.json")
    return FluxAdapter(transformer, text_encoder, vae, negative_prompt=negative_prompt,
                       scheduler_config=scheduler_config, task=task)
