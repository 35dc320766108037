"""Wan 2.1 / 2.2 family adapter (diffusers ``WanTransformer3DModel``, ``WanPipeline`` / ``WanImageToVideoPipeline``).

==================  ================================================================================================
flowforge           Wan transformer (checked against diffusers 0.42 ``pipeline_wan.py``, ``pipeline_wan_i2v.py``,
                    ``transformer_wan.py``)
==================  ================================================================================================
``sigma`` [B]       ``timestep = 1000 * sigma``, float32 (the pipeline passes the scheduler's fp32 ``t`` unchanged:
                    ``timestep = t.expand(latents.shape[0])``; the time embedder is kept in fp32)
``x`` [B,C,F,H,W]   video latents, ``F = (frames - 1) / 4 + 1``, ``H = height / 8`` (VAE ``scale_factor_*``)
``v`` (fp32)        the transformer output (Wan predicts ``noise - x0``, flow matching)
CFG                 ``v_u + g (v_c - v_u)`` over ``cond.negative`` (pipeline ``noise_uncond + guidance_scale *
                    (noise_pred - noise_uncond)``); ``g == 1``: the conditional forward alone
VAE latents         per channel: ``z_model = (z_vae - latents_mean) / latents_std``; :meth:`WanAdapter.decode`
                    applies ``z / (1 / latents_std) + latents_mean`` (pipeline_wan.py, before ``vae.decode``)
text                UMT5 ``last_hidden_state`` cut to the real tokens and zero-padded to ``max_sequence_length``
                    (``_get_t5_prompt_embeds``, 512 in ``__call__``) via that pipeline method itself; the
                    transformer gets no mask (it attends the zero rows), ``cond.mask`` records the real tokens
schedule            kind ``"wan"`` (``flow_match_sigmas(T, shift, kind="wan")``). The diffusers Wan docs use
                    ``flow_shift = 5.0`` for 720p and ``3.0`` for 480p (pipeline_wan.py example);
                    :attr:`WanAdapter.default_shift` reads ``flow_shift`` / ``shift`` from the pipeline's scheduler
                    config and falls back to 5.0 (``WAN_DEFAULT_SHIFT``, Wan2.1's own t2v default).
==================  ================================================================================================

Image-to-video (``task="i2v"``): the condition travels *inside the latent*, so rows stay independent and every
``Conditioning`` / trajectory operation works unchanged. Two layouts, chosen by the transformer:

* **first-frame pin** (Wan2.2 TI2V, pipeline ``expand_timesteps=True``): latent frame 0 *is* the VAE latent of the
  input image. The transformer gets timestep 0 on frame-0 tokens (``temp_ts = (first_frame_mask * t)``) and the
  returned velocity is 0 there.
* **channel concat** (Wan2.1 I2V, ``in_channels = 2 z + 4``): ``x = [latents (z) | mask (4) | image latent (z)]``
  along channels, exactly the pipeline's ``torch.cat([latents, condition], dim=1)``; the velocity is 0 on the
  ``z + 4`` condition channels.
* **CLIP image tokens** (Wan2.1-I2V-14B-480P / -720P: ``transformer.config.image_dim`` set, concat layout):
  :meth:`WanAdapter.encode_image_tokens` replicates ``WanImageToVideoPipeline.encode_image``
  (``pipeline_wan_i2v.py``: the pipeline's ``image_processor`` then ``image_encoder(..., output_hidden_states=True)
  .hidden_states[-2]``, ``[N, S_img, image_dim]``; 257 x 1280 for the released ViT-H/14); :meth:`condition_on_images`
  puts them, flattened to ``[N, S_img * image_dim]`` fp32, into ``cond.pooled`` *and* ``cond.negative.pooled``:
  the pipeline passes the same ``encoder_hidden_states_image`` to its conditional and unconditional forwards, and
  :meth:`WanAdapter.velocity` concatenates ``negative.pooled`` / ``pooled`` like the text. Such a transformer's
  cross-attention takes the last 512 context tokens as text (``WanAttnProcessor``: "512 is the context length of
  the text encoder, hardcoded"), so the prompt embeddings must be 512 tokens (``max_sequence_length=512``).

In both layouts the loop (:mod:`flowforge.rollout`) writes :meth:`WanAdapter.encode_condition_images` (via
:meth:`WanAdapter.condition_on_images`) of the
prompt's first-frame image into :attr:`WanAdapter.condition_index` of the start latent and of every forward-process
visit, steps only :attr:`WanAdapter.generated_index` (so the slot is re-pinned after every stochastic step) and takes
log-probs and losses over the generated elements only. Not done here: last-frame conditioning (FLF2V:
``last_image``, ``pos_embed_seq_len``). Wan2.2 A14B's two experts (``transformer_2`` / ``boundary_ratio``):
:func:`load_wan` loads both into one :class:`flowforge.models.wan.experts.WanExperts` transformer. The CLIP tokens
are computed from the images the adapter is given (the trainer's: already resized to the video size by
``load_condition_images``), while the pipeline hands CLIP the caller's original image; the two agree exactly when
the source image already has the video size.
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
from flowforge.models.wan.spec import FAMILY
from flowforge.models.common import (
    DEFAULT_MIN_TOKENIZER_SIZE,
    PipelineText,
    check_velocity_inputs,
    encode_with_negative,
    has_component,
    latent_stats,
    load_image_encoder,
    pipeline_dir,
    read_json,
    require_negative,
    to_unit_range,
)

WAN_TIMESTEP_SCALE = 1000.0
"""Wan's native timestep is ``1000 * sigma``."""

