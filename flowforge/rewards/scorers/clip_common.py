"""Shared pieces of the CLIP-tower reward scorers: option checks, the weak model cache, torch image preprocessing,
transformers CLIP loading and the batched-embedding base class of PickScore, CLIP score and the aesthetic score.

The scorers on a transformers ``CLIPModel`` (:mod:`~flowforge.rewards.scorers.pickscore`,
:mod:`~flowforge.rewards.scorers.clip_score`, :mod:`~flowforge.rewards.scorers.aesthetic`) embed with
:class:`TransformersClip`; HPSv2 (:mod:`~flowforge.rewards.scorers.hps`, open_clip) uses the cache and preprocessing.

=========  ========================================================================================
``x``      one image of the batch, ``[3, H, W]`` float in [0, 1] (values outside are clamped)
``p``      its prompt, truncated to the text tower's window (77 tokens for the real models); truncated prompts
           are counted, not hidden: ``sample_flags["truncated"]`` -> ``reward/<name>_truncated_fraction``
``f_I``    ``visual_projection(vision_model(pixels).pooler_output)`` of a transformers ``CLIPModel``
``f_T``    ``text_projection(text_model(ids).pooler_output)``, the same model
``s``      ``logit_scale.exp()`` of that model (about 100 for the released checkpoints)
``cos``    cosine similarity, computed in float32 whatever the model dtype
=========  ========================================================================================

Image preprocessing is done in torch, on the scorer's device, with no PIL round trip: clamp to [0, 1]; resize as the
processor config says (``shortest_edge`` S: the short side becomes S, the long side ``int(S * long / short)``, as
transformers' CLIP processor; or ``height``/``width``) with ``F.interpolate(mode="bicubic", antialias=True)`` (PIL's
a = -0.5 cubic; bilinear when the config says so), skipped when the size already matches; clamp to [0, 1] again
(PIL's uint8 output cannot overshoot); center crop at ``(H - h) // 2, (W - w) // 2``; ``(x - mean) / std``. It is
deterministic; against the reference PIL path (uint8 image -> processor) it differs only by PIL's 8-bit rounding
and fixed-point resampling: within about one grey level (0.015 in normalised units) on smooth content.

Loaded models are shared: :func:`load_clip_model` (and the HPSv2 loader, through :func:`load_cached`) keep a weak
cache keyed by ``(class, resolved path, device, dtype)``, so two reward entries on the same weights (PickScore for
training and for eval, or ``clip_score`` and ``aesthetic`` on CLIP-L/14) load them once; the weights are freed when
the last scorer using them is gone. Loading is local only (``local_files_only=True``): pass directories, not hub ids.
transformers is imported when a scorer is built, not when this module is imported.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flowforge.rewards.base import check_batch_size
from flowforge.runtime.dtypes import resolve_dtype  # names, aliases (bf16, ...) or a torch dtype; re-exported

_RESAMPLE_MODES = {2: "bilinear", 3: "bicubic"}  # PIL resample codes in processor configs -> F.interpolate modes

_MIN_TOKENIZER_SIZE = 10  # transformers hands back a 2-token stub when the files are missing and the Hub is offline

_LOADED: weakref.WeakValueDictionary[tuple, Any] = weakref.WeakValueDictionary()


def resolve_device(device: str | torch.device) -> torch.device:
    """A ``torch.device`` for ``"cpu"`` or a CUDA device; CUDA must be available.

    Raises:
        ValueError: an unparsable device, a type other than cpu / cuda, or CUDA requested but not available.
    """
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device must be 'cpu' or a CUDA device such as 'cuda:0', got {device!r}") from error
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or a CUDA device such as 'cuda:0', got {device!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use device='cpu'")
    if resolved.type == "cuda" and resolved.index is None:  # one cache key for "cuda" and "cuda:<current>"
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def local_dir(path: str | os.PathLike | None, option: str, hint: str) -> Path:
    """The resolved existing directory given as scorer option ``option``; hub ids are not resolved (the Hub is not
    reachable from training machines). ``hint`` says what the directory should hold.

    Raises:
        ValueError: ``path`` is None, not a path, or not an existing directory (the message names ``option``).
    """
    if path is None:
        raise ValueError(f"{option} is required: a local directory holding {hint}")
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{option} must be a path to a local directory, got {type(path).__name__}")
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_dir():
        raise ValueError(
            f"{option}={str(path)!r} is not a local directory; models are loaded from disk only "
            f"(download {hint} beforehand, e.g. `huggingface-cli download <repo> --local-dir <dir>`)"
        )
    return resolved


def local_file(path: str | os.PathLike | None, option: str, hint: str) -> Path:
    """The resolved existing file given as scorer option ``option``; ``hint`` says what the file should hold.

    Raises:
        ValueError: ``path`` is None, not a path, or not an existing file (the message names ``option``).
    """
    if path is None:
        raise ValueError(f"{option} is required: a local file holding {hint}")
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{option} must be a path to a local file, got {type(path).__name__}")
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_file():
        raise ValueError(f"{option}={str(path)!r} is not a file; expected {hint}")
    return resolved


def load_cached(key: tuple, load: Callable[[], Any]) -> Any:
    """The object cached under ``key``, built with ``load()`` when no live scorer holds it (weakly cached: it is
    freed once the last scorer holding it is gone). Keys are ``(class name, resolved path, device, dtype)``."""
    value = _LOADED.get(key)
    if value is None:
        value = load()
        _LOADED[key] = value
    return value


def clear_model_cache() -> None:
    """Forget every cached model (scorers keep theirs; the next build loads again)."""
    _LOADED.clear()


# ------------------------------------------------------------------------------------------------ preprocessing


def _size_entry(size: Any, key: str) -> int | None:
    if size is None:
        return None
    value = size.get(key) if hasattr(size, "get") else getattr(size, key, None)
    return None if value is None else int(value)


@dataclass(frozen=True)
class ImagePreprocess:
    """Torch version of a CLIP image processor's resize / center crop / normalise (see the module docstring).

    ``shortest_edge`` and ``resize_hw`` are exclusive (neither = no resize); ``crop_hw`` None = no crop.
    ``crop_offset``: ``"floor"`` puts the crop at ``(H - h) // 2`` (transformers' processors), ``"round"`` at
    ``int(round((H - h) / 2))`` (torchvision's ``CenterCrop``; Python rounds halves to even, so a margin of 3 starts
    the crop at 2, not 1).
    """

    shortest_edge: int | None
    resize_hw: tuple[int, int] | None
    crop_hw: tuple[int, int] | None
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    mode: str = "bicubic"
    crop_offset: str = "floor"

    @classmethod
    def from_image_processor(cls, processor: Any) -> ImagePreprocess:
        """Read a transformers CLIP image processor's settings (``size``, ``crop_size``, ``image_mean`` ...).

        Raises:
            ValueError: a resample filter other than bilinear / bicubic, or a size without ``shortest_edge`` or
                ``height``/``width``.
        """
        shortest_edge = resize_hw = crop_hw = None
        if getattr(processor, "do_resize", True):
            size = processor.size
            shortest_edge = int(size) if isinstance(size, int) else _size_entry(size, "shortest_edge")
            if shortest_edge is None:
                height, width = _size_entry(size, "height"), _size_entry(size, "width")
                if height is None or width is None:
                    raise ValueError(f"image processor size must give shortest_edge or height/width, got {size!r}")
                resize_hw = (height, width)
        if getattr(processor, "do_center_crop", False):
            crop = processor.crop_size
            side = int(crop) if isinstance(crop, int) else None
            height = side if side is not None else _size_entry(crop, "height")
            width = side if side is not None else _size_entry(crop, "width")
            if height is None or width is None:
                raise ValueError(f"image processor crop_size must give height/width, got {crop!r}")
            crop_hw = (height, width)
        resample = int(getattr(processor, "resample", 3))
        if resample not in _RESAMPLE_MODES:
            raise ValueError(f"image processor resample must be bilinear (2) or bicubic (3), got {resample}")
        if getattr(processor, "do_normalize", True):
            mean = tuple(float(v) for v in processor.image_mean)
            std = tuple(float(v) for v in processor.image_std)
        else:
            mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
        return cls(shortest_edge, resize_hw, crop_hw, mean, std, _RESAMPLE_MODES[resample])

    def _resized_hw(self, height: int, width: int) -> tuple[int, int]:
        if self.resize_hw is not None:
            return self.resize_hw
        if self.shortest_edge is None:
            return height, width
        short, long = min(height, width), max(height, width)
        new_long = int(self.shortest_edge * long / short)
        return (self.shortest_edge, new_long) if height <= width else (new_long, self.shortest_edge)

    def __call__(self, media: Tensor) -> Tensor:
        """``[B, 3, H, W]`` in [0, 1] -> ``[B, 3, h, w]`` float32 normalised pixels, on ``media``'s device.

        Raises:
            ValueError: the resized image is smaller than the crop.
        """
        pixels = media.float().clamp(0.0, 1.0)
        height, width = self._resized_hw(pixels.shape[-2], pixels.shape[-1])
        if (height, width) != tuple(pixels.shape[-2:]):
            pixels = F.interpolate(pixels, size=(height, width), mode=self.mode, align_corners=False, antialias=True)
            pixels = pixels.clamp(0.0, 1.0)
        if self.crop_hw is not None:
            crop_h, crop_w = self.crop_hw
            if crop_h > height or crop_w > width:
                raise ValueError(f"cannot center-crop {crop_h}x{crop_w} from a {height}x{width} resized image")
            if self.crop_offset == "round":
                top, left = int(round((height - crop_h) / 2)), int(round((width - crop_w) / 2))
            else:
                top, left = (height - crop_h) // 2, (width - crop_w) // 2
            pixels = pixels[..., top : top + crop_h, left : left + crop_w]
        mean = torch.tensor(self.mean, dtype=torch.float32, device=pixels.device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32, device=pixels.device).view(1, 3, 1, 1)
        return (pixels - mean) / std


# ------------------------------------------------------------------------------------------------ transformers CLIP


class ClipProcessor:
    """Tokenizer + torch image preprocessing read from one processor directory (weak-cache value)."""

    def __init__(self, tokenizer: Any, preprocess: ImagePreprocess) -> None:
        self.tokenizer = tokenizer
        self.preprocess = preprocess


def load_clip_model(model_path: str | os.PathLike, *, device: str | torch.device = "cpu",
                    dtype: str | torch.dtype = "float32") -> nn.Module:
    """A frozen, eval-mode transformers ``CLIPModel`` from a local directory, shared through the weak cache.

    The cache key is ``("transformers.CLIPModel", resolved path, device, dtype)``: a second call with the same key
    returns the same module object while any scorer still holds it.

    Raises:
        ValueError: ``model_path`` is not a local directory, a bad ``device`` / ``dtype``, or loading failed.
    """
    model_dir = local_dir(model_path, "model_path", "a transformers CLIPModel (config.json + weights)")
    device, dtype = resolve_device(device), resolve_dtype(dtype)

    def load() -> nn.Module:
        from transformers import CLIPModel

        try:
            model = CLIPModel.from_pretrained(str(model_dir), local_files_only=True)
        except (OSError, ValueError) as error:
            raise ValueError(f"could not load a CLIPModel from {str(model_dir)!r}: {error}") from error
        model = model.to(device=device, dtype=dtype).eval()
        model.requires_grad_(False)
        return model

    return load_cached(("transformers.CLIPModel", str(model_dir), str(device), dtype), load)


def load_clip_processor(processor_path: str | os.PathLike) -> ClipProcessor:
    """Tokenizer + :class:`ImagePreprocess` read from a local processor directory, shared through the weak cache
    (key ``("transformers.CLIPProcessor", resolved path)``).

    Raises:
        ValueError: not a local directory, no loadable tokenizer / image processor, or a stub tokenizer (fewer than
            10 tokens: transformers' placeholder when the files are missing).
    """
    processor_dir = local_dir(processor_path, "processor_path", "a CLIP tokenizer and preprocessor_config.json")

    def load() -> ClipProcessor:
        from transformers import AutoImageProcessor, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(processor_dir), local_files_only=True)
            image_processor = AutoImageProcessor.from_pretrained(str(processor_dir), local_files_only=True)
        except (OSError, ValueError, KeyError) as error:
            raise ValueError(f"could not load a CLIP tokenizer / image processor from {str(processor_dir)!r}: "
                             f"{error}") from error
        if len(tokenizer) < _MIN_TOKENIZER_SIZE:
            raise ValueError(f"the tokenizer in {str(processor_dir)!r} has only {len(tokenizer)} tokens (a stub); "
                             "point processor_path at a directory with the real tokenizer files")
        return ClipProcessor(tokenizer, ImagePreprocess.from_image_processor(image_processor))

    return load_cached(("transformers.CLIPProcessor", str(processor_dir)), load)


class TransformersClip:
    """Shared part of the transformers-backed scorers: loading, checks, batched normalised embeddings ``f_I`` /
    ``f_T`` and their float32 cosine (see the module docstring). Subclasses set ``name`` and ``__call__``.

    Args:
        model_path: local directory of a transformers ``CLIPModel``.
        processor_path: local directory of its tokenizer + image processor; None = ``model_path``.
        device, dtype: where and in which dtype the model runs (see :func:`resolve_device`, :func:`resolve_dtype`).
        batch_size: images (and distinct prompts) per forward, >= 1.
        model_hint: what ``model_path`` should hold, for the error message.

    Raises:
        ValueError: a missing path, a bad option, a model / processor that does not load, or a tokenizer / image
            processor that does not match the model (vocabulary larger than the text tower, crop size other than
            the vision tower's).
    """

    name: str
    needs_group: ClassVar[bool] = False

    def __init__(self, model_path: str | os.PathLike | None, processor_path: str | os.PathLike | None, *,
                 device: str | torch.device, dtype: str | torch.dtype, batch_size: int, model_hint: str) -> None:
        self.batch_size = check_batch_size(batch_size)
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        local_dir(model_path, "model_path", model_hint)
        self.model = load_clip_model(model_path, device=self.device, dtype=self.dtype)
        self.processor = load_clip_processor(processor_path if processor_path is not None else model_path)
        self.tokenizer, self.preprocess = self.processor.tokenizer, self.processor.preprocess
        text_config, vision_config = self.model.config.text_config, self.model.config.vision_config
        if len(self.tokenizer) > text_config.vocab_size:
            raise ValueError(f"the tokenizer has {len(self.tokenizer)} tokens but the CLIP text tower only "
                             f"{text_config.vocab_size}: processor_path and model_path do not belong together")
        crop = self.preprocess.crop_hw
        if crop is not None and crop != (vision_config.image_size, vision_config.image_size):
            raise ValueError(f"the image processor crops to {crop} but the CLIP vision tower expects "
                             f"{vision_config.image_size}x{vision_config.image_size}")
        window = int(text_config.max_position_embeddings)
        tokenizer_max = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(tokenizer_max, int) and 0 < tokenizer_max < window:
            window = tokenizer_max
        self.max_length = window
        """Prompts are truncated to this many tokens (the text tower's position embeddings)."""

    def _model_dtype_pixels(self, media: Tensor) -> Tensor:
        return self.preprocess(media.detach().to(self.device)).to(self.dtype)

    def image_embeddings(self, media: Tensor) -> Tensor:
        """``[B, 3, H, W]`` in [0, 1] -> ``[B, D]`` float32 L2-normalised image embeddings on the scorer device."""
        out = []
        for start in range(0, media.shape[0], self.batch_size):
            pixels = self._model_dtype_pixels(media[start : start + self.batch_size])
            pooled = self.model.vision_model(pixel_values=pixels).pooler_output
            out.append(F.normalize(self.model.visual_projection(pooled).float(), dim=-1))
        return torch.cat(out)

    def text_embeddings(self, prompts: Sequence[str]) -> Tensor:
        """``B`` prompts -> ``[B, D]`` float32 L2-normalised text embeddings; each distinct prompt is encoded once
        (a GRPO batch repeats every prompt ``group_size`` times), truncated to ``max_length`` tokens. Sets
        ``sample_flags = {"truncated": [B] bool}`` (prompts longer than ``max_length`` tokens, special tokens
        included), which the reward processor reports as ``reward/<name>_truncated_fraction``."""
        unique = list(dict.fromkeys(prompts))
        lengths = {p: len(ids) for p, ids in zip(unique, self.tokenizer(unique, truncation=False)["input_ids"])}
        self.sample_flags = {"truncated": torch.tensor([lengths[p] > self.max_length for p in prompts])}
        out = []
        for start in range(0, len(unique), self.batch_size):
            tokens = self.tokenizer(unique[start : start + self.batch_size], padding=True, truncation=True,
                                    max_length=self.max_length, return_tensors="pt")
            pooled = self.model.text_model(input_ids=tokens["input_ids"].to(self.device),
                                           attention_mask=tokens["attention_mask"].to(self.device)).pooler_output
            out.append(F.normalize(self.model.text_projection(pooled).float(), dim=-1))
        embeddings = torch.cat(out)
        index = {prompt: i for i, prompt in enumerate(unique)}
        return embeddings[torch.tensor([index[p] for p in prompts], device=embeddings.device)]

    def cosine(self, media: Tensor, prompts: Sequence[str]) -> Tensor:
        """``[B]`` float32 cosine similarity of each image with its own prompt, on the scorer device."""
        return (self.image_embeddings(media) * self.text_embeddings(prompts)).sum(dim=-1)
