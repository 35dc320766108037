"""HunyuanVideo 1.5 family adapter (diffusers ``HunyuanVideo15Transformer3DModel``, ``HunyuanVideo15Pipeline`` /
``HunyuanVideo15ImageToVideoPipeline``).

==================  ================================================================================================
flowforge           HunyuanVideo 1.5 (checked against diffusers 0.42 ``pipeline_hunyuan_video1_5.py`` (t2v),
                    ``pipeline_hunyuan_video1_5_image2video.py`` (i2v), ``transformer_hunyuan_video15.py``)
==================  ================================================================================================
``sigma`` [B]       ``timestep = (1000 sigma).to(transformer dtype)``: the pipeline passes the scheduler's fp32
                    ``t = 1000 sigma`` cast to the latents' dtype (``__call__``: "timestep =
                    t.expand(latent_model_input.shape[0]).to(latent_model_input.dtype)"), so in bf16 the timestep is
                    rounded to bf16 as there
``x`` [B,C,F,H,W]   t2v: the ``C = latent_channels`` generated latents; the transformer input is
                    ``cat([x, zeros(C), zeros(1)], dim=1)`` (``prepare_cond_latents_and_mask`` of the t2v pipeline:
                    zero condition latents and zero mask, ``in_channels = 2 C + 1``). i2v: ``x`` is the whole
                    ``[latents (C) | condition latents (C) | mask (1)]`` input (the i2v ``torch.cat([latents,
                    cond_latents_concat, mask_concat], dim=1)``), channels ``C:`` being the condition slot
``v`` (fp32)        the transformer output (flow matching, ``noise - x0``: ``scheduler.step`` adds ``dt * out``)
CFG                 ``v_u + g (v_c - v_u)`` (``ClassifierFreeGuidance.forward``: ``pred_uncond + guidance_scale *
                    (pred_cond - pred_uncond)``), the conditional and unconditional branches in two forwards as the
                    guider runs them (``for guider_state_batch in guider_state``); ``g == 1``: the conditional forward
                    alone (the guider's ``num_conditions == 1``). The pipeline reads ``g`` from its ``guider``
                    component, flowforge from ``sampler.guidance_scale``. Not replicated: ``guidance_rescale > 0``
                    and ``use_original_formulation`` (guider defaults 0.0 / False)
VAE latents         ``z_model = z_vae * scaling_factor``; :meth:`HunyuanVideo15Adapter.decode` applies
                    ``z / scaling_factor`` before ``vae.decode`` (``__call__`` step 8), no shift
text                two encoders, through the pipeline's own ``encode_prompt``: Qwen2.5-VL ``hidden_states[-3]`` of
                    the chat-templated prompt padded to ``tokenizer_max_length + crop_start`` and cut by
                    ``crop_start`` (``_get_mllm_prompt_embeds``), and the ByT5 embeddings of the quoted glyph text
                    (``_get_byt5_prompt_embeds``: zeros / mask 0 when the prompt quotes nothing). flowforge stores
                    both in one record: ``cond.prompt_embeds = [mllm (S1) | byt5 (S2)]`` along the sequence, each
                    zero-padded to the wider feature dim, ``cond.mask = [mask (S1) | mask_2 (S2)]``;
                    ``S2 = glyph_length`` (the pipeline's ``tokenizer_2_max_length``, 256) splits them back before
                    every forward. Negative prompt: ``""`` (``encode_prompt(prompt=None)`` encodes ``[""] * B``).
image tokens        t2v: zeros ``[B, vision_num_semantic_tokens = 729, image_embed_dim]`` (the transformer masks
                    them out when all zero: ``is_t2v``). i2v: SigLIP ``last_hidden_state`` of the condition image
                    (``_get_image_embeds``: ``feature_extractor.preprocess(images=..., do_resize=True,
                    do_convert_rgb=True)``), flattened into ``cond.pooled`` and ``cond.negative.pooled`` (the guider
                    gives both branches the same ``image_embeds``)
i2v condition       ``cond.image [N, C + 1, F, h, w]``: the VAE ``argmax`` latent of the image times
                    ``scaling_factor`` in frame 0, zeros after, then the mask channel (1 on frame 0)
                    (``_get_image_latents`` and ``prepare_cond_latents_and_mask`` of the i2v pipeline)
schedule            ``sigmas = linspace(1, 0, T + 1)[:-1]`` through the pipeline's ``FlowMatchEulerDiscreteScheduler``
                    (static ``shift`` from its config: 5.0 / 7.0 in the released 480p / 720p configs, no ``mu``):
                    ``__call__`` step 4 then ``retrieve_timesteps(..., sigmas=sigmas)``
==================  ================================================================================================

Tasks: ``t2v`` (``HunyuanVideo15Pipeline``) and ``i2v`` (``HunyuanVideo15ImageToVideoPipeline``: the model's
``in_channels`` are the same, so one transformer could do either; the released checkpoints are separate). The i2v
pipeline picks the video size from the image's aspect ratio (``calculate_default_height_width`` at the
transformer's ``target_size``) and resizes (``resize_mode="crop"``) the image to it; flowforge generates at
``model.height x model.width`` with the image loaded at that size, which is the pipeline's output when that size is
the image's bucket. Not adapted: ``use_meanflow`` transformers (the step-distilled / super-resolution variants feed
the *next* timestep, ``timestep_r``, which a velocity at one sigma does not know) -- refused at construction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from flowforge.models.reference_images import condition_pil_images
from flowforge.models.base import Conditioning, frozen
from flowforge.models.family import FamilyAdapter
from flowforge.models.load import load_component
from flowforge.models.hunyuan_video15.spec import FAMILY
from flowforge.models.common import (
    DEFAULT_MIN_TOKENIZER_SIZE,
    check_velocity_inputs,
    encode_with_negative,
    has_component,
    pipeline_dir,
    read_json,
    require_negative,
    to_unit_range,
)
from flowforge.models.hunyuan_video15.text import GLYPH_LENGTH, hunyuan_video15_text

HUNYUAN_VIDEO15_TASKS = FAMILY.tasks
VISION_TOKENS = 729
"""Image tokens of the t2v zero ``image_embeds`` (``HunyuanVideo15Pipeline.vision_num_semantic_tokens``)."""

HUNYUAN_VIDEO15_LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                                "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")
"""Image- and text-stream attention projections of every ``HunyuanVideo15TransformerBlock`` (``transformer_blocks.N.
attn.*``). As peft matches suffixes, ``attn.to_q`` / ``to_k`` / ``to_v`` / ``to_out.0`` also wrap the text token
refiner's self-attention (``context_embedder.token_refiner.refiner_blocks.N.attn``): LoRA there adapts the text
stream before the dual-stream blocks."""

PIPELINE_CLASSES = {"t2v": "HunyuanVideo15Pipeline", "i2v": "HunyuanVideo15ImageToVideoPipeline"}


def hunyuan_video15_pipeline_sigmas(scheduler_config: dict[str, Any], num_steps: int) -> Tensor:
    """``[T+1]`` fp32 sigmas of ``HunyuanVideo15Pipeline``: its scheduler on ``linspace(1, 0, T + 1)[:-1]``
    (static shift; the pipeline passes no ``mu``), ending in 0.

    Raises:
        ValueError: ``num_steps`` not an int >= 1; a config with ``use_dynamic_shifting`` (the pipeline would fail
            without ``mu``).
    """
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
    config = {k: v for k, v in scheduler_config.items() if not k.startswith("_")}
    if config.get("use_dynamic_shifting"):
        raise ValueError("scheduler config has use_dynamic_shifting=True; HunyuanVideo15Pipeline passes no mu "
                         "(a static shift is expected)")
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1])
    return scheduler.sigmas.to(torch.float32).cpu()


class HunyuanVideo15Adapter(FamilyAdapter):
    """:class:`~flowforge.models.base.FlowModel` around a diffusers ``HunyuanVideo15Transformer3DModel`` (t2v,
    i2v); the conventions are in the module docstring.

    Args:
        transformer: the transformer (eval mode; its dtype is the forward dtype).
        text_encoder: :func:`.hunyuan_video15_text.hunyuan_video15_text` or any object with ``encode(prompts) ->
            (embeds, mask, None)`` in :func:`.hunyuan_video15_text.join_text`'s layout and ``encoder_id``; ``None``:
            conditioning must come from a cache.
        vae: the ``AutoencoderKLHunyuanVideo15`` (``None``: :meth:`decode` raises; scale factors 4 / 16).
        task: ``"t2v"`` or ``"i2v"``.
        negative_prompt: the unconditional prompt (``None``: no negative encoded).
        scheduler_config: the pipeline's scheduler config.
        image_encoder: the i2v pipeline's ``SiglipVisionModel`` (``image_encoder``).
        feature_extractor: the i2v pipeline's ``SiglipImageProcessor`` (``feature_extractor``).
        glyph_length: ByT5 tokens per prompt (the text records' last ``glyph_length`` tokens).

    Raises:
        ValueError: unknown task; ``in_channels != 2 * out_channels + 1``; a ``use_meanflow`` transformer; i2v with
            a VAE but no ``image_encoder`` / ``feature_extractor``.
    """

    family_spec = FAMILY

    tasks: tuple[str, ...] = HUNYUAN_VIDEO15_TASKS
    cfg_rule = "guidance_scale != 1 (the pipeline's ClassifierFreeGuidance guider)"

    def guidance_use(self, guidance_scale: float) -> str:
        """The guider's ``_is_cfg_enabled``: ``"cfg"`` unless ``guidance_scale`` is close to 1 (below 1 included)."""
        import math

        return "off" if math.isclose(float(guidance_scale), 1.0) else "cfg"
    lora_targets: tuple[str, ...] = HUNYUAN_VIDEO15_LORA_TARGETS

    def __init__(self, transformer: nn.Module, text_encoder: Any = None, vae: nn.Module | None = None, *,
                 task: str = "t2v", negative_prompt: str | None = "", scheduler_config: dict[str, Any] | None = None,
                 image_encoder: nn.Module | None = None, feature_extractor: Any = None,
                 glyph_length: int = GLYPH_LENGTH):
        FAMILY.check_task(task)
        self.transformer = transformer.eval()
        cfg = self.config
        if int(cfg.in_channels) != 2 * int(cfg.out_channels) + 1:
            raise ValueError(f"unsupported HunyuanVideo 1.5 transformer: in_channels={cfg.in_channels}, expected "
                             f"2 * out_channels + 1 = {2 * int(cfg.out_channels) + 1}")
        if getattr(cfg, "use_meanflow", False):
            raise ValueError("this HunyuanVideo 1.5 transformer has use_meanflow=True (it reads the next timestep, "
                             "timestep_r); only use_meanflow=False checkpoints are supported")
        if task == "i2v" and vae is not None and (image_encoder is None or feature_extractor is None):
            raise ValueError("task='i2v' needs image_encoder (SiglipVisionModel) and feature_extractor "
                             "(SiglipImageProcessor), e.g. a HunyuanVideo15ImageToVideoPipeline directory's "
                             "image_encoder/ and feature_extractor/")
        self.text_encoder = text_encoder
        self.vae = frozen(vae)
        self.task = task
        self.negative_prompt = negative_prompt
        self.scheduler_config = dict(scheduler_config or {})
        self.image_encoder = frozen(image_encoder)
        self.feature_extractor = feature_extractor
        self.glyph_length = int(glyph_length)

    # ------------------------------------------------------------------ properties

    @property
    def z_dim(self) -> int:
        return int(self.config.out_channels)

    @property
    def vae_scale_factor_temporal(self) -> int:
        return int(self.vae.temporal_compression_ratio) if self.vae is not None else 4

    @property
    def vae_scale_factor_spatial(self) -> int:
        return int(self.vae.spatial_compression_ratio) if self.vae is not None else 16

    @property
    def image_embed_dim(self) -> int:
        return int(self.config.image_embed_dim)

    # ------------------------------------------------------------------ FlowModel

    def blocks(self) -> list[nn.Module]:
        """The ``HunyuanVideo15TransformerBlock`` modules, in order."""
        return list(self.transformer.transformer_blocks)

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """``[Qwen2.5-VL | ByT5]`` embeds and masks (:func:`.hunyuan_video15_text.join_text`); ``negative`` from
        :attr:`negative_prompt`."""
        return encode_with_negative(self.text_encoder, prompts, self.negative_prompt)

    def latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """``(C, (frames - 1) / 4 + 1, height / 16, width / 16)`` (VAE factors); ``C = 2 z + 1`` for i2v.

        Raises:
            ValueError: ``frames`` missing or ``frames - 1`` not a multiple of the temporal factor; i2v with fewer
                than ``factor + 1`` frames; a size not a positive multiple of ``spatial factor * patch size``.
        """
        ft, fs = self.vae_scale_factor_temporal, self.vae_scale_factor_spatial
        if frames is None or frames < 1 or (frames - 1) % ft:
            raise ValueError(f"HunyuanVideo 1.5 needs frames with (frames - 1) a multiple of {ft} (e.g. 121), "
                             f"got {frames}")
        if self.task == "i2v" and frames < ft + 1:
            raise ValueError(f"model.frames={frames}: task='i2v' needs >= {ft + 1} frames (the first frame is the "
                             "condition image; one frame would generate nothing)")
        p = int(self.config.patch_size)
        if height <= 0 or width <= 0 or height % (fs * p) or width % (fs * p):
            raise ValueError(f"height / width must be positive multiples of {fs * p}, got {height}x{width}")
        channels = 2 * self.z_dim + 1 if self.task == "i2v" else self.z_dim
        return (channels, (frames - 1) // ft + 1, height // fs, width // fs)

    def split_text(self, cond: Conditioning) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``cond``'s record back into the transformer's ``(encoder_hidden_states [B, S1, D1],
        encoder_attention_mask [B, S1], encoder_hidden_states_2 [B, S2, D2], encoder_attention_mask_2 [B, S2])``.

        Raises:
            ValueError: no ``cond.mask``; fewer than ``glyph_length`` tokens; features narrower than the
                transformer's ``text_embed_dim`` / ``text_embed_2_dim``.
        """
        if cond.mask is None:
            raise ValueError("HunyuanVideo 1.5 needs cond.mask (Qwen2.5-VL and ByT5 token masks)")
        e, m = cond.prompt_embeds, cond.mask
        d1, d2, s2 = int(self.config.text_embed_dim), int(self.config.text_embed_2_dim), self.glyph_length
        if e.shape[1] <= s2 or e.shape[2] < max(d1, d2):
            raise ValueError(f"cond.prompt_embeds {tuple(e.shape)}: expected [B, S1 + {s2}, >= {max(d1, d2)}] "
                             "(Qwen2.5-VL tokens then the ByT5 glyph tokens, flowforge.models.hunyuan_video15.adapter)")
        return e[:, :-s2, :d1], m[:, :-s2], e[:, -s2:, :d2], m[:, -s2:]

    def _image_embeds(self, cond: Conditioning, batch: int, device: torch.device) -> Tensor:
        dtype, width = self.dtype, self.image_embed_dim
        if self.task == "t2v":
            return torch.zeros(batch, VISION_TOKENS, width, dtype=dtype, device=device)
        if cond.pooled is None:
            raise ValueError("HunyuanVideo 1.5 i2v needs the SigLIP image tokens in cond.pooled ([B, S_img * "
                             f"{width}], set by condition_on_images); cond.pooled is None")
        return cond.pooled.to(device=device, dtype=dtype).view(batch, -1, width)

    def _forward(self, x: Tensor, sigma: Tensor, cond: Conditioning) -> Tensor:
        dtype, device = self.dtype, x.device
        b = x.shape[0]
        if self.task == "t2v":  # prepare_cond_latents_and_mask (t2v): zero condition latents and mask
            x = torch.cat([x, x.new_zeros(b, self.z_dim + 1, *x.shape[2:])], dim=1)
        e1, m1, e2, m2 = self.split_text(cond)
        out = self.transformer(
            hidden_states=x.to(dtype),
            timestep=(1000.0 * sigma).to(dtype),
            encoder_hidden_states=e1.to(device=device, dtype=dtype),
            encoder_attention_mask=m1.to(device=device, dtype=dtype),
            encoder_hidden_states_2=e2.to(device=device, dtype=dtype),
            encoder_attention_mask_2=m2.to(device=device, dtype=dtype),
            image_embeds=self._image_embeds(cond, b, device),
            return_dict=False,
        )[0]
        return out.float()

    def velocity(self, x: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Velocity ``noise - x0`` at ``x [B, C, F, H, W]``, ``sigma [B]`` in [0, 1]; fp32, shape of ``x`` (i2v:
        0 on the ``z + 1`` condition channels).

        ``guidance_scale != 1`` (the pipeline's guider, ``ClassifierFreeGuidance``: CFG unless the scale is close to
        1, values below 1 included): ``v_u + g (v_c - v_u)`` over ``cond.negative``, in two forwards (conditional
        first) as the guider runs them; ``guidance_scale == 1``: the conditional forward alone.

        Raises:
            ValueError: bad shapes; CFG without ``cond.negative``; no ``cond.mask``; i2v without ``cond.pooled``.
        """
        sigma = check_velocity_inputs(x, sigma, cond, 5)
        g = float(guidance_scale)
        v = self._forward(x, sigma, cond)
        if self.guidance_use(g) == "cfg":
            v_u = self._forward(x, sigma, require_negative(cond, g))
            v = v_u + g * (v - v_u)
        if self.task == "i2v":
            v = torch.cat([v, v.new_zeros(v.shape[0], self.z_dim + 1, *v.shape[2:])], dim=1)
        return v

    # ------------------------------------------------------------------ i2v condition slot (ImageConditioned)

    @property
    def condition_index(self) -> tuple[slice, ...] | None:
        """i2v: the condition channels ``z:`` (condition latents and mask); ``None`` for t2v."""
        return (slice(None), slice(self.z_dim, None)) if self.task == "i2v" else None

    @property
    def generated_index(self) -> tuple[slice, ...]:
        """i2v: the first ``z`` channels; t2v: the whole latent."""
        return (slice(None), slice(0, self.z_dim)) if self.task == "i2v" else (slice(None),)

    def condition_on_images(self, cond: Conditioning, prompts: Sequence[str], images: Tensor,
                            latent_shape: Sequence[int]) -> Conditioning:
        """``cond`` conditioned on the first frames ``images [N, 3, H, W]`` float32 in [0, 1] (``prompts`` unused):
        ``image`` = :meth:`encode_condition_images`, ``pooled`` and ``negative.pooled`` = :meth:`encode_image_tokens`
        flattened to ``[N, S_img * image_embed_dim]`` fp32 (both guider branches get the same ``image_embeds``).

        Raises:
            RuntimeError: not an i2v adapter; no VAE / image encoder.
        """
        image = self.encode_condition_images(images, latent_shape)
        tokens = self.encode_image_tokens(images).flatten(1)
        negative = None if cond.negative is None else dataclasses.replace(cond.negative, pooled=tokens)
        return dataclasses.replace(cond, image=image, pooled=tokens, negative=negative)

    @torch.no_grad()
    def encode_image_tokens(self, images: Tensor) -> Tensor:
        """SigLIP tokens of ``images [N, 3, H, W]`` float32 in [0, 1]: ``[N, S_img, image_embed_dim]`` fp32, as
        ``HunyuanVideo15ImageToVideoPipeline._get_image_embeds``: ``feature_extractor.preprocess(images=...,
        do_resize=True, return_tensors="pt", do_convert_rgb=True)`` on 8-bit RGB PIL images (``round(255 x)``: exact
        for images read from 8-bit files), then ``image_encoder(**inputs).last_hidden_state``.

        Raises:
            RuntimeError: no ``image_encoder`` / ``feature_extractor``.
        """
        if self.image_encoder is None or self.feature_extractor is None:
            raise RuntimeError("encode_image_tokens needs the image_encoder (SiglipVisionModel) and "
                               "feature_extractor (SiglipImageProcessor)")
        pil = condition_pil_images(images)  # round(255 x), as the pipeline's PIL inputs
        param = next(self.image_encoder.parameters())
        inputs = self.feature_extractor.preprocess(images=pil, do_resize=True, return_tensors="pt",
                                                   do_convert_rgb=True).to(device=param.device, dtype=param.dtype)
        return self.image_encoder(**inputs).last_hidden_state.float()

    @torch.no_grad()
    def encode_condition_images(self, images: Tensor, latent_shape: Sequence[int]) -> Tensor:
        """First frames ``images [N, 3, H, W]`` float32 in [0, 1] -> the condition slot ``[N, z + 1, F, h, w]``
        fp32: ``mode(vae.encode(2 x - 1)) * scaling_factor`` in frame 0 and zeros after, then the mask channel (1 on
        frame 0), as ``prepare_cond_latents_and_mask`` of the i2v pipeline.

        Raises:
            RuntimeError: not an i2v adapter, or no VAE. ValueError: the image's latent is not ``latent_shape``'s.
        """
        if self.task != "i2v":
            raise RuntimeError("encode_condition_images needs task='i2v'")
        if self.vae is None:
            raise RuntimeError("encode_condition_images needs the VAE")
        _, f, h, w = latent_shape
        pixels = (images.to(device=self.vae.device, dtype=torch.float32) * 2.0 - 1.0).to(self.vae.dtype)
        z = self._vae_encode(pixels.unsqueeze(2)) * self.vae.config.scaling_factor
        if tuple(z.shape[2:]) != (1, h, w):
            raise ValueError(f"condition images {tuple(images.shape)} encode to latents {tuple(z.shape[1:])}, expected "
                             f"[{self.z_dim}, 1, {h}, {w}]: load them at the model's height x width")
        n = images.shape[0]
        slot = torch.zeros(n, self.z_dim + 1, f, h, w, dtype=torch.float32, device=z.device)
        slot[:, : self.z_dim, :1] = z.float()
        slot[:, self.z_dim, 0] = 1.0
        return slot

    def pipeline_sigmas(self, num_steps: int, height: int, width: int) -> Tensor:
        """The exact ``[T+1]`` fp32 schedule of the pipeline (:func:`hunyuan_video15_pipeline_sigmas`)."""
        return hunyuan_video15_pipeline_sigmas(self.scheduler_config, num_steps)

    # ------------------------------------------------------------------ media

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Latents ``[B, C, F, h, w]`` -> video ``[B, 3, frames, H, W]`` float32 in [0, 1]: ``vae.decode(z /
        scaling_factor)`` of the first ``z`` channels (the generated ones)."""
        self.require_vae("decode")
        z = latents[:, : self.z_dim].to(self.vae.dtype) / self.vae.config.scaling_factor
        # one row at a time: the VAE's mid-block attention fails for batch > 1 in diffusers 0.42 (its causal mask
        # [B, S, S] is not unsqueezed for the head dim; huggingface/diffusers PR #13133)
        return torch.cat([to_unit_range(self.vae.decode(row, return_dict=False)[0]) for row in z.split(1)])

    @torch.no_grad()
    def encode_video(self, video: Tensor) -> Tensor:
        """Video ``[B, 3, frames, H, W]`` in [0, 1] -> model latents ``mode(z) * scaling_factor`` fp32."""
        self.require_vae()
        z = self._vae_encode(video.to(self.vae.device, self.vae.dtype) * 2.0 - 1.0)
        return (z * self.vae.config.scaling_factor).float()

    def _vae_encode(self, pixels: Tensor) -> Tensor:
        """``mode(vae.encode(pixels))`` one row at a time (the batch > 1 failure of :meth:`decode`)."""
        return torch.cat([self.vae.encode(row).latent_dist.mode() for row in pixels.split(1)])



def load_hunyuan_video15(path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                         task: str | None = None, text_encoder: Any = None, negative_prompt: str | None = "",
                         max_sequence_length: int | None = None, glyph_length: int = GLYPH_LENGTH,
                         min_tokenizer_size: int = DEFAULT_MIN_TOKENIZER_SIZE) -> HunyuanVideo15Adapter:
    """Load HunyuanVideo 1.5 from a local diffusers ``HunyuanVideo15Pipeline`` / ``HunyuanVideo15ImageToVideoPipeline``
    directory; never downloads. ``task`` defaults to the pipeline class's (``i2v`` for the image-to-video one). The
    VAE loads in fp32 (the diffusers example decodes in the pipeline dtype; fp32 is the exact choice on CPU and the
    safe one for tiled decoding), the SigLIP image encoder in ``dtype`` like the pipeline, the text encoders lazily.

    Raises:
        FileNotFoundError: not a pipeline directory. ValueError: unknown task; i2v without ``image_encoder`` /
        ``feature_extractor``; see :class:`HunyuanVideo15Adapter`.
    """
    from diffusers import HunyuanVideo15Transformer3DModel

    root = pipeline_dir(path, "HunyuanVideo 1.5")
    index = read_json(root / "model_index.json")
    if task is None:
        task = "i2v" if index.get("_class_name") == PIPELINE_CLASSES["i2v"] else "t2v"
    transformer = HunyuanVideo15Transformer3DModel.from_pretrained(str(root / "transformer"), torch_dtype=dtype,
                                                                   local_files_only=True).to(device)
    vae = load_component(root, "vae", dtype=torch.float32, device=device)
    pipeline_class = index.get("_class_name", PIPELINE_CLASSES["t2v"])
    if text_encoder is None and has_component(root, "text_encoder"):
        text_encoder = hunyuan_video15_text(path=root, max_sequence_length=max_sequence_length,
                                            glyph_length=glyph_length, device=device, dtype=dtype,
                                            min_tokenizer_size=min_tokenizer_size, pipeline_class=pipeline_class)
    image_encoder = feature_extractor = None
    if task == "i2v":
        import transformers

        if has_component(root, "image_encoder"):
            image_encoder = transformers.SiglipVisionModel.from_pretrained(
                str(root / "image_encoder"), dtype=dtype, local_files_only=True).to(device)
        if has_component(root, "feature_extractor"):
            name = index["feature_extractor"][1]
            if name not in ("SiglipImageProcessor", "SiglipImageProcessorPil", "SiglipImageProcessorFast"):
                raise ValueError(f"{root!s}: feature_extractor class {name!r}; expected a SigLIP image processor")
            feature_extractor = getattr(transformers, name).from_pretrained(str(root / "feature_extractor"),
                                                                            local_files_only=True)
    return HunyuanVideo15Adapter(transformer, text_encoder, vae, task=task, negative_prompt=negative_prompt,
                                 scheduler_config=read_json(root / "scheduler" / "scheduler_config.json"),
                                 image_encoder=image_encoder, feature_extractor=feature_extractor,
                                 glyph_length=glyph_length)
