"""Reward models on CLIP towers: PickScore, CLIP score, LAION aesthetic (transformers) and HPSv2 (optional open_clip).

All four embed the image (and the prompt) with a CLIP model and score the pair; higher is better:

    PickScore   r = s * cos(f_I(x), f_T(p))            (/ 26 with ``normalize=True``)
    CLIP score  r = cos(f_I(x), f_T(p))                 ("cosine"; see ``ClipScore`` for the other formulas)
    aesthetic   r = MLP(f_I(x) / ||f_I(x)||)            predicted 1..10 rating, the prompt is not used
    HPSv2       r = cos(g_I(x), g_T(p))                 open_clip ViT-H-14 fine-tuned on HPD v2

=========  ========================================================================================
``x``      one image of the batch, ``[3, H, W]`` float in [0, 1] (values outside are clamped)
``p``      its prompt, truncated to the text tower's window (77 tokens for the real models)
``f_I``    ``visual_projection(vision_model(pixels).pooler_output)`` of a transformers ``CLIPModel``
``f_T``    ``text_projection(text_model(ids).pooler_output)``, the same model
``s``      ``logit_scale.exp()`` of that model (about 100 for the released checkpoints)
``cos``    cosine similarity, computed in float32 whatever the model dtype
``MLP``    the improved-aesthetic-predictor head: Linear(D, 1024) Dropout(0.2) Linear(1024, 128) Dropout(0.2)
           Linear(128, 64) Dropout(0.1) Linear(64, 16) Linear(16, 1), D = CLIP projection dim (768 for L/14)
``g``      open_clip ``encode_image`` / ``encode_text`` with ``normalize=True``
=========  ========================================================================================

Sources (formulas checked against the reference code):

* PickScore: Kirstain et al., "Pick-a-Pic: An Open Dataset of User Preferences for Text-to-Image Generation",
  NeurIPS 2023, arXiv:2305.01569; model card of ``yuvalkirstain/PickScore_v1`` (``model.logit_scale.exp() *
  text_embs @ image_embs.T`` on L2-normalised embeddings, processor ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``).
  flow_grpo's ``flow_grpo/pickscore_scorer.py`` (Liu et al., "Flow-GRPO", arXiv:2505.05470) divides that by 26
  ("norm to 0-1"); ``normalize=True`` reproduces it. The default is the paper's raw score, the value reported in
  the PickScore / Flow-GRPO tables (about 18..24 for real images).
* CLIP score: Radford et al. 2021 (CLIP); Hessel et al., "CLIPScore", EMNLP 2021 (``2.5 * max(cos, 0)``);
  flow_grpo's ``flow_grpo/clip_scorer.py`` (``logits_per_image.diagonal() / 30`` = ``s * cos / 30``).
* Aesthetic: Schuhmann, LAION ``improved-aesthetic-predictor`` (``simple_inference.py``; head weights
  ``sac+logos+ava1-l14-linearMSE.pth`` on ``openai/clip-vit-large-patch14``); flow_grpo's
  ``flow_grpo/aesthetic_scorer.py`` (same head on the L2-normalised ``get_image_features``).
* HPSv2: Wu et al., "Human Preference Score v2", arXiv:2306.09341; ``tgxs002/HPSv2`` ``score.py`` and flow_grpo's
  ``flow_grpo/hpsv2_scorer.py`` (``diag(image_features @ text_features.T)`` of the normalised open_clip
  features, ViT-H-14, checkpoint ``HPS_v2.1_compressed.pt``; no logit scale).

Image preprocessing is done in torch, on the scorer's device, with no PIL round trip: clamp to [0, 1]; resize as the
processor config says (``shortest_edge`` S: the short side becomes S, the long side ``int(S * long / short)``, as
transformers' CLIP processor; or ``height``/``width``) with ``F.interpolate(mode="bicubic", antialias=True)`` (PIL's
a = -0.5 cubic; bilinear when the config says so), skipped when the size already matches; clamp to [0, 1] again
(PIL's uint8 output cannot overshoot); center crop at ``(H - h) // 2, (W - w) // 2``; ``(x - mean) / std``. It is
deterministic; against the reference PIL path (uint8 image -> processor) it differs only by PIL's 8-bit rounding
and fixed-point resampling: within about one grey level (0.015 in normalised units) on smooth content.

Loaded models are shared: :func:`load_clip_model` (and the HPSv2 loader) keep a weak cache keyed by
``(class, resolved path, device, dtype)``, so two reward entries on the same weights (PickScore for training and
for eval, or ``clip_score`` and ``aesthetic`` on CLIP-L/14) load them once; the weights are freed when the last
scorer using them is gone. Loading is local only (``local_files_only=True``): pass directories, not hub ids.
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

from flowforge.rewards.base import check_inputs

PICKSCORE_NORMALIZER = 26.0
"""flow_grpo's divisor that maps raw PickScore (about 18..24) to roughly [0, 1]."""