WAN_LORA_TARGETS = (
    "attn1.to_q",
    "attn1.to_k",
    "attn1.to_v",
    "attn1.to_out.0",
    "attn2.to_q",
    "attn2.to_k",
    "attn2.to_v",
    "attn2.to_out.0",
)
"""Self- (``attn1``) and cross-attention (``attn2``) projections of ``WanTransformerBlock``, the module names of
diffusers' Wan LoRA format (``WanPipeline.load_lora_weights``)."""

WAN_FALLBACK_SHIFT = 5.0
WAN_I2V_TEXT_LEN = 512
"""Text tokens an ``image_dim`` transformer's cross-attention expects after the image tokens (diffusers
``transformer_wan.py`` ``WanAttnProcessor``: ``image_context_length = encoder_hidden_states.shape[1] - 512``)."""
WAN_TASKS = FAMILY.tasks


def _wan_encode_fn(max_sequence_length: int):
    def encode(pipe, prompts: list[str]) -> tuple[Tensor, Tensor, None]:
        from diffusers import WanPipeline
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        # WanPipeline's method on either pipeline class: WanImageToVideoPipeline's copy of prompt_clean calls ftfy
        # unguarded (a NameError when ftfy is not installed, diffusers 0.42); the text path is otherwise identical.
        embeds = WanPipeline._get_t5_prompt_embeds(pipe, prompt=prompts, num_videos_per_prompt=1,
                                                   max_sequence_length=max_sequence_length, device=pipe.device)
        # The real-token mask, as _get_t5_prompt_embeds computes it (embeddings beyond it are zeros).
        mask = pipe.tokenizer([prompt_clean(p) for p in prompts], padding="max_length",
                              max_length=max_sequence_length, truncation=True, add_special_tokens=True,
                              return_attention_mask=True, return_tensors="pt").attention_mask
        return embeds, mask.to(embeds.device).long(), None

    return encode


def wan_text(*, path: str | Path | None = None, components: dict[str, Any] | None = None,
             max_sequence_length: int = 512, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
             encoder_id: str | None = None, min_tokenizer_size: int = DEFAULT_MIN_TOKENIZER_SIZE,
             pipeline_class: str = "WanPipeline") -> PipelineText:
    """UMT5 of a Wan pipeline (directory ``path`` or ``components`` with ``tokenizer`` and ``text_encoder``),
    encoding through ``WanPipeline._get_t5_prompt_embeds`` (what ``WanPipeline.encode_prompt`` calls)."""
    skip = ("transformer_2", "image_encoder", "image_processor") if pipeline_class != "WanPipeline" \
        else ("transformer_2",)
    return PipelineText(pipeline_class, _wan_encode_fn(int(max_sequence_length)), path=path, components=components,
                        skip=skip, device=device, dtype=dtype, settings=f"umt5_len={int(max_sequence_length)}",
                        encoder_id=encoder_id, min_tokenizer_size=min_tokenizer_size)


