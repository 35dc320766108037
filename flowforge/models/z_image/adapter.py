"""Z-Image family adapter (Z-Image base and Z-Image-Turbo; diffusers ``ZImageTransformer2DModel``, ``ZImagePipeline``).

==================  ================================================================================================
flowforge           Z-Image (checked against diffusers 0.42 ``pipeline_z_image.py`` / ``transformer_z_image.py``)
==================  ================================================================================================
``sigma`` [B]       native ``t = (1000 - 1000 sigma) / 1000`` fp32, i.e. ``1 - sigma`` (1 = clean): the pipeline
                    computes ``timestep = (1000 - t) / 1000`` from the scheduler's ``t = 1000 sigma``
                    (``__call__``, "timestep = (1000 - timestep) / 1000"); the transformer embeds ``t * t_scale``
                    (``forward``: ``self.t_embedder(t * self.t_scale)``). We form it the same way, so it is the same
                    fp32 number.
``x`` [B,C,H,W]     unpacked latents; the transformer takes a *list* of ``[C, 1, H, W]`` tensors (``latents.unsqueeze
                    (2)`` then ``unbind(0)``) and patchifies 2x2 itself; no packing on our side
``v`` (fp32)        ``v = -out``: Z-Image predicts ``x0 - noise`` and the pipeline negates it before
                    ``scheduler.step`` ("noise_pred = -noise_pred"), which steps ``x + (sigma_next - sigma) v``
guidance            true CFG. The pipeline's ``guidance_scale`` ``g_p`` gives ``pos + g_p (pos - neg)`` (CFG on when
                    ``g_p > 0``, ``do_classifier_free_guidance``); flowforge's ``v_u + g (v_c - v_u)`` is the same
                    with ``g = 1 + g_p``, computed in the pipeline's order ``v_c + (g - 1)(v_c - v_u)`` in one
                    forward over ``[cond; negative]`` (positive half first, as ``prompt_embeds +
                    negative_prompt_embeds``). ``g == 1`` (Turbo's ``guidance_scale=0``) is the conditional branch
                    alone. Not replicated: ``cfg_normalization`` (default False) and ``cfg_truncation < 1``
                    (default 1.0: never truncates).
VAE latents         ``z_model = (z_vae - shift_factor) * scaling_factor``; :meth:`ZImageAdapter.decode` applies
                    ``z / scaling_factor + shift_factor`` (``__call__``, before ``vae.decode``)
text                Qwen3 ``hidden_states[-2]`` of the chat-templated prompt (``_encode_prompt``:
                    ``apply_chat_template(..., add_generation_prompt=True, enable_thinking=True)``, padded to
                    ``max_sequence_length``), cut to the real tokens (``prompt_embeds[i][prompt_masks[i]]``): the
                    pipeline hands the transformer a list of variable-length embeddings. We call the pipeline's own
                    ``encode_prompt``, zero-pad each to ``max_sequence_length`` in ``cond.prompt_embeds`` with
                    ``cond.mask``, and cut them back to the real tokens before every forward. Negative prompt:
                    ``""`` per prompt (``encode_prompt``'s default).
schedule            ``sigmas = linspace(1, 1/T, T)`` (``get_default_z_image_sigmas``) through the scheduler with
                    ``mu = calculate_shift((H/2)(W/2), ...)`` from the scheduler config (used only when the config
                    has ``use_dynamic_shifting``; Z-Image's own configs use a static ``shift``). The scheduler's
                    default ``use_dynamic_shifting`` (False) applies when the config omits it.
==================  ================================================================================================

Tasks: ``t2i`` only (``ZImagePipeline``; the img2img / inpaint / omni pipelines are not adapted).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from flowforge.models.base import Conditioning, frozen
from flowforge.models.family import FamilyAdapter
from flowforge.models.load import load_component
from flowforge.models.z_image.spec import FAMILY
from flowforge.models.common import (
    DEFAULT_MIN_TOKENIZER_SIZE,
    PackedImageLatents,
    PipelineText,
    check_velocity_inputs,
    dynamic_shift_mu,
    encode_with_negative,
    flow_match_pipeline_sigmas,
    has_component,
    pipeline_dir,
    read_json,
    require_negative,
    vae_decode_scaled,
    vae_encode_scaled,
)

Z_IMAGE_TASKS = FAMILY.tasks

Z_IMAGE_LORA_TARGETS = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0")
"""Attention projections of every ``ZImageTransformerBlock`` (noise refiner, context refiner, main layers): the
module names of diffusers' Z-Image LoRA format (``ZImageLoraLoaderMixin``, ``transformer.<module>.lora_A``)."""


def _z_image_encode_fn(max_sequence_length: int):
    def encode(pipe, prompts: list[str]) -> tuple[Tensor, Tensor, None]:
        # encode_prompt rewrites its list in place (the chat template): hand it a copy
        embeds, _ = pipe.encode_prompt(prompt=list(prompts), device=pipe.device, do_classifier_free_guidance=False,
                                       max_sequence_length=max_sequence_length)
        dim = embeds[0].shape[-1]
        out = embeds[0].new_zeros(len(embeds), max_sequence_length, dim)
        mask = torch.zeros(len(embeds), max_sequence_length, dtype=torch.long, device=embeds[0].device)
        for i, e in enumerate(embeds):
            out[i, : e.shape[0]] = e
            mask[i, : e.shape[0]] = 1
        return out, mask, None

    return encode