CLIPSCORE_WEIGHT = 2.5
"""Hessel et al. 2021's ``w`` in ``CLIPScore = w * max(cos, 0)``."""

FLOW_GRPO_CLIP_DIVISOR = 30.0
"""flow_grpo's ``clip_scorer.py`` divisor of ``logits_per_image``."""

CLIP_SCORE_FORMULAS = ("cosine", "clipscore", "flow_grpo")

HPS_INSTALL_HINT = (
    "the 'hps' reward needs open_clip: pip install 'flowforge[hps]' (installs open-clip-torch). open-clip-torch "
    "imports torchvision, which must be the build made for this torch (torch==2.13.0): install torchvision from the "
    "same index as torch (e.g. --index-url https://download.pytorch.org/whl/cpu for the CPU wheel); a torchvision "
    "built for another torch fails at import. The rest of flowforge never imports torchvision"
)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

_RESAMPLE_MODES = {2: "bilinear", 3: "bicubic"}  # PIL resample codes in processor configs -> F.interpolate modes

_MIN_TOKENIZER_SIZE = 10  # transformers may hand back a 2-token stub when files are missing (DESIGN.md §9)

_LOADED: weakref.WeakValueDictionary[tuple, Any] = weakref.WeakValueDictionary()


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``torch.float32 / bfloat16 / float16`` from a dtype or one of the names in ``_DTYPES``.

    Raises:
        ValueError: anything else (the message lists the allowed names).
    """
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)} (or the torch dtype), got {dtype!r}")


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


def _check_batch_size(batch_size: int) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    return batch_size


def _local_dir(path: str | os.PathLike | None, option: str, hint: str) -> Path:
    """Resolved existing directory for ``option``; hub ids are not resolved (the hub is not reachable)."""
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


def _local_file(path: str | os.PathLike | None, option: str, hint: str) -> Path:
    if path is None:
        raise ValueError(f"{option} is required: a local file holding {hint}")
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{option} must be a path to a local file, got {type(path).__name__}")
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_file():
        raise ValueError(f"{option}={str(path)!r} is not a file; expected {hint}")
    return resolved


def _cached(key: tuple, load: Callable[[], Any]) -> Any:
    """The object cached under ``key``, loading it when no live scorer holds it."""
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
    """

    shortest_edge: int | None
    resize_hw: tuple[int, int] | None
    crop_hw: tuple[int, int] | None
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    mode: str = "bicubic"

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
    model_dir = _local_dir(model_path, "model_path", "a transformers CLIPModel (config.json + weights)")
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

    return _cached(("transformers.CLIPModel", str(model_dir), str(device), dtype), load)


def load_clip_processor(processor_path: str | os.PathLike) -> ClipProcessor:
    """Tokenizer + :class:`ImagePreprocess` read from a local processor directory, shared through the weak cache
    (key ``("transformers.CLIPProcessor", resolved path)``).

    Raises:
        ValueError: not a local directory, no loadable tokenizer / image processor, or a stub tokenizer (fewer than
            10 tokens: transformers' placeholder when the files are missing).
    """
    processor_dir = _local_dir(processor_path, "processor_path", "a CLIP tokenizer and preprocessor_config.json")

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

    return _cached(("transformers.CLIPProcessor", str(processor_dir)), load)


