"""Stable Diffusion 3 / 3.5 family adapter (diffusers ``SD3Transformer2DModel``) — also the embedded demo policy.

The adapter turns flowforge's convention (docs/architecture.md, "Conventions") into the transformer's call:

==================  ================================================================================================
flowforge           SD3 transformer
==================  ================================================================================================
``sigma`` [B]       ``timestep = 1000 * sigma`` (diffusers' ``FlowMatchEulerDiscreteScheduler`` unit), model dtype
``x`` [B,C,H,W]     ``hidden_states`` (latents, or pixels in [-1, 1] in pixel-space mode), model dtype
``v`` (fp32)        ``transformer(...).sample`` — SD3 is trained to predict ``noise - x0``, i.e. flowforge's velocity
CFG                 ``v_u + g (v_c - v_u)`` with ``v_u`` from ``cond.negative``; both halves in one batched forward
VAE latents         ``z_model = (z_vae - shift_factor) * scaling_factor``; :meth:`SD3Adapter.decode` inverts it
pixel space         no VAE: ``decode(x) = clamp((x + 1) / 2, 0, 1)``, one channel repeated to RGB
==================  ================================================================================================

Text encoders are pluggable: anything with ``encode(prompts) -> (prompt_embeds [B,S,D], mask [B,S] | None,
pooled [B,P])`` and an ``encoder_id`` string. The demo uses :class:`~flowforge.models.text.MiniLMEncoder`; real
SD3 / 3.5 checkpoints use :class:`SD3PipelineTextEncoder` (CLIP-L + CLIP-G + T5 through diffusers'
``StableDiffusion3Pipeline.encode_prompt``). The SD3 transformer takes no context mask: padded context positions
(zeros for MiniLM, pad-token embeddings for T5) are attended like SD3 itself does; the mask is kept in the
:class:`Conditioning` for other consumers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from flowforge.models.base import Conditioning, frozen
from flowforge.models.family import FamilyAdapter
from flowforge.models.lora import JOINT_ATTENTION_LORA_TARGETS
from flowforge.models.sd3.spec import FAMILY
from flowforge.models.common import FLOWFORGE_META, check_velocity_inputs, read_flowforge_meta

logger = logging.getLogger(__name__)

SD3_TIMESTEP_SCALE = 1000.0
"""SD3's native timestep is ``1000 * sigma``."""

SD3_LORA_TARGETS = JOINT_ATTENTION_LORA_TARGETS
"""Attention projections of diffusers' ``JointTransformerBlock`` (image stream ``to_*``, text stream ``add_*``).
The last SD3 block is context-pre-only and has no ``to_add_out``; peft matches suffixes, so that is fine."""


class SD3PipelineTextEncoder:
    """CLIP-L + CLIP-G + T5-XXL of a local diffusers SD3 / 3.5 directory, via
    ``StableDiffusion3Pipeline.encode_prompt``.

    Loaded lazily (first :meth:`encode`) with ``transformer=None, vae=None`` so only the text side is read;
    :meth:`release` frees it. Outputs: ``prompt_embeds [B, 77 + max_sequence_length, 4096]``, ``pooled [B, 2048]``,
    no mask (SD3 attends the whole context).
    """

    def __init__(self, path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 max_sequence_length: int = 256):
        self.path = str(path)
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_sequence_length = int(max_sequence_length)
        self._pipe = None

    @property
    def encoder_id(self) -> str:
        return f"sd3-pipeline:{Path(self.path).resolve()}:t5_len={self.max_sequence_length}:{self.dtype}"

    def _load(self):
        if self._pipe is None:
            from diffusers import StableDiffusion3Pipeline

            pipe = StableDiffusion3Pipeline.from_pretrained(
                self.path, transformer=None, vae=None, torch_dtype=self.dtype, local_files_only=True
            )
            pipe.to(self.device)
            for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
                module = getattr(pipe, name, None)
                if module is not None:
                    module.eval().requires_grad_(False)
            for name in ("tokenizer", "tokenizer_2", "tokenizer_3"):
                tok = getattr(pipe, name, None)
                if tok is not None and len(tok) <= 1000:
                    raise RuntimeError(f"{self.path}: {name} has only {len(tok)} tokens (placeholder tokenizer?)")
            self._pipe = pipe
        return self._pipe

    def release(self) -> None:
        self._pipe = None

    @torch.no_grad()
    def encode(self, prompts: Sequence[str]) -> tuple[Tensor, Tensor | None, Tensor]:
        pipe = self._load()
        embeds, _, pooled, _ = pipe.encode_prompt(
            prompt=list(prompts), prompt_2=None, prompt_3=None, device=self.device, num_images_per_prompt=1,
            do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length,
        )
        return embeds, None, pooled


