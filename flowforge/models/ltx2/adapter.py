"""LTX-2 audio-video adapter (diffusers ``LTX2VideoTransformer3DModel``, ``LTX2Pipeline``): one transformer denoises
a video latent and an audio latent together; flowforge steps both as one **joint latent**.

==================  ================================================================================================
flowforge           LTX-2 (checked against diffusers 0.42 ``pipeline_ltx2.py``, ``transformer_ltx2.py``,
                    ``connectors.py``)
==================  ================================================================================================
``x`` [B, S, D]     the joint latent: the packed video tokens (``_pack_latents``: ``[B, F h w / (p p p_t), D]``, the
                    transformer's ``hidden_states``) followed by the packed audio tokens (``_pack_audio_latents``:
                    ``[B, L, C_a M]``, its ``audio_hidden_states``), concatenated along the sequence:
                    ``S = S_v + L``. Both are fp32 model-space latents as the pipeline's loop holds them (video
                    normalised by ``vae.latents_mean / std / scaling_factor``, audio by ``audio_vae.latents_mean /
                    std``). Both widths must be equal (128 and 8 x 16 = 128 in every released checkpoint); the
                    geometry (``F, h, w, L``) is fixed by :meth:`LTX2Adapter.latent_shape`, which the trainer calls
                    once before anything else.
``sigma`` [B]       ``timestep = sigma = 1000 sigma`` fp32 (the pipeline passes the scheduler's ``t`` as both
                    ``timestep`` and ``sigma``; ``audio_timestep`` defaults to it), same for both modalities
``v`` (fp32)        the transformer's two outputs (``noise_pred_video``, ``noise_pred_audio``, ``.float()``),
                    concatenated like ``x``, then taken through the pipeline's own x0 round trip
                    (``convert_velocity_to_x0`` -> guidance -> ``convert_x0_to_velocity``: ``x0 = x - v sigma``,
                    ``v = (x - x0) / sigma``), so an Euler step over it is bitwise the pipeline's step
CFG                 per modality in x0 space as the pipeline: ``x0 = x0_c + (g - 1)(x0_c - x0_u)``, then
                    ``rescale_noise_cfg`` when ``guidance_rescale > 0`` (with or without CFG, as the pipeline);
                    flowforge's ``guidance_scale`` is the video scale, :attr:`LTX2Adapter.audio_guidance_scale` the
                    audio one (pipeline default 7.0; ``None`` / 0: the video's). CFG runs when either scale is > 1
                    (``do_classifier_free_guidance``), both modalities then combined with their own scale. The
                    uncond / cond halves run as one forward over ``[negative; cond]``, as the pipeline. Defaults
                    (audio scale 7.0, rescale 0.7 for both, frame rate 24) are ``LTX2Pipeline.__call__``'s; the
                    ``sampler`` keys of :attr:`LTX2Adapter.sampler_options` set them from a config. Not replicated: STG
                    (``stg_scale``) and modality-isolation guidance (``modality_scale``), which run extra perturbed
                    forwards; use the pipeline with ``stg_scale=0, modality_scale=1`` to compare.
text                Gemma-3 hidden states of every layer (``_get_gemma_prompt_embeds``, left padding), through the
                    pipeline's ``LTX2TextConnectors`` (``self.connectors(prompt_embeds, mask, padding_side)``) at
                    encode time (they are frozen): ``cond.prompt_embeds = [video_embeds | audio_embeds]`` along
                    features, ``cond.mask`` the connectors' mask (both streams use it, as the pipeline passes it to
                    ``encoder_attention_mask`` and ``audio_encoder_attention_mask``)
schedule            ``sigmas = linspace(1, 1/T, T)`` through the scheduler with ``mu = calculate_shift(S_v,
                    base_image_seq_len=1024, max_image_seq_len=4096, base_shift=0.95, max_shift=2.05)`` (the
                    pipeline's ``.get`` defaults) over the *video* token count ``S_v``; one schedule for both
                    modalities (the pipeline deep-copies its scheduler for the audio)
decode              video: ``_unpack_latents``, ``_denormalize_latents``, ``vae.decode(z, timestep)``, ``x / 2 + 0.5``
                    clamped (``postprocess_video``), as ``[B, 3, F, H, W]``; a timestep-conditioned VAE gets
                    ``decode_timestep = 0`` (the pipeline default, whose decode noise scale 0 leaves the latents
                    unchanged). Audio (:meth:`LTX2Adapter.decode_audio`): ``_denormalize_audio_latents``,
                    ``_unpack_audio_latents``, ``audio_vae.decode``, ``vocoder`` -> waveform ``[B, channels, T]`` at
                    ``vocoder.config.output_sampling_rate``
==================  ================================================================================================

Tasks: ``t2v`` (text to video with its audio). ``LTX2Pipeline`` has no audio-conditioned mode (its ``audio_latents``
argument only replaces the initial noise), so no audio-to-video task is offered here; a prompt row's ``audio``
column is carried by the data tools for a future conditioned adapter.
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
from flowforge.models.ltx2.spec import FAMILY
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

LTX2_TASKS = FAMILY.tasks
LTX2_TIMESTEP_SCALE = 1000.0
LTX2_SHIFT_DEFAULTS = {"base_image_seq_len": 1024, "max_image_seq_len": 4096, "base_shift": 0.95,
                       "max_shift": 2.05}
"""The ``scheduler.config.get`` defaults of ``LTX2Pipeline.__call__``'s ``calculate_shift`` call."""

