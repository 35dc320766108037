"""Helpers shared by the diffusers-family adapters: the lazy text side of a pipeline, 2x2 latent packing, per-channel
latent normalisation, the dynamic-shift pipeline schedule, input checks, reading a
pipeline directory (and its CLIP image encoder) and the ``flowforge.json`` metadata file.

Why a pipeline for the text side
    Each family encodes prompts in its own way (FLUX: pooled CLIP + T5 hidden states; Qwen-Image: Qwen2.5-VL hidden
    states under a chat template whose first ``prompt_template_encode_start_idx`` tokens are dropped; Wan: UMT5 hidden
    states cut to the real tokens and zero-padded). Re-implementing those details is how adapters drift from the
    reference. :class:`PipelineText` builds the family's *own* diffusers pipeline with ``transformer=None,
    vae=None`` (text encoders + tokenizers only) and calls its ``encode_prompt``, so the conditioning is the
    pipeline's by construction. It loads lazily (first use) from a local directory, or wraps in-memory components;
    :meth:`PipelineText.release` frees the weights.

Packing (FLUX, Qwen-Image)
    ``[B, C, H, W] -> [B, (H/2)(W/2), 4C]``: 2x2 patches, channel-major inside a patch (diffusers'
    ``FluxPipeline._pack_latents``); :func:`unpack_2x2` is its inverse (``_unpack_latents``).

Pipeline schedule (FLUX, Qwen-Image)
    :func:`dynamic_shift_mu` and :func:`flow_match_pipeline_sigmas` reproduce what ``FluxPipeline`` /
    ``QwenImagePipeline.__call__`` hand their ``FlowMatchEulerDiscreteScheduler``: ``sigmas = linspace(1, 1/T, T)``
    shifted with ``mu = calculate_shift(image_seq_len, ...)`` read from the scheduler config.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from flowforge.models.base import Conditioning

DEFAULT_MIN_TOKENIZER_SIZE = 1000
"""A tokenizer with fewer tokens is rejected: transformers silently yields a 2-token placeholder tokenizer when the
files are missing and the Hub is unreachable (docs/architecture.md, "Environment facts"). Tests with tiny word-level
tokenizers lower it."""

FLOWFORGE_META = "flowforge.json"
"""Optional file beside a transformer's ``config.json`` naming the text encoder it was trained with (written by
:func:`flowforge.train.sft.run_sft`, read by :func:`flowforge.models.sd3.adapter.load_sd3`, copied by
:mod:`flowforge.tools.export`), e.g. ``{"text_encoder": "minilm", "max_length": 16}``."""

DYNAMIC_SHIFT_DEFAULTS = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15}
"""The fallbacks ``FluxPipeline.__call__`` / ``QwenImagePipeline.__call__`` use in
``self.scheduler.config.get(name, default)`` when computing ``mu``."""

CLIP_IMAGE_PROCESSORS = ("CLIPImageProcessor", "CLIPImageProcessorPil", "CLIPImageProcessorFast")
"""``image_processor`` classes :func:`load_image_encoder` accepts (transformers' names)."""


class PackedImageLatents:
    """Latent geometry of the 2x2-packed image families (FLUX, Qwen-Image), and their packed condition-image
    tokens. Expects ``family`` (a name for errors), ``latent_channels``, ``vae_scale_factor`` and
    ``encode_images``."""

    family: str
    # No condition slot (the AdapterMixin defaults condition_index = None, generated_index = whole latent): a
    # condition image (Kontext / Edit) is consumed inside the velocity as extra image-stream tokens.

    def latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """Unpacked ``(C, height / f, width / f)``, ``f`` = ``vae_scale_factor``.

        Raises:
            ValueError: ``frames`` given, or a size not a positive multiple of ``2 f`` (2x2 packing).
        """
        if frames is not None:
            raise ValueError(f"{self.family} is an image model; frames must be None, got {frames}")
        unit = 2 * self.vae_scale_factor
        if height <= 0 or width <= 0 or height % unit or width % unit:
            raise ValueError(f"height and width must be positive multiples of {unit}, got {height}x{width}")
        f = self.vae_scale_factor
        return (self.latent_channels, height // f, width // f)

    def image_seq_len(self, height: int, width: int) -> int:
        """Number of packed image tokens ``(H/2)(W/2)`` of the latent for ``height x width`` pixels."""
        _, h, w = self.latent_shape(height, width)
        return (h // 2) * (w // 2)

    @torch.no_grad()
    def encode_condition_images(self, images: Tensor, latent_shape: Sequence[int]) -> Tensor:
        """Condition images ``[N, 3, H, W]`` float32 in [0, 1] -> packed image tokens ``[N, (h/2)(w/2), 4C]`` fp32
        (``cond.image`` of FLUX.1 Kontext / Qwen-Image-Edit) for latents of ``latent_shape = (C, h, w)``: the
        family's ``encode_images`` (VAE mode, its latent normalisation) then 2x2 packing, as those pipelines'
        ``_encode_vae_image`` + ``prepare_latents``. The images must already be at the model's pixel size (the
        pipelines' own resizes are not replicated).

        Raises:
            RuntimeError: no VAE.
            ValueError: the images' latent grid is not ``latent_shape`` (images not at the model's pixel size).
        """
        z = self.encode_images(images)
        if tuple(z.shape[1:]) != tuple(latent_shape):
            raise ValueError(f"condition images {tuple(images.shape)} encode to latents {tuple(z.shape[1:])}, expected "
                             f"latent_shape {tuple(latent_shape)}: load them at the model's height x width")
        return pack_2x2(z)


class PipelineText:
    """The text side of a diffusers pipeline, used through the pipeline's own ``encode_prompt``.

    Args:
        pipeline_class: the diffusers pipeline class name (e.g. ``"FluxPipeline"``).
        encode_fn: ``encode_fn(pipe, prompts) -> (prompt_embeds [B, S, D], mask [B, S] | None, pooled [B, P] | None)``.
        path: local pipeline directory (loaded lazily with ``transformer=None, vae=None``, never downloads).
        components: in-memory components instead of ``path`` (``tokenizer``, ``text_encoder``, ...); the pipeline is
            built from them with every other component ``None``. Once released it cannot be rebuilt.
        skip: component names loaded as ``None`` from ``path`` besides ``transformer`` and ``vae``.
        settings: part of :attr:`encoder_id` (sequence lengths etc.).
        encoder_id: explicit id (required for a meaningful on-disk cache of in-memory components).
        min_tokenizer_size: every tokenizer must have more tokens than this.
    """

    def __init__(self, pipeline_class: str, encode_fn: Callable[[Any, list[str]], tuple[Tensor, Tensor | None,
                 Tensor | None]], *, path: str | Path | None = None, components: Mapping[str, Any] | None = None,
                 skip: Sequence[str] = (), device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 settings: str = "", encoder_id: str | None = None,
                 min_tokenizer_size: int = DEFAULT_MIN_TOKENIZER_SIZE):
        if (path is None) == (components is None):
            raise ValueError("give exactly one of path= (a local pipeline directory) or components=")
        self.pipeline_class = pipeline_class
        self.encode_fn = encode_fn
        self.path = None if path is None else str(path)
        self._components = None if components is None else dict(components)
        self.skip = tuple(skip)
        self.device = torch.device(device)
        self.dtype = dtype
        self.settings = settings
        self._encoder_id = encoder_id
        self.min_tokenizer_size = int(min_tokenizer_size)
        self._pipe = None
        self._released = False

    @property
    def encoder_id(self) -> str:
        if self._encoder_id is not None:
            return self._encoder_id
        source = f"path={Path(self.path).resolve()}" if self.path is not None else "in-memory"
        return f"{self.pipeline_class}:{source}:{self.settings}:{self.dtype}"

    @property
    def pipeline(self):
        """The (lazily built) text-only pipeline."""
        if self._pipe is None:
            self._pipe = self._build()
        return self._pipe

    def _build(self):
        import diffusers

        cls = getattr(diffusers, self.pipeline_class)
        if self.path is not None:
            none = {name: None for name in ("transformer", "vae", *self.skip)}
            pipe = cls.from_pretrained(self.path, **none, torch_dtype=self.dtype, local_files_only=True)
        else:
            if self._released:
                raise RuntimeError(f"the in-memory {self.pipeline_class} text encoders were released; they cannot "
                                   "be reloaded (build the adapter from a pipeline directory to reload lazily)")
            import inspect

            params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
            unknown = sorted(set(self._components) - set(params))
            if unknown:
                raise ValueError(f"{self.pipeline_class} has no components {unknown}; allowed: {params}")
            kwargs = {name: self._components.get(name) for name in params
                      if name in self._components or inspect.signature(cls.__init__).parameters[name].default
                      is inspect.Parameter.empty}
            pipe = cls(**kwargs)
        pipe.to(self.device)
        for name, module in pipe.components.items():
            if isinstance(module, torch.nn.Module):
                module.eval().requires_grad_(False)
            elif name.startswith("tokenizer") and module is not None and len(module) <= self.min_tokenizer_size:
                raise RuntimeError(f"{self.path or 'components'}: {name} has only {len(module)} tokens "
                                   f"(placeholder tokenizer?); expected more than {self.min_tokenizer_size}")
        return pipe

    def release(self) -> None:
        """Drop the text encoders (reloaded on the next :meth:`encode` when built from a directory)."""
        self._pipe = None
        if self._components is not None:
            self._components = {}
            self._released = True

    @torch.no_grad()
    def encode(self, prompts: Sequence[str]) -> tuple[Tensor, Tensor | None, Tensor | None]:
        return self.encode_fn(self.pipeline, list(prompts))


def encode_with_negative(text: Any, prompts: Sequence[str], negative_prompt: str | None) -> Conditioning:
    """``Conditioning`` of ``prompts`` with ``negative`` = the encoding of ``negative_prompt`` broadcast to every row
    (``None``: no negative). Prompts and the negative prompt are encoded in two calls, as the pipelines do.

    Raises:
        RuntimeError: ``text`` is None. TypeError: ``prompts`` is a single string.
    """
    if text is None:
        raise RuntimeError("this adapter has no text encoder (it was released or never given)")
    if isinstance(prompts, str):
        raise TypeError("prompts must be a sequence of strings, not a single string")
    prompts = list(prompts)
    embeds, mask, pooled = text.encode(prompts)
    negative = None
    if negative_prompt is not None:
        n = len(prompts)
        e_u, m_u, p_u = text.encode([negative_prompt])

        def rows(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.expand(n, *t.shape[1:]).contiguous()

        negative = Conditioning(prompt_embeds=rows(e_u), pooled=rows(p_u), mask=rows(m_u))
    return Conditioning(prompt_embeds=embeds, pooled=pooled, mask=mask, negative=negative)


def check_velocity_inputs(x: Tensor, sigma: Tensor, cond: Conditioning, ndim: int) -> Tensor:
    """Validate ``x [B, *latent]`` (``ndim`` dims), ``sigma [B]`` and the batch of ``cond``; returns ``sigma`` fp32.

    Raises:
        ValueError: wrong rank of ``x``, ``sigma`` not ``[B]``, batch mismatch.
    """
    if x.ndim != ndim:
        raise ValueError(f"x must have {ndim} dims, got shape {tuple(x.shape)}")
    batch = x.shape[0]
    sigma = torch.as_tensor(sigma)
    if sigma.shape != (batch,):
        raise ValueError(f"sigma must have shape [B] = ({batch},), got {tuple(sigma.shape)}")
    if cond.batch_size != batch:
        raise ValueError(f"cond has batch size {cond.batch_size}, x has {batch}")
    return sigma.to(device=x.device, dtype=torch.float32)


def require_negative(cond: Conditioning, guidance_scale: float) -> Conditioning:
    if cond.negative is None:
        raise ValueError(f"guidance_scale={guidance_scale} needs cond.negative (the unconditional encoding); "
                         "it is None")
    return cond.negative


def pack_2x2(x: Tensor) -> Tensor:
    """``[B, C, H, W] -> [B, (H/2)(W/2), 4C]`` (diffusers ``FluxPipeline._pack_latents``)."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(tokens: Tensor, height: int, width: int) -> Tensor:
    """``[B, (H/2)(W/2), 4C] -> [B, C, H, W]`` for latent ``height x width`` (inverse of :func:`pack_2x2`)."""
    b, _, d = tokens.shape
    x = tokens.view(b, height // 2, width // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, height, width)


def latent_stats(vae: torch.nn.Module, like: Tensor, ndim: int = 5) -> tuple[Tensor, Tensor]:
    """``(latents_mean, 1 / latents_std)`` of a Wan / Qwen-Image VAE, shaped ``[1, C, 1, 1, 1]`` (``ndim`` dims),
    on ``like``'s device and dtype — the exact tensors the diffusers pipelines build."""
    cfg = vae.config
    shape = (1, cfg.z_dim) + (1,) * (ndim - 2)
    mean = torch.tensor(cfg.latents_mean).view(shape).to(like.device, like.dtype)
    inv_std = 1.0 / torch.tensor(cfg.latents_std).view(shape).to(like.device, like.dtype)
    return mean, inv_std


def to_unit_range(images: Tensor) -> Tensor:
    """VAE output in [-1, 1] -> float32 in [0, 1] (diffusers ``VaeImageProcessor.denormalize`` + clamp)."""
    return (images.float() / 2 + 0.5).clamp(0.0, 1.0)


def vae_decode_scaled(vae: torch.nn.Module, latents: Tensor) -> Tensor:
    """Model latents ``[B, C, h, w]`` → images ``[B, 3, h f, w f]`` float32 in [0, 1]:
    ``vae.decode(z / scaling_factor + shift_factor)`` (FLUX.1 / Z-Image pipelines, before ``vae.decode``)."""
    cfg = vae.config
    z = latents.to(vae.dtype) / cfg.scaling_factor + cfg.shift_factor
    return to_unit_range(vae.decode(z, return_dict=False)[0])


def vae_encode_scaled(vae: torch.nn.Module, images: Tensor) -> Tensor:
    """Images ``[B, 3, H, W]`` in [0, 1] → model latents ``(mode(z) - shift_factor) * scaling_factor`` fp32, the
    inverse of :func:`vae_decode_scaled` up to the VAE."""
    cfg = vae.config
    pixels = (images.to(device=vae.device, dtype=torch.float32) * 2.0 - 1.0).to(vae.dtype)
    z = vae.encode(pixels).latent_dist.mode()
    return ((z - cfg.shift_factor) * cfg.scaling_factor).float()


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def pipeline_dir(path: str | Path, family: str) -> Path:
    """Check that ``path`` is a diffusers pipeline directory (``model_index.json`` + ``transformer/``).

    Raises:
        FileNotFoundError: otherwise.
    """
    root = Path(path)
    if not (root / "model_index.json").is_file() or not (root / "transformer" / "config.json").is_file():
        raise FileNotFoundError(f"{path!s}: expected a local diffusers {family} pipeline directory "
                                "(model_index.json and transformer/config.json, as written by save_pretrained)")
    return root


def has_component(root: Path, name: str) -> bool:
    """Whether the pipeline directory lists component ``name`` (not null in model_index.json) and has its folder."""
    entry = read_json(root / "model_index.json").get(name)
    return isinstance(entry, list) and entry[0] is not None and (root / name).is_dir()


def read_flowforge_meta(directory: Path) -> dict[str, Any]:
    """The :data:`FLOWFORGE_META` file of a transformer ``directory`` as a dict (``{}`` when absent)."""
    return read_json(Path(directory) / FLOWFORGE_META)


def dynamic_shift_mu(scheduler_config: Mapping[str, Any], image_seq_len: int) -> float:
    """Dynamic-shift ``mu`` for ``image_seq_len`` packed image tokens, as ``FluxPipeline.__call__`` /
    ``QwenImagePipeline.__call__`` compute it: ``calculate_shift(image_seq_len, base_image_seq_len,
    max_image_seq_len, base_shift, max_shift)`` with the scheduler config's values, else
    :data:`DYNAMIC_SHIFT_DEFAULTS`."""
    from flowforge.algorithms.schedules import calculate_shift

    cfg = {k: scheduler_config.get(k, v) for k, v in DYNAMIC_SHIFT_DEFAULTS.items()}
    return calculate_shift(image_seq_len, cfg["base_image_seq_len"], cfg["max_image_seq_len"], cfg["base_shift"],
                           cfg["max_shift"])


def flow_match_pipeline_sigmas(scheduler_config: Mapping[str, Any], num_steps: int, mu: float) -> Tensor:
    """``[T+1]`` fp32 sigmas (in [0, 1], ending in 0) of diffusers' ``FlowMatchEulerDiscreteScheduler`` built from
    ``scheduler_config`` (``use_dynamic_shifting`` defaulting to True; ``shift_terminal`` etc. honoured) for
    ``sigmas = linspace(1, 1/T, T)`` and ``mu``, as the FLUX / Qwen-Image pipelines call it.

    Raises:
        ValueError: ``num_steps`` not an int >= 1.
    """
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
    config = {k: v for k, v in scheduler_config.items() if not k.startswith("_")}
    config.setdefault("use_dynamic_shifting", True)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    return scheduler.sigmas.to(torch.float32).cpu()


def load_image_encoder(root: Path, index: Mapping[str, Any], device: torch.device | str) -> tuple[Any, Any]:
    """``(image_encoder, image_processor)`` of a pipeline directory ``root`` whose ``model_index.json`` is
    ``index``: a transformers ``CLIPVisionModel`` (fp32) and the CLIP image processor class the index names; each
    ``None`` when not listed / absent. Never downloads.

    Raises:
        ValueError: the index names an image processor class outside :data:`CLIP_IMAGE_PROCESSORS`.
    """
    import transformers

    image_encoder = image_processor = None
    if has_component(root, "image_encoder"):
        image_encoder = transformers.CLIPVisionModel.from_pretrained(
            str(root / "image_encoder"), dtype=torch.float32, local_files_only=True).to(device)
    if has_component(root, "image_processor"):
        # diffusers resolves the class model_index.json names in transformers: "CLIPImageProcessor" (the torchvision
        # backend, or CLIPImageProcessorPil without torchvision) or, as saved from a PIL processor,
        # "CLIPImageProcessorPil".
        name = index["image_processor"][1]
        if name not in CLIP_IMAGE_PROCESSORS:
            raise ValueError(f"{root!s}: image_processor class {name!r}; expected one of {list(CLIP_IMAGE_PROCESSORS)}")
        image_processor = getattr(transformers, name).from_pretrained(str(root / "image_processor"),
                                                                      local_files_only=True)
    return image_encoder, image_processor