class SD3Adapter(FamilyAdapter):
    """:class:`~flowforge.models.base.FlowModel` around a diffusers ``SD3Transformer2DModel``.

    Args:
        transformer: the ``SD3Transformer2DModel`` (put in eval mode here; its dtype is the forward dtype).
        text_encoder: object with ``encode(prompts) -> (embeds, mask | None, pooled)`` and ``encoder_id``;
            ``None`` makes :meth:`encode` raise (conditioning must then come from a cache).
        vae: optional ``AutoencoderKL``; ``None`` selects pixel-space mode.
        negative_prompt: the prompt whose encoding is ``Conditioning.negative`` (CFG's unconditional branch).
    """

    family_spec = FAMILY

    lora_targets: tuple[str, ...] = SD3_LORA_TARGETS
    tasks: tuple[str, ...] = FAMILY.tasks
    differentiable_decode: bool = True  # decode runs with gradient when called with it (reward-gradient: draft)

    def __init__(self, transformer: nn.Module, text_encoder: Any = None, vae: nn.Module | None = None, *,
                 negative_prompt: str = ""):
        self.transformer = transformer.eval()
        self.text_encoder = text_encoder
        self.vae = frozen(vae)
        self.negative_prompt = negative_prompt

    # ------------------------------------------------------------------ properties

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent cell (8 for SD3's VAE, 1 in pixel space)."""
        if self.vae is None:
            return 1
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def default_resolution(self) -> int:
        """Side in pixels of the transformer's training resolution (``sample_size * vae_scale_factor``)."""
        return int(self.config.sample_size) * self.vae_scale_factor

    # ------------------------------------------------------------------ FlowModel

    def blocks(self) -> list[nn.Module]:
        """The ``JointTransformerBlock`` modules, in order."""
        return list(self.transformer.transformer_blocks)

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """Encode ``prompts`` (and the negative prompt, once, broadcast to ``negative``) on the text encoder's device.

        Raises:
            RuntimeError: the adapter has no text encoder. TypeError: ``prompts`` is a single string.
        """
        if self.text_encoder is None:
            raise RuntimeError("this SD3Adapter has no text encoder (it was released or never given)")
        if isinstance(prompts, str):
            raise TypeError("prompts must be a sequence of strings, not a single string")
        prompts = list(prompts)
        embeds, mask, pooled = self.text_encoder.encode(prompts + [self.negative_prompt])
        n = len(prompts)

        def split(t: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
            if t is None:
                return None, None
            return t[:n].contiguous(), t[n:].expand(n, *t.shape[1:]).contiguous()

        (e_c, e_u), (m_c, m_u), (p_c, p_u) = split(embeds), split(mask), split(pooled)
        negative = Conditioning(prompt_embeds=e_u, pooled=p_u, mask=m_u)
        return Conditioning(prompt_embeds=e_c, pooled=p_c, mask=m_c, negative=negative)

    def latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """``(C, height / f, width / f)`` with ``f`` = :attr:`vae_scale_factor`.

        Raises:
            ValueError: ``frames`` given (image model), a size not divisible by ``f * patch_size``, or larger than
                the transformer's positional embedding covers (``pos_embed_max_size`` patches a side).
        """
        if frames is not None:
            raise ValueError(f"SD3 is an image model; frames must be None, got {frames}")
        unit = self.vae_scale_factor * int(self.config.patch_size)
        if height <= 0 or width <= 0 or height % unit or width % unit:
            raise ValueError(f"height and width must be positive multiples of {unit}, got {height}x{width}")
        patches = getattr(self.config, "pos_embed_max_size", None)  # diffusers refuses more at the first forward
        if patches is not None and max(height, width) > patches * unit:
            raise ValueError(f"this model takes at most {patches * unit}x{patches * unit} pixels (pos_embed_max_size "
                             f"{patches} patches a side x {unit} pixels a patch, VAE factor x patch_size), got "
                             f"{height}x{width}; use multiples of {unit} up to {patches * unit}")
        f = self.vae_scale_factor
        return (int(self.config.in_channels), height // f, width // f)

    def _forward(self, x: Tensor, sigma: Tensor, cond: Conditioning) -> Tensor:
        dtype = self.dtype
        if cond.pooled is None:
            raise ValueError("SD3 needs a pooled text embedding (cond.pooled is None)")
        out = self.transformer(
            hidden_states=x.to(dtype),
            encoder_hidden_states=cond.prompt_embeds.to(device=x.device, dtype=dtype),
            pooled_projections=cond.pooled.to(device=x.device, dtype=dtype),
            timestep=(SD3_TIMESTEP_SCALE * sigma.to(device=x.device, dtype=torch.float32)).to(dtype),
            return_dict=False,
        )[0]
        return out.float()

    def velocity(self, x: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Velocity ``noise - x0`` at ``x [B, C, H, W]`` and noise level ``sigma [B]`` in [0, 1]; fp32, shape of ``x``.

        ``guidance_scale > 1`` (the pipeline's ``do_classifier_free_guidance``): ``v_u + g (v_c - v_u)`` with the
        unconditional branch from ``cond.negative`` (one forward over the doubled batch, as the pipeline); any other
        value runs the conditional branch only.

        Raises:
            ValueError: ``x`` not ``[B, C, H, W]``; ``sigma`` not of shape ``[B]``; batch mismatch; guidance > 1
                without ``cond.negative``.
        """
        sigma = check_velocity_inputs(x, sigma, cond, 4)
        g = float(guidance_scale)
        if self.guidance_use(g) != "cfg":
            return self._forward(x, sigma, cond)
        if cond.negative is None:
            raise ValueError(f"guidance_scale={g} needs cond.negative (the unconditional encoding); it is None")
        neg = cond.negative
        if neg.pooled is None or cond.pooled is None:
            raise ValueError("SD3 needs a pooled text embedding in cond and cond.negative")
        # The transformer ignores masks, so only the embeddings are concatenated (unconditional half first).
        both = Conditioning(
            prompt_embeds=torch.cat([neg.prompt_embeds.to(cond.prompt_embeds.device), cond.prompt_embeds]),
            pooled=torch.cat([neg.pooled.to(cond.pooled.device), cond.pooled]),
        )
        v_u, v_c = self._forward(torch.cat([x, x]), torch.cat([sigma, sigma]), both).chunk(2)
        return v_u + g * (v_c - v_u)

    def decode(self, latents: Tensor) -> Tensor:
        """Latents (or pixels in [-1, 1]) ``[B, C, H, W]`` → images ``[B, 3, H', W']`` float32 in [0, 1].

        Differentiable (no ``no_grad``: the VAE is frozen, so latents without grad build no graph; rollouts decode
        under :func:`flowforge.rollout.decode_media`'s ``no_grad``); the clamp to [0, 1] passes no gradient outside."""
        if self.vae is None:
            images = ((latents.float() + 1.0) / 2.0).clamp(0.0, 1.0)
        else:
            cfg = self.vae.config
            z = latents.to(self.vae.dtype) / cfg.scaling_factor + (cfg.shift_factor or 0.0)
            images = ((self.vae.decode(z, return_dict=False)[0].float() + 1.0) / 2.0).clamp(0.0, 1.0)
        if images.shape[1] == 1:
            images = images.repeat(1, 3, 1, 1)
        return images

    @torch.no_grad()
    def encode_images(self, images: Tensor) -> Tensor:
        """Images ``[B, C, H, W]`` in [0, 1] → model latents ``x0`` (the inverse of :meth:`decode` up to the VAE).

        Pixel space: ``2 * images - 1`` (channels must match the transformer). With a VAE: the posterior mean,
        then ``(z - shift_factor) * scaling_factor``.
        """
        if self.vae is None:
            if images.shape[1] != self.config.in_channels:
                raise ValueError(f"pixel-space model takes {self.config.in_channels} channels, got {images.shape[1]}")
            return images.float() * 2.0 - 1.0
        cfg = self.vae.config
        z = self.vae.encode(images.to(self.vae.dtype) * 2.0 - 1.0).latent_dist.mean
        return ((z - (cfg.shift_factor or 0.0)) * cfg.scaling_factor).float()



def load_sd3(path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
             task: str = "t2i", text_encoder: Any = None, negative_prompt: str = "",
             max_sequence_length: int = 256) -> SD3Adapter:
    """Load an SD3-family model from local files (never downloads).

    Args:
        path: a diffusers pipeline directory (``transformer/``, optional ``vae/``, text encoders); or a bare
            transformer directory (``config.json`` + safetensors, e.g. an SFT output or the shipped demo base,
            ``flowforge.demo.paths.demo_base_dir()``) whose ``flowforge.json`` names its text encoder. The name
            ``"demo:base"`` is resolved before this call (:func:`flowforge.demo.paths.resolve_demo_path`).
        dtype: dtype of the transformer, VAE and text encoders.
        device: where everything is placed.
        task: ``"t2i"``, the one task of the family (checked by the registry, :meth:`Family.check_task`).
        text_encoder: overrides the text encoder chosen from the files.
        negative_prompt: CFG's unconditional prompt.
        max_sequence_length: T5 tokens (pipeline directories only).

    Raises:
        FileNotFoundError: ``path`` is neither a pipeline nor a transformer directory.
        ValueError: no text encoder can be determined for a bare transformer directory.
    """
    from diffusers import AutoencoderKL, SD3Transformer2DModel

    from flowforge.models.text import MiniLMEncoder

    root = Path(path)
    if (root / "transformer" / "config.json").is_file():
        transformer_dir, pipeline_dir = root / "transformer", root
    elif (root / "config.json").is_file():
        transformer_dir, pipeline_dir = root, None
    else:
        raise FileNotFoundError(
            f"{path!s}: expected a diffusers pipeline directory (transformer/config.json) or a transformer directory "
            "(config.json); resolve 'demo:' names first with flowforge.demo.paths.resolve_demo_path"
        )
    transformer = SD3Transformer2DModel.from_pretrained(str(transformer_dir), torch_dtype=dtype,
                                                        local_files_only=True)
    transformer = transformer.to(device).eval()
    vae = None
    if pipeline_dir is not None and (pipeline_dir / "vae" / "config.json").is_file():
        vae = AutoencoderKL.from_pretrained(str(pipeline_dir / "vae"), torch_dtype=dtype, local_files_only=True)
        vae = vae.to(device)
    if text_encoder is None:
        meta = read_flowforge_meta(transformer_dir)
        if meta.get("text_encoder") == "minilm":
            text_encoder = MiniLMEncoder(max_length=int(meta.get("max_length", 16)), device=device, dtype=dtype)
        elif pipeline_dir is not None and (pipeline_dir / "text_encoder").is_dir():
            text_encoder = SD3PipelineTextEncoder(pipeline_dir, device=device, dtype=dtype,
                                                  max_sequence_length=max_sequence_length)
        elif meta.get("text_encoder") is not None:
            raise ValueError(f"{transformer_dir / FLOWFORGE_META}: unknown text_encoder {meta['text_encoder']!r}; "
                             "allowed: ['minilm']")
        else:
            raise ValueError(
                f"{path!s} has no text encoders and no {FLOWFORGE_META}; pass text_encoder= explicitly"
            )
    return SD3Adapter(transformer, text_encoder, vae, negative_prompt=negative_prompt)