def z_image_text(*, path: str | Path | None = None, components: dict[str, Any] | None = None,
                 max_sequence_length: int = 512, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, encoder_id: str | None = None,
                 min_tokenizer_size: int = DEFAULT_MIN_TOKENIZER_SIZE) -> PipelineText:
    """The Qwen3 text side of a Z-Image pipeline (directory ``path`` or ``components`` with ``tokenizer`` and
    ``text_encoder``), encoding through ``ZImagePipeline.encode_prompt``: ``(embeds [B, max_sequence_length, D]
    zero-padded, mask [B, max_sequence_length], None)``."""
    return PipelineText("ZImagePipeline", _z_image_encode_fn(int(max_sequence_length)), path=path,
                        components=components, device=device, dtype=dtype,
                        settings=f"len={int(max_sequence_length)}", encoder_id=encoder_id,
                        min_tokenizer_size=min_tokenizer_size)


def z_image_pipeline_sigmas(scheduler_config: dict[str, Any], num_steps: int, mu: float) -> Tensor:
    """``[T+1]`` fp32 sigmas of ``ZImagePipeline``: its scheduler (config defaults: diffusers'; in particular no
    dynamic shifting unless the config says so) on ``linspace(1, 1/T, T)`` with ``mu``."""
    config = dict(scheduler_config)
    config.setdefault("use_dynamic_shifting", False)  # FlowMatchEulerDiscreteScheduler's default
    return flow_match_pipeline_sigmas(config, num_steps, mu)


