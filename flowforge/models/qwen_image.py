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
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from flowforge.models.base import AdapterMixin, Conditioning
from flowforge.models.common import (
    DEFAULT_MIN_TOKENIZER_SIZE,
    PackedImageLatents,
    PipelineText,
    check_velocity_inputs,
    encode_with_negative,
    has_component,
    latent_stats,
    pack_2x2,
    pipeline_dir,
    read_json,
    require_negative,
    to_unit_range,
    unpack_2x2,
)
from flowforge.models.flux import FLUX_SCHEDULER_DEFAULTS, _pipeline_sigmas

QWEN_TIMESTEP_SCALE = 1.0
"""Qwen-Image's transformer input is ``sigma`` itself (its time projection scales by 1000)."""

QWEN_IMAGE_LORA_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)
"""Joint-attention projections of ``QwenImageTransformerBlock`` (image ``to_*``, text ``add_*`` / ``to_add_out``),
the module names of diffusers' Qwen-Image LoRA format (``QwenImagePipeline.load_lora_weights``)."""


def _qwen_encode_fn(max_sequence_length: int):
    def encode(pipe, prompts: list[str]) -> tuple[Tensor, Tensor, None]:
        embeds, mask = pipe.encode_prompt(prompt=prompts, device=pipe.device, num_images_per_prompt=1,
                                          max_sequence_length=max_sequence_length)
        b, s, d = embeds.shape
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(b, s, dtype=torch.long, device=embeds.device)
        pad = max_sequence_length - s
        embeds = torch.cat([embeds, embeds.new_zeros(b, pad, d)], dim=1)
        mask = torch.cat([mask.long(), mask.new_zeros(b, pad).long()], dim=1)
        return embeds, mask, None

    return encode


def qwen_image_text(*, path: str | Path | None = None, components: dict[str, Any] | None = None,
                    max_sequence_length: int = 512, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, encoder_id: str | None = None,
                    min_tokenizer_size: int = DEFAULT_MIN_TOKENIZER_SIZE) -> PipelineText:
    """Qwen2.5-VL of a Qwen-Image pipeline (directory ``path`` or ``components`` with ``tokenizer`` and
    ``text_encoder``) through ``QwenImagePipeline.encode_prompt``; rows zero-padded to ``max_sequence_length``."""
    if not 1 <= max_sequence_length <= 1024:
        raise ValueError(f"max_sequence_length must be in 1..1024 (QwenImagePipeline's limit), got "
                         f"{max_sequence_length}")
    return PipelineText("QwenImagePipeline", _qwen_encode_fn(int(max_sequence_length)), path=path,
                        components=components, device=device, dtype=dtype,
                        settings=f"max_len={int(max_sequence_length)}", encoder_id=encoder_id,
                        min_tokenizer_size=min_tokenizer_size)


