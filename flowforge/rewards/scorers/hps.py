"""HPSv2: the Human Preference Score v2 model, an open_clip ViT-H-14 fine-tuned on HPD v2 (optional dependency).

    r = cos(g_I(x), g_T(p))                 no logit scale; about 0.2..0.35

``g`` is open_clip ``encode_image`` / ``encode_text``, L2-normalised; ``x``, ``p`` and the torch preprocessing as in
:mod:`flowforge.rewards.scorers.clip_common` (with open_clip's eval-transform settings).

Source: Wu et al., "Human Preference Score v2", arXiv:2306.09341; ``tgxs002/HPSv2`` ``score.py`` and flow_grpo's
``flow_grpo/hpsv2_scorer.py`` (``diag(image_features @ text_features.T)`` of the normalised open_clip features,
ViT-H-14, checkpoint ``HPS_v2.1_compressed.pt``).

open_clip is imported when the scorer is built, not when this module is imported.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flowforge.rewards.base import check_batch_size, check_inputs
from flowforge.rewards.scorers.clip_common import (
    ImagePreprocess,
    load_cached,
    local_file,
    resolve_device,
    resolve_dtype,
)

HPS_INSTALL_HINT = (
    "the 'hps' reward needs open_clip: pip install 'flowforge[hps]' (installs open-clip-torch). open-clip-torch "
    "imports torchvision, which must be the build made for this torch (torch==2.13.0): install torchvision from the "
    "same index as torch (e.g. --index-url https://download.pytorch.org/whl/cpu for the CPU wheel); a torchvision "
    "built for another torch fails at import. The rest of flowforge never imports torchvision"
)


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
        device, dtype, batch_size: as :class:`~flowforge.rewards.scorers.pickscore.PickScore`.

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
        self.batch_size = check_batch_size(batch_size)
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        checkpoint = local_file(checkpoint_path, "checkpoint_path", "an HPSv2 checkpoint such as "
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

        self.model = load_cached(("open_clip." + model_name, str(checkpoint), str(self.device), self.dtype), load)
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
        Prompts are truncated by open_clip's tokenizer to its context length (77); with a tokenizer that exposes
        ``encode`` and ``context_length`` (open_clip's BPE tokenizer) the truncated ones are flagged in
        ``sample_flags["truncated"]`` (``reward/hps_truncated_fraction``)."""
        batch = check_inputs(media, prompts, metadata)
        encode, context = getattr(self.tokenizer, "encode", None), getattr(self.tokenizer, "context_length", None)
        if callable(encode) and isinstance(context, int):
            # the tokenizer adds start and end tokens around encode()'s ids, then cuts at the context length
            self.sample_flags = {"truncated": torch.tensor([len(encode(p)) + 2 > context for p in prompts],
                                                           dtype=torch.bool)}
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