LTX2_LORA_TARGETS = tuple(f"{attn}.{proj}" for attn in ("attn1", "attn2", "audio_attn1", "audio_attn2",
                                                        "audio_to_video_attn", "video_to_audio_attn")
                          for proj in ("to_q", "to_k", "to_v", "to_out.0"))
"""Every attention projection of ``LTX2VideoTransformerBlock``: video and audio self- and text cross-attention and
the two audio-video cross-attentions (the ``to_q / to_k / to_v / to_out.0`` targets of Lightricks' LTX-2 trainer
LoRA configs; diffusers' LTX-2 LoRA format names the same modules)."""


@dataclasses.dataclass(frozen=True)
class LTX2Geometry:
    """Token geometry of one joint latent: video ``frames x height x width`` latent cells (after patching),
    ``audio_frames`` audio tokens of ``mel_bins`` latent mel bins, ``width`` features per token."""

    frames: int  # pixel frames
    latent_frames: int
    latent_height: int
    latent_width: int
    audio_frames: int
    mel_bins: int
    width: int

    @property
    def video_tokens(self) -> int:
        return self.latent_frames * self.latent_height * self.latent_width

    @property
    def tokens(self) -> int:
        return self.video_tokens + self.audio_frames


def _ltx2_encode_fn(max_sequence_length: int):
    def encode(pipe, prompts: list[str]) -> tuple[Tensor, Tensor, None]:
        # LTX2Pipeline.__call__: encode_prompt (Gemma, every hidden state stacked), then its connectors
        embeds, mask = pipe._get_gemma_prompt_embeds(prompt=prompts, max_sequence_length=max_sequence_length,
                                                     device=pipe.device)
        padding_side = getattr(pipe.tokenizer, "padding_side", "left")
        video, audio, conn_mask = pipe.connectors(embeds, mask, padding_side=padding_side)
        return torch.cat([video, audio], dim=-1), conn_mask, None

    return encode


def ltx2_text(*, path: str | Path | None = None, components: dict[str, Any] | None = None,
              max_sequence_length: int = 1024, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32, encoder_id: str | None = None,
              min_tokenizer_size: int = DEFAULT_MIN_TOKENIZER_SIZE) -> PipelineText:
    """The text side of an LTX-2 pipeline (directory ``path`` or ``components`` with ``tokenizer``,
    ``text_encoder`` and ``connectors``): ``(embeds [B, S, D_video + D_audio], connector mask [B, S], None)``."""
    return PipelineText("LTX2Pipeline", _ltx2_encode_fn(int(max_sequence_length)), path=path,
                        components=components, skip=("audio_vae", "vocoder", "processor", "prompt_enhancer",
                                                     "duration_head"),
                        device=device, dtype=dtype, settings=f"len={int(max_sequence_length)}",
                        encoder_id=encoder_id, min_tokenizer_size=min_tokenizer_size)