class ZImageAdapter(FamilyAdapter, PackedImageLatents):
    """:class:`~flowforge.models.base.FlowModel` around a diffusers ``ZImageTransformer2DModel`` (Z-Image,
    Z-Image-Turbo); the conventions are in the module docstring.

    Args:
        transformer: the ``ZImageTransformer2DModel`` (put in eval mode; its dtype is the forward dtype).
        text_encoder: a :class:`~flowforge.models.common.PipelineText` (:func:`z_image_text`) or any object with
            ``encode(prompts) -> (embeds [B, S, D], mask [B, S], None)`` and ``encoder_id``; ``None``: conditioning
            must come from a cache.
        vae: the ``AutoencoderKL`` (``None``: :meth:`decode` raises).
        negative_prompt: CFG's unconditional prompt (pipeline default ``""``); ``None``: no negative encoded
            (guidance-free only, e.g. Turbo).
        scheduler_config: the pipeline's scheduler config (``None``: the scheduler's defaults).
        task: ``"t2i"``.

    Raises:
        ValueError: unknown ``task``.
    """

    family_spec = FAMILY

    family = "Z-Image"
    tasks: tuple[str, ...] = Z_IMAGE_TASKS
    cfg_rule = "guidance_scale > 1 (the pipeline's guidance_scale = flowforge's - 1 > 0)"
    lora_targets: tuple[str, ...] = Z_IMAGE_LORA_TARGETS

    def __init__(self, transformer: nn.Module, text_encoder: Any = None, vae: nn.Module | None = None, *,
                 negative_prompt: str | None = "", scheduler_config: dict[str, Any] | None = None,
                 task: str = "t2i"):
        FAMILY.check_task(task)
        self.task = task
        self.transformer = transformer.eval()
        self.text_encoder = text_encoder
        self.vae = frozen(vae)
        self.negative_prompt = negative_prompt
        self.scheduler_config = dict(scheduler_config or {})

    @property
    def latent_channels(self) -> int:
        return int(self.config.in_channels)

    @property
    def vae_scale_factor(self) -> int:
        """``2 ** (len(block_out_channels) - 1)`` (8 for Z-Image; 8 without a VAE, as the pipeline assumes)."""
        if self.vae is None:
            return 8
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    def blocks(self) -> list[nn.Module]:
        """The ``ZImageTransformerBlock`` modules: noise refiner, context refiner, then the main layers."""
        t = self.transformer
        return list(t.noise_refiner) + list(t.context_refiner) + list(t.layers)

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """Qwen3 embeds ``[B, max_sequence_length, D]`` (zero-padded) + ``mask``; ``negative`` per
        :attr:`negative_prompt`."""
        return encode_with_negative(self.text_encoder, prompts, self.negative_prompt)

    def schedule_mu(self, height: int, width: int) -> float:
        """``mu = calculate_shift((H/2)(W/2), ...)`` with the scheduler config's values, as ``ZImagePipeline``."""
        return dynamic_shift_mu(self.scheduler_config, self.image_seq_len(height, width))

    def pipeline_sigmas(self, num_steps: int, height: int, width: int) -> Tensor:
        """The exact ``[T+1]`` fp32 schedule of ``ZImagePipeline`` (:func:`z_image_pipeline_sigmas`), ending in 0."""
        return z_image_pipeline_sigmas(self.scheduler_config, num_steps, self.schedule_mu(height, width))

    def _forward(self, x: Tensor, sigma: Tensor, cond: Conditioning) -> Tensor:
        """One transformer forward over ``x [N, C, H, W]`` with ``cond`` (``mask`` required) -> ``v [N, C, H, W]``
        fp32."""
        if cond.mask is None:
            raise ValueError("Z-Image needs cond.mask (the real tokens of each prompt embedding)")
        dtype = self.dtype
        embeds = cond.prompt_embeds.to(device=x.device, dtype=dtype)
        mask = cond.mask.to(x.device).bool()
        caps = [embeds[i][mask[i]] for i in range(embeds.shape[0])]
        t = (1000.0 - sigma * 1000.0) / 1000.0  # the pipeline's timestep, from the scheduler's 1000 sigma
        out = self.transformer(list(x.to(dtype).unsqueeze(2).unbind(0)), t, caps, return_dict=False)[0]
        return -torch.stack([o.float() for o in out]).squeeze(2)

    def velocity(self, x: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Velocity ``noise - x0`` at ``x [B, C, H, W]``, ``sigma [B]`` in [0, 1]; fp32, shape of ``x``.

        ``guidance_scale > 1`` (the pipeline's ``guidance_scale = g - 1 > 0``, its ``do_classifier_free_guidance``):
        true CFG ``v_c + (g - 1)(v_c - v_u)`` over ``cond.negative``, one forward over the doubled batch; any other
        value: the conditional branch alone.

        Raises:
            ValueError: bad shapes; CFG without ``cond.negative``; no ``cond.mask``.
        """
        sigma = check_velocity_inputs(x, sigma, cond, 4)
        g = float(guidance_scale)
        if self.guidance_use(g) != "cfg":
            return self._forward(x, sigma, cond)
        neg = require_negative(cond, g)
        if neg.mask is None or cond.mask is None:
            raise ValueError("Z-Image needs cond.mask and cond.negative.mask")
        device = cond.prompt_embeds.device
        # pad both halves to one length (masks keep the real tokens) and put the positive half first
        length = max(cond.prompt_embeds.shape[1], neg.prompt_embeds.shape[1])

        def padded(c: Conditioning) -> tuple[Tensor, Tensor]:
            extra = length - c.prompt_embeds.shape[1]
            e = torch.nn.functional.pad(c.prompt_embeds.to(device), (0, 0, 0, extra))
            return e, torch.nn.functional.pad(c.mask.to(device), (0, extra))

        (e_c, m_c), (e_u, m_u) = padded(cond), padded(neg)
        both = Conditioning(prompt_embeds=torch.cat([e_c, e_u]), mask=torch.cat([m_c, m_u]))
        v_c, v_u = self._forward(torch.cat([x, x]), torch.cat([sigma, sigma]), both).chunk(2)
        return v_c + (g - 1.0) * (v_c - v_u)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Latents ``[B, C, h, w]`` → images ``[B, 3, h f, w f]`` float32 in [0, 1]."""
        self.require_vae("decode")
        return vae_decode_scaled(self.vae, latents)

    @torch.no_grad()
    def encode_images(self, images: Tensor) -> Tensor:
        """Images ``[B, 3, H, W]`` in [0, 1] → model latents ``(mode(z) - shift_factor) * scaling_factor`` fp32."""
        self.require_vae()
        return vae_encode_scaled(self.vae, images)



def load_z_image(path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 task: str = "t2i", text_encoder: Any = None, negative_prompt: str | None = "",
                 max_sequence_length: int = 512,
                 min_tokenizer_size: int = DEFAULT_MIN_TOKENIZER_SIZE) -> ZImageAdapter:
    """Load Z-Image / Z-Image-Turbo from a local diffusers ``ZImagePipeline`` directory; never downloads. The
    transformer and VAE load now, the Qwen3 text encoder lazily on the first :meth:`ZImageAdapter.encode`.

    Raises:
        FileNotFoundError: ``path`` is not a pipeline directory.
        ValueError: ``task`` is not ``"t2i"``.
    """
    from diffusers import ZImageTransformer2DModel

    root = pipeline_dir(path, "Z-Image")
    transformer = ZImageTransformer2DModel.from_pretrained(str(root / "transformer"), torch_dtype=dtype,
                                                           local_files_only=True).to(device)
    vae = load_component(root, "vae", dtype=dtype, device=device)
    if text_encoder is None and has_component(root, "text_encoder"):
        text_encoder = z_image_text(path=root, max_sequence_length=max_sequence_length, device=device, dtype=dtype,
                                    min_tokenizer_size=min_tokenizer_size)
    scheduler_config = read_json(root / "scheduler" / "scheduler_config.json")
    return ZImageAdapter(transformer, text_encoder, vae, negative_prompt=negative_prompt,
                         scheduler_config=scheduler_config, task=task)