class WanAdapter(FamilyAdapter):
    """:class:`~flowforge.models.base.FlowModel` around a diffusers ``WanTransformer3DModel`` (video).

    Args:
        transformer: the ``WanTransformer3DModel`` (eval mode; its dtype is the forward dtype).
        text_encoder: :func:`wan_text` or any object with ``encode(prompts) -> (embeds, mask, None)`` and
            ``encoder_id``; ``None``: conditioning must come from a cache.
        vae: the ``AutoencoderKLWan`` (``None``: :meth:`decode` raises; scale factors fall back to 4 / 8).
        task: ``"t2v"`` or ``"i2v"`` (see the module docstring for the i2v layouts).
        expand_timesteps: Wan2.2 TI2V (first-frame pin layout for i2v; the pipeline's ``expand_timesteps``).
        negative_prompt: the unconditional prompt (``None``: no negative encoded).
        scheduler_config: the pipeline's scheduler config (for :attr:`default_shift`).
        image_encoder: the pipeline's ``CLIPVisionModel`` (``image_encoder``), needed by i2v with a transformer
            whose ``config.image_dim`` is set (Wan2.1-I2V-14B); unused otherwise.
        image_processor: the pipeline's ``CLIPImageProcessor`` (``image_processor``; without torchvision
            transformers gives ``CLIPImageProcessorPil``), with ``image_encoder``.

    Raises:
        ValueError: unknown task; i2v with a transformer that has neither layout; t2v with an I2V transformer;
            an ``image_dim`` transformer for i2v given a VAE but no ``image_encoder`` / ``image_processor`` (it
            could encode the latent condition but not the CLIP tokens; a velocity-only adapter without a VAE, as
            ``flowforge.tools.export``'s check builds, is allowed and reads ``cond.pooled`` as given); a last-frame
            (FLF2V, ``pos_embed_seq_len``) transformer.
    """

    family_spec = FAMILY

    lora_targets: tuple[str, ...] = WAN_LORA_TARGETS

    def __init__(self, transformer: nn.Module, text_encoder: Any = None, vae: nn.Module | None = None, *,
                 task: str = "t2v", expand_timesteps: bool = False, negative_prompt: str | None = "",
                 scheduler_config: dict[str, Any] | None = None, image_encoder: nn.Module | None = None,
                 image_processor: Any = None):
        FAMILY.check_task(task)
        self.transformer = transformer.eval()
        self.text_encoder = text_encoder
        self.vae = frozen(vae)
        self.task = task
        self.expand_timesteps = bool(expand_timesteps)
        self.negative_prompt = negative_prompt
        self.scheduler_config = dict(scheduler_config or {})
        self.image_encoder = frozen(image_encoder)
        self.image_processor = image_processor
        cfg = self.config
        self.concat_channels = int(cfg.in_channels) - int(cfg.out_channels)
        if self.concat_channels not in (0, int(cfg.out_channels) + self.vae_scale_factor_temporal):
            raise ValueError(f"unsupported Wan transformer: in_channels={cfg.in_channels}, "
                             f"out_channels={cfg.out_channels}")
        if task == "t2v" and self.concat_channels:
            raise ValueError("this is an image-to-video transformer (in_channels > out_channels); use task='i2v'")
        if task == "i2v" and not self.concat_channels and not self.expand_timesteps:
            raise ValueError("task='i2v' needs an I2V transformer (in_channels = 2 z + 4) or a TI2V model "
                             "(expand_timesteps=True)")
        if task == "i2v" and self.image_dim is not None:
            if getattr(cfg, "pos_embed_seq_len", None) is not None:
                raise ValueError("this is a first-last-frame (FLF2V) Wan transformer (pos_embed_seq_len set); "
                                 "last-frame conditioning is not supported")
            if vae is not None and (image_encoder is None or image_processor is None):
                raise ValueError(f"this Wan2.1 I2V transformer (image_dim={self.image_dim}) is conditioned on CLIP "
                                 "image tokens: pass image_encoder (CLIPVisionModel) and image_processor "
                                 "(CLIPImageProcessor), e.g. the pipeline directory's image_encoder/ and "
                                 "image_processor/ (load_wan loads them when model_index.json lists them)")

    # ------------------------------------------------------------------ properties

    @property
    def tasks(self) -> tuple[str, ...]:
        """Tasks this transformer supports (TI2V models do both; Wan2.1 I2V only i2v; T2V only t2v)."""
        if self.concat_channels:
            return ("i2v",)
        return ("t2v", "i2v") if self.expand_timesteps else ("t2v",)

    @property
    def image_dim(self) -> int | None:
        """Width of the CLIP image tokens the transformer reads from ``cond.pooled`` (``config.image_dim``);
        ``None``: no image tokens (T2V, Wan2.1 I2V without CLIP, Wan2.2)."""
        value = getattr(self.config, "image_dim", None)
        return None if value is None else int(value)

    @property
    def z_dim(self) -> int:
        return int(self.config.out_channels)

    @property
    def vae_scale_factor_temporal(self) -> int:
        return int(self.vae.config.scale_factor_temporal) if self.vae is not None else 4

    @property
    def vae_scale_factor_spatial(self) -> int:
        return int(self.vae.config.scale_factor_spatial) if self.vae is not None else 8

    @property
    def default_shift(self) -> float:
        """The Wan schedule's shift: the scheduler config's ``flow_shift`` (UniPC) or ``shift`` (FlowMatchEuler),
        else 5.0. Use 3.0 for 480p per the diffusers Wan docs."""
        for key in ("flow_shift", "shift"):
            if self.scheduler_config.get(key) is not None:
                return float(self.scheduler_config[key])
        return WAN_FALLBACK_SHIFT

    # ------------------------------------------------------------------ FlowModel

    def blocks(self) -> list[nn.Module]:
        """The ``WanTransformerBlock`` modules, in order."""
        return list(self.transformer.blocks)

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """UMT5 embeds ``[B, max_sequence_length, D]`` (zeros past the real tokens) and the real-token mask;
        ``negative`` from :attr:`negative_prompt`."""
        return encode_with_negative(self.text_encoder, prompts, self.negative_prompt)

    def latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """``(C, (frames - 1) / 4 + 1, height / 8, width / 8)`` (VAE scale factors); ``C = z`` except for the
        channel-concat i2v layout, where ``C = 2 z + 4`` (latents, mask, image latent).

        Raises:
            ValueError: ``frames`` missing or ``frames - 1`` not a multiple of the temporal factor; i2v with a single
                frame; a size not a positive multiple of ``spatial factor * patch size``.
        """
        ft, fs = self.vae_scale_factor_temporal, self.vae_scale_factor_spatial
        if frames is None or frames < 1 or (frames - 1) % ft:
            raise ValueError(f"Wan needs frames with (frames - 1) a multiple of {ft} (e.g. 81), got {frames}")
        if self.task == "i2v" and frames < ft + 1:
            raise ValueError(f"model.frames={frames}: task='i2v' needs >= {ft + 1} frames (the first frame is the "
                             "condition image; one frame would generate nothing)")
        _, ph, pw = self.config.patch_size
        if height <= 0 or width <= 0 or height % (fs * ph) or width % (fs * pw):
            raise ValueError(f"height / width must be positive multiples of {fs * ph} / {fs * pw}, "
                             f"got {height}x{width}")
        return (int(self.config.in_channels), (frames - 1) // ft + 1, height // fs, width // fs)

    def _timestep(self, x: Tensor, sigma: Tensor) -> Tensor:
        t = WAN_TIMESTEP_SCALE * sigma  # [B] fp32
        if not (self.task == "i2v" and self.expand_timesteps):
            return t
        _, ph, pw = self.config.patch_size
        f, h, w = x.shape[2], x.shape[3] // ph, x.shape[4] // pw
        frame_mask = torch.ones(f, h, w, device=x.device, dtype=torch.float32)
        frame_mask[0] = 0  # the pipeline's first_frame_mask[0][0][:, ::2, ::2]
        return frame_mask.flatten()[None, :] * t[:, None]  # [B, seq_len]

    def _forward(self, x: Tensor, sigma: Tensor, cond: Conditioning) -> Tensor:
        dtype, device = self.dtype, x.device
        image_embeds = None
        if self.image_dim is not None:
            if cond.pooled is None:
                raise ValueError("this Wan I2V transformer needs CLIP image tokens in cond.pooled "
                                 "([B, S_img * image_dim], set by condition_on_images); cond.pooled is None")
            # [B, S_img * image_dim] -> [B, S_img, image_dim] in the transformer dtype (the pipeline's
            # image_embeds.to(transformer_dtype))
            image_embeds = cond.pooled.to(device=device, dtype=dtype).view(x.shape[0], -1, self.image_dim)
        out = self.transformer(
            hidden_states=x.to(dtype),
            timestep=self._timestep(x, sigma),
            encoder_hidden_states=cond.prompt_embeds.to(device=device, dtype=dtype),
            encoder_hidden_states_image=image_embeds,
            return_dict=False,
        )[0]
        return out.float()

    def velocity(self, x: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Velocity ``noise - x0`` at ``x [B, C, F, H, W]``, ``sigma [B]`` in [0, 1]; fp32, shape of ``x``.

        ``guidance_scale > 1`` (the pipeline's ``do_classifier_free_guidance``): CFG ``v_u + g (v_c - v_u)`` over
        ``cond.negative`` in two forwards, conditional then unconditional, as the pipeline runs them (the pipeline's
        computation, bit for bit; on CPU one forward over the doubled batch measured the same, another device may
        round it differently); any other value: the conditional forward alone. In i2v the velocity is 0 on the
        condition slot (frame 0 / condition channels).
        With ``image_dim``, each branch reads its CLIP image tokens from its own ``pooled`` (``cond.pooled`` /
        ``cond.negative.pooled``, equal after :meth:`condition_on_images`, as in the pipeline).

        Raises:
            ValueError: bad shapes; CFG without ``cond.negative``.
        """
        sigma = check_velocity_inputs(x, sigma, cond, 5)
        g = float(guidance_scale)
        v = self._forward(x, sigma, cond)
        if self.guidance_use(g) == "cfg":
            v_u = self._forward(x, sigma, require_negative(cond, g))
            v = v_u + g * (v - v_u)
        return self._zero_condition(v)

    def _zero_condition(self, v: Tensor) -> Tensor:
        if self.task != "i2v":
            return v
        if self.concat_channels:
            return torch.cat([v, v.new_zeros(v.shape[0], self.concat_channels, *v.shape[2:])], dim=1)
        v = v.clone()
        v[:, :, 0] = 0.0
        return v

    # ------------------------------------------------------------------ i2v condition slot (ImageConditioned)

    @property
    def condition_index(self) -> tuple[slice, ...] | None:
        """Index of the i2v condition slot in a batched latent: frame 0 (pin layout) or the ``z + 4`` condition
        channels (concat layout); ``None`` for t2v."""
        if self.task != "i2v":
            return None
        if self.concat_channels:
            return (slice(None), slice(self.z_dim, None))
        return (slice(None), slice(None), slice(0, 1))

    @property
    def generated_index(self) -> tuple[slice, ...]:
        """Index of the generated elements: everything but :attr:`condition_index`."""
        if self.task != "i2v":
            return (slice(None),)
        if self.concat_channels:
            return (slice(None), slice(0, self.z_dim))
        return (slice(None), slice(None), slice(1, None))

    def condition_on_images(self, cond: Conditioning, prompts: Sequence[str], images: Tensor,
                            latent_shape: Sequence[int]) -> Conditioning:
        """``cond`` conditioned on the first frames ``images [N, 3, H, W]`` float32 in [0, 1] (``ImageConditioned``;
        ``prompts`` unused): ``image`` = :meth:`encode_condition_images` and, for an ``image_dim`` transformer
        (Wan2.1-I2V-14B), ``pooled`` *and* ``negative.pooled`` = :meth:`encode_image_tokens` flattened to
        ``[N, S_img * image_dim]`` fp32 (replacing any ``pooled``): ``WanImageToVideoPipeline.__call__`` gives the
        conditional and the unconditional forward the same ``encoder_hidden_states_image``.

        Raises:
            RuntimeError: not an i2v adapter; no VAE; no image encoder (``image_dim`` set).
            ValueError: ``image_dim`` set and prompt embeddings not :data:`WAN_I2V_TEXT_LEN` tokens long.
        """
        image = self.encode_condition_images(images, latent_shape)
        if self.image_dim is None:
            return dataclasses.replace(cond, image=image)
        for name, c in (("cond", cond), ("cond.negative", cond.negative)):
            if c is not None and c.prompt_embeds.shape[1] != WAN_I2V_TEXT_LEN:
                raise ValueError(f"{name}.prompt_embeds has {c.prompt_embeds.shape[1]} tokens; this Wan2.1 I2V "
                                 f"transformer (image_dim) treats the last {WAN_I2V_TEXT_LEN} context tokens as text "
                                 f"(diffusers WanAttnProcessor): encode with max_sequence_length={WAN_I2V_TEXT_LEN}")
        tokens = self.encode_image_tokens(images).flatten(1)  # [N, S_img * image_dim]
        negative = None if cond.negative is None else dataclasses.replace(cond.negative, pooled=tokens)
        return dataclasses.replace(cond, image=image, pooled=tokens, negative=negative)

    @torch.no_grad()
    def encode_image_tokens(self, images: Tensor) -> Tensor:
        """CLIP image tokens of ``images [N, 3, H, W]`` float32 in [0, 1]: ``[N, S_img, image_dim]`` fp32, the
        penultimate hidden states of the image encoder, as ``WanImageToVideoPipeline.encode_image``
        (``diffusers/pipelines/wan/pipeline_wan_i2v.py``) computes them for a PIL image: ``image_processor(images=...,
        return_tensors="pt")`` (resize, center crop, rescale, normalise), then ``image_encoder(**inputs,
        output_hidden_states=True).hidden_states[-2]``. The images are handed to the processor as 8-bit RGB PIL images
        (``round(255 x)``: exact for images read from 8-bit files, as ``load_condition_images`` returns them), so
        either processor backend (torchvision, or PIL ``CLIPImageProcessorPil``) sees what the pipeline's would.

        Raises:
            RuntimeError: no ``image_encoder`` / ``image_processor``.
        """
        if self.image_encoder is None or self.image_processor is None:
            raise RuntimeError("encode_image_tokens needs the image_encoder (CLIPVisionModel) and image_processor "
                               "(CLIPImageProcessor)")
        pil = condition_pil_images(images)  # round(255 x), as the pipeline's PIL inputs
        device = next(self.image_encoder.parameters()).device
        inputs = self.image_processor(images=pil, return_tensors="pt").to(device)
        return self.image_encoder(**inputs, output_hidden_states=True).hidden_states[-2].float()

    @torch.no_grad()
    def encode_condition_images(self, images: Tensor, latent_shape: Sequence[int]) -> Tensor:
        """First-frame ``images [N, 3, H, W]`` float32 in [0, 1] -> the condition slot ``[N, *slot]`` fp32 of latents
        of ``latent_shape`` (the VAE ``argmax`` latent normalised with latents_mean / std, as
        ``WanImageToVideoPipeline.prepare_latents``): pin layout ``[N, z, 1, h, w]``; concat layout
        ``[N, z + 4, F, h, w]`` = the first-frame mask (4 channels) and the latent of the image followed by zero
        frames.

        Raises:
            RuntimeError: not an i2v adapter or no VAE.
        """
        if self.task != "i2v":
            raise RuntimeError("encode_condition_images needs task='i2v'")
        if self.vae is None:
            raise RuntimeError("encode_condition_images needs the VAE")
        _, f, h, w = latent_shape
        n = images.shape[0]
        image = (images.to(device=self.vae.device, dtype=self.vae.dtype) * 2.0 - 1.0).unsqueeze(2)  # [N,3,1,H,W]
        ft = self.vae_scale_factor_temporal
        frames = (f - 1) * ft + 1
        if self.concat_channels:  # Wan2.1 I2V: image then zero frames, encoded as a video
            image = torch.cat([image, image.new_zeros(n, 3, frames - 1, *image.shape[3:])], dim=2)
        z = self.vae.encode(image).latent_dist.mode().float()
        mean, inv_std = latent_stats(self.vae, z)
        cond_latent = (z - mean) * inv_std
        if not self.concat_channels:
            return cond_latent
        mask = torch.zeros(n, 1, frames, h, w, dtype=cond_latent.dtype, device=cond_latent.device)
        mask[:, :, 0] = 1.0
        mask = torch.cat([mask[:, :, :1].repeat_interleave(ft, dim=2), mask[:, :, 1:]], dim=2)
        mask = mask.view(n, -1, ft, h, w).transpose(1, 2)  # [N, ft, F, h, w]
        return torch.cat([mask, cond_latent], dim=1)

    # ------------------------------------------------------------------ media

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Latents ``[B, C, F, h, w]`` → video ``[B, 3, frames, H, W]`` float32 in [0, 1] (only the first ``z``
        channels are decoded: the generated ones)."""
        self.require_vae("decode")
        z = latents[:, : self.z_dim].to(self.vae.dtype)
        mean, inv_std = latent_stats(self.vae, z)
        return to_unit_range(self.vae.decode(z / inv_std + mean, return_dict=False)[0])

    @torch.no_grad()
    def encode_video(self, video: Tensor) -> Tensor:
        """Video ``[B, 3, frames, H, W]`` in [0, 1] → normalised latents ``[B, z, F, h, w]`` fp32 (VAE mode)."""
        self.require_vae()
        z = self.vae.encode(video.to(self.vae.dtype) * 2.0 - 1.0).latent_dist.mode()
        mean, inv_std = latent_stats(self.vae, z)
        return ((z - mean) * inv_std).float()



def load_wan(path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
             task: str | None = None, text_encoder: Any = None, negative_prompt: str | None = "",
             max_sequence_length: int = 512, min_tokenizer_size: int = DEFAULT_MIN_TOKENIZER_SIZE) -> WanAdapter:
    """Load Wan from a local diffusers pipeline directory (``WanPipeline`` / ``WanImageToVideoPipeline``
    ``save_pretrained``); never downloads. ``task`` defaults to ``"i2v"`` for an I2V transformer, else ``"t2v"``.
    For a transformer with ``image_dim`` (Wan2.1-I2V-14B) the directory's ``image_encoder`` (``CLIPVisionModel``,
    fp32 like the VAE, as in the diffusers Wan I2V example) and ``image_processor`` (the class model_index.json names,
    resolved through ``transformers`` as diffusers does) are loaded too; the text encoder never loads them.

    Raises:
        FileNotFoundError: not a pipeline directory. ValueError: a two-expert (Wan2.2 A14B) directory missing
        ``transformer_2`` or ``boundary_ratio``; an ``image_dim`` i2v directory without ``image_encoder`` /
        ``image_processor``. A complete two-expert directory gives an adapter whose ``transformer`` is a
        :class:`~flowforge.models.wan.experts.WanExperts`.
    """
    from diffusers import WanTransformer3DModel

    root = pipeline_dir(path, "Wan")
    index = read_json(root / "model_index.json")
    two_experts = has_component(root, "transformer_2") or index.get("boundary_ratio") is not None
    transformer = None if two_experts else WanTransformer3DModel.from_pretrained(
        str(root / "transformer"), torch_dtype=dtype, local_files_only=True).to(device)
    # The diffusers Wan examples keep the VAE in fp32.
    vae = load_component(root, "vae", dtype=torch.float32, device=device)
    if text_encoder is None and has_component(root, "text_encoder"):
        text_encoder = wan_text(path=root, max_sequence_length=max_sequence_length, device=device, dtype=dtype,
                                min_tokenizer_size=min_tokenizer_size, pipeline_class=index["_class_name"])
    if two_experts:  # Wan2.2 A14B: both experts in one module (flowforge.models.wan.experts)
        from flowforge.models.wan.experts import load_wan_experts

        transformer = load_wan_experts(root, index, dtype=dtype, device=device)
    image_encoder = image_processor = None
    if getattr(transformer.config, "image_dim", None) is not None:
        image_encoder, image_processor = load_image_encoder(root, index, device)
    if task is None:
        task = "i2v" if transformer.config.in_channels != transformer.config.out_channels else "t2v"
    return WanAdapter(transformer, text_encoder, vae, task=task, expand_timesteps=bool(index.get("expand_timesteps")),
                      negative_prompt=negative_prompt,
                      scheduler_config=read_json(root / "scheduler" / "scheduler_config.json"),
                      image_encoder=image_encoder, image_processor=image_processor)