class QwenImageAdapter(AdapterMixin, PackedImageLatents):
    """:class:`~flowforge.models.base.FlowModel` around a diffusers ``QwenImageTransformer2DModel`` (text-to-image).

    Args:
        transformer: the ``QwenImageTransformer2DModel`` (eval mode; its dtype is the forward dtype).
        text_encoder: :func:`qwen_image_text` or any object with ``encode(prompts) -> (embeds, mask, None)`` and
            ``encoder_id``; ``None``: conditioning must come from a cache.
        vae: the ``AutoencoderKLQwenImage`` (``None``: :meth:`decode` raises).
        negative_prompt: the unconditional prompt (the pipeline's examples use ``" "``; ``None`` encodes none).
        cfg_renorm: rescale the CFG output to the conditional norm per token, as ``QwenImagePipeline`` does.
        scheduler_config: the pipeline's scheduler config (for :meth:`schedule_mu`).

    Raises:
        ValueError: edit / layered variants (``zero_cond_t``, ``use_additional_t_cond``, guidance embeds).
    """

    family = "Qwen-Image"
    tasks: tuple[str, ...] = ("t2i",)
    lora_targets: tuple[str, ...] = QWEN_IMAGE_LORA_TARGETS

    def __init__(self, transformer: nn.Module, text_encoder: Any = None, vae: nn.Module | None = None, *,
                 negative_prompt: str | None = " ", cfg_renorm: bool = True,
                 scheduler_config: dict[str, Any] | None = None):
        cfg = transformer.config
        unsupported = [k for k in ("zero_cond_t", "use_additional_t_cond", "guidance_embeds", "use_layer3d_rope")
                       if getattr(cfg, k, False)]
        if unsupported:
            raise ValueError(f"QwenImageAdapter supports the text-to-image transformer only; this one sets "
                             f"{unsupported} (edit / layered variants are not implemented)")
        self.transformer = transformer.eval()
        self.text_encoder = text_encoder
        self.vae = vae.eval().requires_grad_(False) if vae is not None else None
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

    def blocks(self) -> list[nn.Module]:
        """The ``QwenImageTransformerBlock`` modules, in order."""
        return list(self.transformer.transformer_blocks)

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """Qwen2.5-VL embeds ``[B, max_sequence_length, D]`` with ``mask`` (1 = real token); ``negative`` from
        :attr:`negative_prompt`."""
        return encode_with_negative(self.text_encoder, prompts, self.negative_prompt)

    def schedule_mu(self, height: int, width: int) -> float:
        """``mu`` as ``QwenImagePipeline.__call__`` computes it: ``calculate_shift(image_seq_len, base_image_seq_len,
        max_image_seq_len, base_shift, max_shift)`` from the scheduler config (fallbacks 256 / 4096 / 0.5 / 1.15)."""
        from flowforge.algorithms.schedules import calculate_shift

        cfg = {k: self.scheduler_config.get(k, v) for k, v in FLUX_SCHEDULER_DEFAULTS.items()}
        return calculate_shift(self.image_seq_len(height, width), cfg["base_image_seq_len"],
                               cfg["max_image_seq_len"], cfg["base_shift"], cfg["max_shift"])

    def pipeline_sigmas(self, num_steps: int, height: int, width: int) -> Tensor:
        """The exact ``[T+1]`` fp32 schedule of ``QwenImagePipeline`` (incl. ``shift_terminal``), ending in 0."""
        return _pipeline_sigmas(self.scheduler_config, num_steps, self.schedule_mu(height, width))

    def _forward_packed(self, x: Tensor, sigma: Tensor, embeds: Tensor, mask: Tensor | None) -> Tensor:
        dtype, device = self.dtype, x.device
        b, _, h, w = x.shape
        if mask is not None:
            mask = mask.to(device)
            used = mask.bool().any(dim=0).nonzero()
            keep = int(used.max()) + 1 if used.numel() else mask.shape[1]
            embeds, mask = embeds[:, :keep], mask[:, :keep]
            if bool(mask.all()):
                mask = None  # as QwenImagePipeline.encode_prompt: an all-ones mask is dropped
        out = self.transformer(
            hidden_states=pack_2x2(x.to(dtype)),
            timestep=(QWEN_TIMESTEP_SCALE * sigma).to(dtype),
            encoder_hidden_states=embeds.to(device=device, dtype=dtype),
            encoder_hidden_states_mask=mask,
            img_shapes=[[(1, h // 2, w // 2)]] * b,
            return_dict=False,
        )[0]
        return out.float()

    def velocity(self, x: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Velocity ``noise - x0`` at unpacked ``x [B, C, H, W]``, ``sigma [B]`` in [0, 1]; fp32, shape of ``x``.

        ``guidance_scale == 1``: the conditional forward alone. Otherwise true CFG over ``cond.negative`` (two
        forwards, as the pipeline: the two encodings may differ in length), renormalised when :attr:`cfg_renorm`.

        Raises:
            ValueError: bad shapes; CFG without ``cond.negative``.
        """
        sigma = check_velocity_inputs(x, sigma, cond, 4)
        h, w = x.shape[-2:]
        g = float(guidance_scale)
        v_c = self._forward_packed(x, sigma, cond.prompt_embeds, cond.mask)
        if g != 1.0:
            neg = require_negative(cond, g)
            v_u = self._forward_packed(x, sigma, neg.prompt_embeds, neg.mask)
            comb = v_u + g * (v_c - v_u)
            if self.cfg_renorm:
                comb = comb * (torch.norm(v_c, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
            v_c = comb
        return unpack_2x2(v_c, h, w)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Unpacked latents ``[B, C, h, w]`` → images ``[B, 3, h f, w f]`` float32 in [0, 1]."""
        if self.vae is None:
            raise RuntimeError("this QwenImageAdapter has no VAE; decode is unavailable")
        z = latents.unsqueeze(2).to(self.vae.dtype)
        mean, inv_std = latent_stats(self.vae, z)
        z = z / inv_std + mean
        return to_unit_range(self.vae.decode(z, return_dict=False)[0][:, :, 0])

    @torch.no_grad()
    def encode_images(self, images: Tensor) -> Tensor:
        """Images ``[B, 3, H, W]`` in [0, 1] → model latents ``(mode(z) - mean) / std`` fp32 ``[B, C, h, w]``."""
        if self.vae is None:
            raise RuntimeError("this QwenImageAdapter has no VAE")
        z = self.vae.encode((images.to(self.vae.dtype) * 2.0 - 1.0).unsqueeze(2)).latent_dist.mode()
        mean, inv_std = latent_stats(self.vae, z)
        return ((z - mean) * inv_std)[:, :, 0].float()

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: Any) -> QwenImageAdapter:
        """Same as :func:`load_qwen_image`."""
        return load_qwen_image(path, **kwargs)


def load_qwen_image(path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                    text_encoder: Any = None, negative_prompt: str | None = " ", cfg_renorm: bool = True,
                    max_sequence_length: int = 512,
                    min_tokenizer_size: int = DEFAULT_MIN_TOKENIZER_SIZE) -> QwenImageAdapter:
    """Load Qwen-Image from a local diffusers pipeline directory (``QwenImagePipeline.save_pretrained``).

    The transformer and VAE load now; the Qwen2.5-VL text encoder lazily on the first encode. Never downloads.

    Raises:
        FileNotFoundError: ``path`` is not a pipeline directory.
    """
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    root = pipeline_dir(path, "Qwen-Image")
    transformer = QwenImageTransformer2DModel.from_pretrained(str(root / "transformer"), torch_dtype=dtype,
                                                              local_files_only=True).to(device)
    vae = None
    if has_component(root, "vae"):
        vae = AutoencoderKLQwenImage.from_pretrained(str(root / "vae"), torch_dtype=dtype,
                                                     local_files_only=True).to(device)
    if text_encoder is None and has_component(root, "text_encoder"):
        text_encoder = qwen_image_text(path=root, max_sequence_length=max_sequence_length, device=device,
                                       dtype=dtype, min_tokenizer_size=min_tokenizer_size)
    return QwenImageAdapter(transformer, text_encoder, vae, negative_prompt=negative_prompt, cfg_renorm=cfg_renorm,
                            scheduler_config=read_json(root / "scheduler" / "scheduler_config.json"))