class LTX2Adapter(FamilyAdapter):
    """:class:`~flowforge.models.base.FlowModel` around a diffusers ``LTX2VideoTransformer3DModel``: video and audio
    generated together; the conventions are in the module docstring.

    Args:
        transformer: the ``LTX2VideoTransformer3DModel`` (put in eval mode; its dtype is the forward dtype).
        text_encoder: :func:`ltx2_text` or any object with ``encode(prompts) -> (embeds [B, S, D_v + D_a], mask,
            None)`` and ``encoder_id``; ``None``: conditioning must come from a cache.
        vae: the ``AutoencoderKLLTX2Video`` (``None``: :meth:`decode` raises; compression 32 / 8 assumed).
        audio_vae: the ``AutoencoderKLLTX2Audio`` (``None``: :meth:`decode_audio` raises; LTX-2's 16 kHz, hop 160,
            64 mel bins, 8 latent channels, compression 4 assumed).
        vocoder: the pipeline's ``LTX2Vocoder`` (mel -> waveform).
        negative_prompt: CFG's unconditional prompt (pipeline default ``""``); ``None``: none encoded.
        scheduler_config: the pipeline's scheduler config.
        frame_rate: frames per second of the video (the pipeline's ``frame_rate``, default 24): sets the audio
            length and the video positions' time scale.
        motion_speed: the pipeline's ``motion_speed`` (positions conditioned on ``frame_rate / motion_speed``).
        audio_guidance_scale: the audio CFG scale (pipeline default 7.0; ``None`` or 0: the video's, flowforge's
            ``guidance_scale``, as the pipeline's ``audio_guidance_scale or guidance_scale``).
        guidance_rescale / audio_guidance_rescale: the pipeline's CFG rescale per modality (pipeline defaults 0.7
            / 0.7; 0: off; audio ``None`` or 0: the video's).
        use_cross_timestep: the transformer's ``use_cross_timestep`` (pipeline default True).
        video_text_dim: feature width of the video half of ``cond.prompt_embeds`` (default: the transformer's
            ``caption_channels``, or its inner width without caption projection).
        task: ``"t2v"``.

    Raises:
        ValueError: unknown ``task``.
    """

    family_spec = FAMILY

    family = "LTX-2"
    tasks: tuple[str, ...] = LTX2_TASKS
    cfg_rule = "guidance_scale > 1 or the audio scale (sampler.audio_guidance_scale, default 7) > 1"
    sampler_options = ("audio_guidance_scale", "guidance_rescale", "audio_guidance_rescale", "frame_rate")

    def guidance_use(self, guidance_scale: float) -> str:
        """The pipeline's ``do_classifier_free_guidance``: ``"cfg"`` when the video or the audio scale is > 1."""
        return "cfg" if max(float(guidance_scale), self._audio_scale(guidance_scale)) > 1.0 else "off"

    def _audio_scale(self, guidance_scale: float) -> float:
        # the pipeline's `audio_guidance_scale or guidance_scale`
        return float(self.audio_guidance_scale or guidance_scale)
    lora_targets: tuple[str, ...] = LTX2_LORA_TARGETS

    def __init__(self, transformer: nn.Module, text_encoder: Any = None, vae: nn.Module | None = None,
                 audio_vae: nn.Module | None = None, vocoder: nn.Module | None = None, *,
                 negative_prompt: str | None = "", scheduler_config: dict[str, Any] | None = None,
                 frame_rate: float = 24.0, motion_speed: float = 1.0, audio_guidance_scale: float | None = 7.0,
                 guidance_rescale: float = 0.7, audio_guidance_rescale: float | None = 0.7,
                 use_cross_timestep: bool = True, video_text_dim: int | None = None, task: str = "t2v"):
        FAMILY.check_task(task)
        if not frame_rate > 0 or not motion_speed > 0:
            raise ValueError(f"frame_rate and motion_speed must be > 0, got {frame_rate} and {motion_speed}")
        self.task = task
        self.transformer = transformer.eval()
        self.text_encoder = text_encoder
        self.vae = frozen(vae)
        self.audio_vae = frozen(audio_vae)
        self.vocoder = frozen(vocoder)
        self.negative_prompt = negative_prompt
        self.scheduler_config = dict(scheduler_config or {})
        self.frame_rate = float(frame_rate)
        self.motion_speed = float(motion_speed)
        self.audio_guidance_scale = audio_guidance_scale
        self.guidance_rescale = float(guidance_rescale)
        self.audio_guidance_rescale = audio_guidance_rescale
        self.use_cross_timestep = bool(use_cross_timestep)
        cfg = self.config
        if video_text_dim is None:
            video_text_dim = (cfg.caption_channels if cfg.use_prompt_embeddings
                              else cfg.num_attention_heads * cfg.attention_head_dim)
        self.video_text_dim = int(video_text_dim)
        self.geometry: LTX2Geometry | None = None

    # ------------------------------------------------------------------ geometry

    @property
    def conditioning_frame_rate(self) -> float:
        """The frame rate the video positions are conditioned on (the pipeline's ``conditioning_frame_rate(
        frame_rate, motion_speed)``)."""
        from diffusers.pipelines.ltx2.utils import conditioning_frame_rate

        return conditioning_frame_rate(self.frame_rate, self.motion_speed)

    @property
    def spatial_ratio(self) -> int:
        return int(self.vae.spatial_compression_ratio) if self.vae is not None else 32

    @property
    def temporal_ratio(self) -> int:
        return int(self.vae.temporal_compression_ratio) if self.vae is not None else 8

    @property
    def sample_rate(self) -> int:
        """Waveform samples per second of :meth:`decode_audio` (the vocoder's ``output_sampling_rate``)."""
        if self.vocoder is None:
            raise RuntimeError("this LTX2Adapter has no vocoder; it produces no audio")
        return int(self.vocoder.config.output_sampling_rate)

    def _audio_settings(self) -> tuple[int, int, int, int, int]:
        """``(sampling_rate, hop_length, temporal ratio, latent mel bins, latent channels)`` as the pipeline's
        ``__init__`` / ``__call__`` read them (their fallbacks without an audio VAE)."""
        a = self.audio_vae
        if a is None:
            return 16000, 160, 4, 64 // 4, 8
        return (int(a.config.sample_rate), int(a.config.mel_hop_length), int(a.temporal_compression_ratio),
                int(a.config.mel_bins) // int(a.mel_compression_ratio), int(a.config.latent_channels))

    def latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """``(S_v + L, D)``: the joint latent of a ``frames x height x width`` video and its audio (module
        docstring), and fixes :attr:`geometry` for :meth:`velocity`, :meth:`decode` and :meth:`pipeline_sigmas`.

        Raises:
            ValueError: ``frames`` missing or ``frames - 1`` not a multiple of the VAE's temporal ratio; a size not
                a positive multiple of 32 (the pipeline's ``check_inputs``) and of ``spatial ratio x patch``; video
                and audio token widths that differ.
        """
        cfg = self.config
        rt, rs, p, pt = self.temporal_ratio, self.spatial_ratio, int(cfg.patch_size), int(cfg.patch_size_t)
        if frames is None or frames < 1 or (frames - 1) % rt:
            raise ValueError(f"LTX-2 needs frames with (frames - 1) a multiple of {rt} (e.g. 121), got {frames}")
        step = max(32, rs * p)
        if height <= 0 or width <= 0 or height % step or width % step:
            raise ValueError(f"height / width must be positive multiples of {step}, got {height}x{width}")
        latent_frames = (frames - 1) // rt + 1
        if latent_frames % pt:
            raise ValueError(f"{latent_frames} latent frames are not a multiple of patch_size_t={pt}")
        sr, hop, art, mel, _ = self._audio_settings()
        audio_frames = round(frames / self.frame_rate * (sr / hop / float(art)))
        video_width, audio_width = int(cfg.in_channels), int(cfg.audio_in_channels)
        if video_width != audio_width:
            raise ValueError(f"the joint latent needs equal video and audio token widths; this transformer has "
                             f"in_channels={video_width}, audio_in_channels={audio_width}")
        self.geometry = LTX2Geometry(frames=int(frames), latent_frames=latent_frames // pt,
                                     latent_height=height // rs // p, latent_width=width // rs // p,
                                     audio_frames=int(audio_frames), mel_bins=mel, width=video_width)
        return (self.geometry.tokens, video_width)

    def _geometry(self, tokens: int | None = None) -> LTX2Geometry:
        g = self.geometry
        if g is None:
            raise RuntimeError("LTX2Adapter.latent_shape(height, width, frames) must be called first: it fixes the "
                               "video / audio split of the joint latent")
        if tokens is not None and tokens != g.tokens:
            raise ValueError(f"x has {tokens} tokens; latent_shape fixed {g.tokens} ({g.video_tokens} video + "
                             f"{g.audio_frames} audio)")
        return g

    def split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Joint latent ``[B, S_v + L, D]`` -> ``(video tokens [B, S_v, D], audio tokens [B, L, D])`` (views)."""
        s_v = self._geometry(x.shape[1]).video_tokens
        return x[:, :s_v], x[:, s_v:]

    def schedule_mu(self) -> float:
        """``calculate_shift(S_v, ...)`` with the scheduler config's values or the pipeline's defaults."""
        from flowforge.algorithms.schedules import calculate_shift

        c = {k: self.scheduler_config.get(k, v) for k, v in LTX2_SHIFT_DEFAULTS.items()}
        return calculate_shift(self._geometry().video_tokens, c["base_image_seq_len"], c["max_image_seq_len"],
                               c["base_shift"], c["max_shift"])

    def pipeline_sigmas(self, num_steps: int, height: int, width: int) -> Tensor:
        """The exact ``[T+1]`` fp32 schedule of ``LTX2Pipeline`` for the geometry :meth:`latent_shape` fixed (the
        pipeline's ``mu`` counts video tokens, so ``frames`` matters; ``height`` / ``width`` must match it)."""
        g = self._geometry()
        rs, p = self.spatial_ratio, int(self.config.patch_size)
        if (height // rs // p, width // rs // p) != (g.latent_height, g.latent_width):
            raise ValueError(f"pipeline_sigmas({height}x{width}) differs from the size latent_shape fixed")
        config = dict(self.scheduler_config)
        config.setdefault("use_dynamic_shifting", False)  # the scheduler's own default; the pipeline passes mu
        return flow_match_pipeline_sigmas(config, num_steps, self.schedule_mu())

    # ------------------------------------------------------------------ FlowModel

    def blocks(self) -> list[nn.Module]:
        """The ``LTX2VideoTransformerBlock`` modules, in order."""
        return list(self.transformer.transformer_blocks)

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """Connector outputs ``[B, S, D_v + D_a]`` (video | audio features) and the connector mask; ``negative``
        per :attr:`negative_prompt`."""
        return encode_with_negative(self.text_encoder, prompts, self.negative_prompt)

    def _forward(self, x: Tensor, sigma: Tensor, embeds: Tensor, mask: Tensor | None) -> Tensor:
        """One transformer forward over the joint latent ``x [N, S, D]`` -> the raw joint velocity fp32."""
        g = self._geometry(x.shape[1])
        dtype, device = self.dtype, x.device
        video, audio = self.split(x)
        embeds = embeds.to(device=device, dtype=dtype)
        if embeds.shape[-1] <= self.video_text_dim:
            raise ValueError(f"cond.prompt_embeds has {embeds.shape[-1]} features; expected the video "
                             f"({self.video_text_dim}) and audio connector outputs side by side")
        t = LTX2_TIMESTEP_SCALE * sigma  # the scheduler's t = 1000 sigma, fp32
        mask = None if mask is None else mask.to(device)
        v_video, v_audio = self.transformer(
            hidden_states=video.to(dtype), audio_hidden_states=audio.to(dtype),
            encoder_hidden_states=embeds[..., :self.video_text_dim],
            audio_encoder_hidden_states=embeds[..., self.video_text_dim:],
            timestep=t, sigma=t, encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
            num_frames=g.latent_frames, height=g.latent_height, width=g.latent_width,
            fps=self.conditioning_frame_rate, audio_num_frames=g.audio_frames, isolate_modalities=False,
            spatio_temporal_guidance_blocks=None, perturbation_mask=None,
            use_cross_timestep=self.use_cross_timestep, return_dict=False)
        return torch.cat([v_video.float(), v_audio.float()], dim=1)

    def velocity(self, x: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Velocity ``noise - x0`` of the joint latent ``x [B, S_v + L, D]`` at ``sigma [B]`` in (0, 1]; fp32,
        shape of ``x``: the pipeline's guided velocity (module docstring; the x0 round trip is skipped where
        ``sigma == 0``, which the pipeline never evaluates).

        CFG runs when the video or the audio scale is > 1 (:meth:`guidance_use`, the pipeline's
        ``do_classifier_free_guidance``); the rescale applies with or without it, as in the pipeline.

        Raises:
            ValueError: bad shapes; a token count other than :meth:`latent_shape`'s; CFG without
                ``cond.negative``.
            RuntimeError: :meth:`latent_shape` was never called.
        """
        sigma = check_velocity_inputs(x, sigma, cond, 3)
        g_v = float(guidance_scale)
        g_a = self._audio_scale(g_v)
        x = x.float()
        s = sigma.view(-1, 1, 1)
        s_safe = torch.where(s > 0, s, torch.ones_like(s))
        cfg = self.guidance_use(g_v) == "cfg"
        if cfg:
            neg = require_negative(cond, g_v)
            device = cond.prompt_embeds.device
            embeds = torch.cat([neg.prompt_embeds.to(device), cond.prompt_embeds])
            masks = (None if cond.mask is None or neg.mask is None
                     else torch.cat([neg.mask.to(device), cond.mask.to(device)]))
            v_u, v_c = self._forward(torch.cat([x, x]), torch.cat([sigma, sigma]), embeds, masks).chunk(2)
        else:
            v_u, v_c = None, self._forward(x, sigma, cond.prompt_embeds, cond.mask)
        x_v, x_a = self.split(x)
        out = []
        for part, (xm, scale, rescale) in enumerate(((x_v, g_v, float(self.guidance_rescale)),
                                                     (x_a, g_a, self._audio_rescale()))):
            vc = self.split(v_c)[part]
            x0_c = xm - vc * s
            if cfg:
                vu = self.split(v_u)[part]
                x0_u = xm - vu * s
                x0 = x0_c + (scale - 1) * (x0_c - x0_u)
                v_sigma0 = vc + (scale - 1) * (vc - vu)
            else:  # the pipeline adds a delta of 0
                x0, v_sigma0 = x0_c, vc
            if rescale > 0:
                from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

                x0 = rescale_noise_cfg(x0, x0_c, guidance_rescale=rescale)
            out.append(torch.where(s > 0, (xm - x0) / s_safe, v_sigma0))
        return torch.cat(out, dim=1)

    def _audio_rescale(self) -> float:
        # the pipeline's `audio_guidance_rescale or guidance_rescale`
        return float(self.audio_guidance_rescale or self.guidance_rescale)

    # ------------------------------------------------------------------ media

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Joint latents ``[B, S_v + L, D]`` -> video ``[B, 3, F, H, W]`` float32 in [0, 1] (the audio half is
        :meth:`decode_audio`'s).

        Raises:
            RuntimeError: no VAE; :meth:`latent_shape` never called.
        """
        from diffusers import LTX2Pipeline

        if self.vae is None:
            raise RuntimeError("this LTX2Adapter has no video VAE; decode is unavailable")
        g = self._geometry(latents.shape[1])
        video, _ = self.split(latents.float())
        cfg = self.config
        z = LTX2Pipeline._unpack_latents(video, g.latent_frames, g.latent_height, g.latent_width,
                                         int(cfg.patch_size), int(cfg.patch_size_t))
        timestep = None
        if self.vae.config.timestep_conditioning:  # decode_timestep 0.0, decode noise scale 0: latents unchanged
            timestep = torch.zeros(z.shape[0], device=z.device, dtype=z.dtype)
        z = LTX2Pipeline._denormalize_latents(z, self.vae.latents_mean, self.vae.latents_std,
                                              self.vae.config.scaling_factor).to(self.vae.dtype)
        return to_unit_range(self.vae.decode(z, timestep, return_dict=False)[0])

    @torch.no_grad()
    def decode_audio(self, latents: Tensor) -> tuple[Tensor, int]:
        """Joint latents ``[B, S_v + L, D]`` -> ``(waveform [B, channels, T] float32, sample_rate)``: the audio half
        through the audio VAE and the vocoder, as ``LTX2Pipeline.__call__``.

        Raises:
            RuntimeError: no audio VAE / vocoder; :meth:`latent_shape` never called.
        """
        from diffusers import LTX2Pipeline

        if self.audio_vae is None or self.vocoder is None:
            raise RuntimeError("this LTX2Adapter has no audio VAE / vocoder; decode_audio is unavailable")
        g = self._geometry(latents.shape[1])
        _, audio = self.split(latents.float())
        a = LTX2Pipeline._denormalize_audio_latents(audio, self.audio_vae.latents_mean, self.audio_vae.latents_std)
        a = LTX2Pipeline._unpack_audio_latents(a, g.audio_frames, num_mel_bins=g.mel_bins)
        mel = self.audio_vae.decode(a.to(self.audio_vae.dtype), return_dict=False)[0]
        return self.vocoder(mel).float(), self.sample_rate



def load_ltx2(path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
              task: str = "t2v", text_encoder: Any = None, negative_prompt: str | None = "",
              max_sequence_length: int = 1024, frame_rate: float = 24.0, motion_speed: float = 1.0,
              audio_guidance_scale: float | None = 7.0, guidance_rescale: float = 0.7,
              audio_guidance_rescale: float | None = 0.7, use_cross_timestep: bool = True,
              min_tokenizer_size: int = DEFAULT_MIN_TOKENIZER_SIZE) -> LTX2Adapter:
    """Load LTX-2 from a local diffusers ``LTX2Pipeline`` directory; never downloads. Transformer, video VAE,
    audio VAE and vocoder load now (the decoders in fp32), Gemma and the connectors lazily on the first
    :meth:`LTX2Adapter.encode`.

    Raises:
        FileNotFoundError: ``path`` is not a pipeline directory.
        ValueError: ``task`` is not ``"t2v"``.
    """
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    root = pipeline_dir(path, "LTX-2")
    transformer = LTX2VideoTransformer3DModel.from_pretrained(str(root / "transformer"), torch_dtype=dtype,
                                                              local_files_only=True).to(device)
    vae, audio_vae, vocoder = (load_component(root, name, dtype=dtype, device=device)
                               for name in ("vae", "audio_vae", "vocoder"))
    video_text_dim = None
    if has_component(root, "connectors"):
        c = LTX2TextConnectors.load_config(str(root / "connectors"))
        video_text_dim = int(c.get("video_connector_num_attention_heads", 30)) * int(
            c.get("video_connector_attention_head_dim", 128))
    if text_encoder is None and has_component(root, "text_encoder"):
        text_encoder = ltx2_text(path=root, max_sequence_length=max_sequence_length, device=device, dtype=dtype,
                                 min_tokenizer_size=min_tokenizer_size)
    scheduler_config = read_json(root / "scheduler" / "scheduler_config.json")
    return LTX2Adapter(transformer, text_encoder, vae, audio_vae, vocoder, negative_prompt=negative_prompt,
                       scheduler_config=scheduler_config, frame_rate=frame_rate, motion_speed=motion_speed,
                       audio_guidance_scale=audio_guidance_scale, guidance_rescale=guidance_rescale,
                       audio_guidance_rescale=audio_guidance_rescale, use_cross_timestep=use_cross_timestep,
                       video_text_dim=video_text_dim, task=task)