class _TransformersClip:
    """Shared part of the transformers-backed scorers: loading, checks, batched normalised embeddings."""

    name: str
    needs_group: ClassVar[bool] = False

    def __init__(self, model_path: str | os.PathLike | None, processor_path: str | os.PathLike | None, *,
                 device: str | torch.device, dtype: str | torch.dtype, batch_size: int, model_hint: str) -> None:
        self.batch_size = _check_batch_size(batch_size)
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        _local_dir(model_path, "model_path", model_hint)
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
        (a GRPO batch repeats every prompt ``group_size`` times), truncated to ``max_length`` tokens."""
        unique = list(dict.fromkeys(prompts))
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


def _check_flag(value: bool, option: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{option} must be True or False, got {value!r}")
    return value


class PickScore(_TransformersClip):
    """PickScore (Kirstain et al. 2023): ``logit_scale.exp() * cos(image, prompt)`` of the Pick-a-Pic CLIP-H.

    Args:
        model_path: local directory of ``yuvalkirstain/PickScore_v1`` (a transformers ``CLIPModel``).
        processor_path: local directory of the tokenizer + image processor, i.e. of
            ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` (PickScore's processor); defaults to ``model_path``.
        normalize: divide by 26 as flow_grpo's ``pickscore_scorer.py`` does (about [0, 1] instead of ~18..24).
        device: ``"cpu"`` or a CUDA device where the model lives; media is moved there, scores come back.
        dtype: model dtype (``"float32"``, ``"bfloat16"``, ``"float16"``); the cosine is always float32.
        batch_size: images (and distinct prompts) per forward, >= 1.

    Raises:
        ValueError: a missing path, a bad option, or a model / processor that does not load or does not match.
    """

    name = "pickscore"

    def __init__(self, model_path: str | os.PathLike | None = None, processor_path: str | os.PathLike | None = None,
                 *, normalize: bool = False, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
                 batch_size: int = 32) -> None:
        self.normalize = _check_flag(normalize, "normalize")
        super().__init__(model_path, processor_path, device=device, dtype=dtype, batch_size=batch_size,
                         model_hint="yuvalkirstain/PickScore_v1 (processor: laion/CLIP-ViT-H-14-laion2B-s32B-b79K)")

    @torch.no_grad()
    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """``media [B, 3, H, W]`` in [0, 1] -> ``[B]`` float32 PickScore on ``media``'s device."""
        if check_inputs(media, prompts, metadata) == 0:
            return torch.empty(0, dtype=torch.float32, device=media.device)
        scores = self.model.logit_scale.float().exp() * self.cosine(media, prompts)
        if self.normalize:
            scores = scores / PICKSCORE_NORMALIZER
        return scores.to(media.device)


class ClipScore(_TransformersClip):
    """Text-image agreement of a CLIP model (e.g. ``openai/clip-vit-large-patch14``).

    ``formula``: ``"cosine"`` (default) ``cos(image, prompt)`` in [-1, 1]; ``"clipscore"`` Hessel et al. 2021's
    ``2.5 * max(cos, 0)``; ``"flow_grpo"`` flow_grpo's ``clip_scorer.py`` value ``logit_scale.exp() * cos / 30``.
    Other options as :class:`PickScore` (``processor_path`` defaults to ``model_path``, which for the openai
    checkpoints holds the processor files too).

    Raises:
        ValueError: a missing path, a bad option (the message lists the allowed formulas), a model that does not load.
    """

    name = "clip_score"

    def __init__(self, model_path: str | os.PathLike | None = None, processor_path: str | os.PathLike | None = None,
                 *, formula: str = "cosine", device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
                 batch_size: int = 32) -> None:
        if formula not in CLIP_SCORE_FORMULAS:
            raise ValueError(f"formula must be one of {list(CLIP_SCORE_FORMULAS)}, got {formula!r}")
        self.formula = formula
        super().__init__(model_path, processor_path, device=device, dtype=dtype, batch_size=batch_size,
                         model_hint="a transformers CLIPModel such as openai/clip-vit-large-patch14")

    @torch.no_grad()
    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """``media [B, 3, H, W]`` in [0, 1] -> ``[B]`` float32 score on ``media``'s device."""
        if check_inputs(media, prompts, metadata) == 0:
            return torch.empty(0, dtype=torch.float32, device=media.device)
        cosine = self.cosine(media, prompts)
        if self.formula == "clipscore":
            scores = CLIPSCORE_WEIGHT * cosine.clamp(min=0.0)
        elif self.formula == "flow_grpo":
            scores = self.model.logit_scale.float().exp() * cosine / FLOW_GRPO_CLIP_DIVISOR
        else:
            scores = cosine
        return scores.to(media.device)


class AestheticHead(nn.Module):
    """The LAION improved-aesthetic-predictor MLP. Parameter names (``layers.0``, ``layers.2``, ``layers.4``,
    ``layers.6``, ``layers.7``) match the released ``sac+logos+ava1-l14-linearMSE.pth`` state dict.

    ``[B, in_features]`` (L2-normalised CLIP image embeddings) -> ``[B, 1]`` predicted rating.
    """

    def __init__(self, in_features: int = 768) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(in_features, 1024), nn.Dropout(0.2),
            nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeddings: Tensor) -> Tensor:
        return self.layers(embeddings)


def load_aesthetic_head(head_path: str | os.PathLike, in_features: int) -> AestheticHead:
    """An eval-mode, frozen :class:`AestheticHead` from a ``.safetensors`` file or a torch ``state_dict`` file
    (loaded with ``weights_only=True``), on the CPU in float32.

    Raises:
        ValueError: not a file, unreadable, or its tensors do not fit a head with ``in_features`` inputs.
    """
    path = _local_file(head_path, "head_path", "the improved-aesthetic-predictor head (e.g. "
                       "sac+logos+ava1-l14-linearMSE.pth or a .safetensors export)")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path), device="cpu")
        else:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as error:  # safetensors / pickle raise their own error types for a corrupt file
        raise ValueError(f"could not read the aesthetic head {str(path)!r}: {error}") from error
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    head = AestheticHead(in_features)
    if not isinstance(state, dict):
        raise ValueError(f"{str(path)!r} does not hold a state dict, got {type(state).__name__}")
    try:
        head.load_state_dict(state, strict=True)
    except RuntimeError as error:
        raise ValueError(f"{str(path)!r} is not an aesthetic head for {in_features}-d CLIP embeddings "
                         f"(expected keys {sorted(head.state_dict())}): {error}") from error
    head.eval().requires_grad_(False)
    return head


class AestheticScorer(_TransformersClip):
    """LAION aesthetic score: the improved-aesthetic-predictor MLP on the L2-normalised CLIP image embedding
    (predicted 1..10 rating; the prompt is not used).

    Args:
        model_path: local directory of the CLIP model, ``openai/clip-vit-large-patch14`` for the released head.
        head_path: the head weights, ``.safetensors`` or a torch state-dict file (``sac+logos+ava1-l14-linearMSE.pth``).
        processor_path, device, dtype, batch_size: as :class:`PickScore`. The head runs in float32.

    Raises:
        ValueError: a missing path, a bad option, a head whose input size is not the CLIP projection dim.
    """

    name = "aesthetic"

    def __init__(self, model_path: str | os.PathLike | None = None, head_path: str | os.PathLike | None = None,
                 processor_path: str | os.PathLike | None = None, *, device: str | torch.device = "cpu",
                 dtype: str | torch.dtype = "float32", batch_size: int = 32) -> None:
        _local_file(head_path, "head_path", "the improved-aesthetic-predictor head")
        super().__init__(model_path, processor_path, device=device, dtype=dtype, batch_size=batch_size,
                         model_hint="openai/clip-vit-large-patch14")
        self.head = load_aesthetic_head(head_path, int(self.model.config.projection_dim)).to(self.device)

    @torch.no_grad()
    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """``media [B, 3, H, W]`` in [0, 1] -> ``[B]`` float32 predicted rating on ``media``'s device."""
        if check_inputs(media, prompts, metadata) == 0:
            return torch.empty(0, dtype=torch.float32, device=media.device)
        return self.head(self.image_embeddings(media)).squeeze(1).float().to(media.device)


# ------------------------------------------------------------------------------------------------ HPSv2 (open_clip)


def import_open_clip() -> Any:
    """Import ``open_clip`` for HPSv2.

    Raises:
        ImportError: open_clip is missing or fails to import (typically a torchvision built for another torch,
            which raises ``RuntimeError``); the message carries :data:`HPS_INSTALL_HINT` and the original error.
    """
    try:
        import open_clip
    except Exception as error:  # a mismatched torchvision raises RuntimeError / AttributeError, not ImportError
        raise ImportError(f"{HPS_INSTALL_HINT}. (import open_clip failed: {type(error).__name__}: {error})") from error
    return open_clip


class HPSv2Scorer:
    """HPSv2 (Wu et al. 2023): cosine of the normalised open_clip image and text features of the HPS-tuned
    ViT-H-14. Optional extra: ``pip install 'flowforge[hps]'`` (open-clip-torch, which needs torchvision).

    Args:
        checkpoint_path: local HPS checkpoint (``HPS_v2.1_compressed.pt`` / ``HPS_v2_compressed.pt`` from
            ``xswu/HPSv2``): a torch file with the model state under ``"state_dict"`` (or the bare state dict), read
            with ``weights_only=True``; a leading ``module.`` on the keys is dropped.
        model_name: the open_clip architecture, ``"ViT-H-14"`` for HPSv2 (built without pretrained weights: the
            checkpoint holds the whole model; the tokenizer is open_clip's bundled BPE, no download).
        device, dtype, batch_size: as :class:`PickScore`.

    The dependency is checked first, when the scorer is built: a missing or broken open_clip raises ``ImportError``
    with the install hint, never inside the training loop.

    Raises:
        ImportError: open_clip cannot be imported (see :func:`import_open_clip`).
        ValueError: a missing checkpoint, a bad option, a checkpoint that does not fit ``model_name``.
    """

    name = "hps"
    needs_group: ClassVar[bool] = False

    def __init__(self, checkpoint_path: str | os.PathLike | None = None, *, model_name: str = "ViT-H-14",
                 device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
                 batch_size: int = 32) -> None:
        open_clip = import_open_clip()
        self.batch_size = _check_batch_size(batch_size)
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        checkpoint = _local_file(checkpoint_path, "checkpoint_path", "an HPSv2 checkpoint such as "
                                 "HPS_v2.1_compressed.pt (huggingface xswu/HPSv2)")
        if not isinstance(model_name, str) or not model_name:
            raise ValueError(f"model_name must be an open_clip architecture name like 'ViT-H-14', got {model_name!r}")
        self.model_name = model_name

        def load() -> nn.Module:
            model = open_clip.create_model(model_name, pretrained=None, precision="fp32", device="cpu")
            try:
                state = torch.load(str(checkpoint), map_location="cpu", weights_only=True)
            except Exception as error:  # pickle / zip errors of a corrupt or non-weights file
                raise ValueError(f"could not read the HPS checkpoint {str(checkpoint)!r}: {error}") from error
            if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
                state = state["state_dict"]
            if not isinstance(state, dict):
                raise ValueError(f"{str(checkpoint)!r} does not hold a state dict, got {type(state).__name__}")
            state = {key.removeprefix("module."): value for key, value in state.items()}
            try:
                model.load_state_dict(state, strict=True)
            except RuntimeError as error:
                raise ValueError(f"{str(checkpoint)!r} does not fit open_clip {model_name!r}: {error}") from error
            model = model.to(device=self.device, dtype=self.dtype).eval()
            model.requires_grad_(False)
            return model

        self.model = _cached(("open_clip." + model_name, str(checkpoint), str(self.device), self.dtype), load)
        self.tokenizer = open_clip.get_tokenizer(model_name)
        self.preprocess = self._preprocess_of(self.model)

    @staticmethod
    def _preprocess_of(model: nn.Module) -> ImagePreprocess:
        """open_clip's eval transform (resize shortest side, center crop, normalise) as :class:`ImagePreprocess`."""
        visual = model.visual
        cfg = getattr(visual, "preprocess_cfg", {}) or {}
        size = cfg.get("size", getattr(visual, "image_size", 224))
        height, width = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
        mean = cfg.get("mean", getattr(visual, "image_mean", None)) or (0.48145466, 0.4578275, 0.40821073)
        std = cfg.get("std", getattr(visual, "image_std", None)) or (0.26862954, 0.26130258, 0.27577711)
        mode = cfg.get("interpolation", "bicubic")
        if mode not in ("bicubic", "bilinear"):
            raise ValueError(f"open_clip preprocessing interpolation {mode!r} is not supported (bicubic, bilinear)")
        resize_mode = cfg.get("resize_mode", "shortest")
        mean, std = tuple(float(v) for v in mean), tuple(float(v) for v in std)
        if resize_mode == "squash":
            return ImagePreprocess(None, (height, width), None, mean, std, mode)
        if resize_mode != "shortest":
            raise ValueError(f"open_clip resize_mode {resize_mode!r} is not supported (shortest, squash)")
        shortest = height if height == width else None
        return ImagePreprocess(shortest, None if shortest else (height, width), (height, width), mean, std, mode)

    @torch.no_grad()
    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """``media [B, 3, H, W]`` in [0, 1] -> ``[B]`` float32 HPSv2 score (a cosine, ~0.2..0.35) on ``media``'s device.
        Prompts are truncated by open_clip's tokenizer to its context length (77)."""
        batch = check_inputs(media, prompts, metadata)
        if batch == 0:
            return torch.empty(0, dtype=torch.float32, device=media.device)
        scores = []
        for start in range(0, batch, self.batch_size):
            pixels = self.preprocess(media[start : start + self.batch_size].detach().to(self.device)).to(self.dtype)
            tokens = self.tokenizer(list(prompts[start : start + self.batch_size])).to(self.device)
            image = F.normalize(self.model.encode_image(pixels).float(), dim=-1)
            text = F.normalize(self.model.encode_text(tokens).float(), dim=-1)
            scores.append((image * text).sum(dim=-1))
        return torch.cat(scores).to(media.device)


__all__ = [
    "AestheticHead",
    "AestheticScorer",
    "ClipProcessor",
    "ClipScore",
    "HPSv2Scorer",
    "ImagePreprocess",
    "PickScore",
    "clear_model_cache",
    "import_open_clip",
    "load_aesthetic_head",
    "load_clip_model",
    "load_clip_processor",
    "resolve_device",
    "resolve_dtype",
]
