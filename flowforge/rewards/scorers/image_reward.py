"""ImageReward: a BLIP image-grounded text encoder with an MLP head, trained on 137k expert text-to-image rankings.

    h  = BERT_x(tokens(p))[CLS]            the text encoder cross-attending to the ViT's tokens of the image x
    r  = (MLP(h) - mu) / sigma             mu = 0.16717362830052426, sigma = 1.0333394966054072 (published)

=========  ========================================================================================
``x``      one image of the batch, ``[3, H, W]`` in [0, 1]: shortest side resized to 224 (bicubic, antialiased),
           center crop 224 x 224 at torchvision's offset ``int(round((H - 224) / 2))``, CLIP mean / std
``p``      its prompt, tokenised by bert-base-uncased (+ BLIP's ``[DEC]`` / ``[ENC]`` specials) with
           ``padding="max_length", truncation=True, max_length=35``: ``[CLS] ... [SEP] [PAD]...``, 35 ids
``ViT``    BLIP's ViT-L/16 (24 blocks, width 1024, LayerNorm eps 1e-6): transformers ``BlipVisionModel``
``BERT_x`` BLIP's ``med`` BERT with cross-attention in every layer (``med_config.json``, encoder width 1024), in
           encoder mode (bidirectional self-attention): transformers ``BlipTextModel``
``MLP``    Linear 768->1024->128->64->16->1, no activations (dropouts only, off in eval), run in float32
=========  ========================================================================================

Source: Xu et al., "ImageReward: Learning and Evaluating Human Preferences for Text-to-Image Generation", NeurIPS
2023, arXiv:2304.05977; github THUDM/ImageReward (pip ``image-reward`` 1.5): ``ImageReward/ImageReward.py``
(``score``, ``_transform``, ``MLP``, the mean / std) and ``ImageReward/models/BLIP`` (``vit.py``, ``med.py``,
``blip.py``'s ``init_tokenizer``). Weights: huggingface ``THUDM/ImageReward`` (``ImageReward.pt`` + ``med_config.json``;
the tokenizer is ``bert-base-uncased``). The checkpoint's official keys (``blip.visual_encoder.*``,
``blip.text_encoder.*``, ``mlp.layers.*``) are renamed onto the transformers modules by :func:`transformers_state`;
the ViT's size is read from the checkpoint's shapes (heads of width 64, as BLIP's ViT-B and ViT-L).

Differences from the official path: pixels are resized in torch (``F.interpolate(bicubic, antialias=True)``, no PIL
round trip; see :mod:`~flowforge.rewards.scorers.clip_common`): equal to it when no resize is needed, within about
one grey level otherwise. Test: ``tests/rewards/scorers/test_image_reward.py`` against scores the official code
computed on the same tiny random weights (``data/image_reward_official.json``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flowforge.rewards.base import check_batch_size, check_inputs
from flowforge.rewards.scorers.clip_common import (
    ImagePreprocess,
    load_cached,
    local_dir,
    resolve_device,
    resolve_dtype,
)

IMAGE_REWARD_MEAN = 0.16717362830052426
IMAGE_REWARD_STD = 1.0333394966054072
"""The published normalisation of ImageReward's raw MLP output (``ImageReward.__init__``)."""

TEXT_LENGTH = 35
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
VIT_HEAD_WIDTH = 64
HEAD_SIZES = (1024, 128, 64, 16, 1)

_VISION_RENAMES = [  # official BLIP ViT (timm layout) -> transformers BlipVisionModel
    (r"^cls_token$", "embeddings.class_embedding"),
    (r"^pos_embed$", "embeddings.position_embedding"),
    (r"^patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
    (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
    (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"^blocks\.(\d+)\.mlp\.", r"encoder.layers.\1.mlp."),
    (r"^norm\.", "post_layernorm."),
]


def transformers_state(official: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename an official ImageReward state dict onto :class:`ImageRewardModel`: ``blip.visual_encoder.*`` ->
    ``vision.*`` (timm names -> ``BlipVisionModel``), ``blip.text_encoder.*`` -> ``text.*`` (same names),
    ``mlp.layers.*`` -> ``head.*``. Other keys (BLIP's unused ``vision_proj`` / ``text_proj``, buffers) are dropped."""
    state = {}
    for key, value in official.items():
        if key.startswith("blip.visual_encoder."):
            name = key.removeprefix("blip.visual_encoder.")
            for pattern, replacement in _VISION_RENAMES:
                name, hits = re.subn(pattern, replacement, name)
                if hits:
                    break
            state["vision." + name] = value
        elif key.startswith("blip.text_encoder.") and not key.endswith("position_ids"):
            state["text." + key.removeprefix("blip.text_encoder.")] = value
        elif key.startswith("mlp.layers."):
            state["head." + key.removeprefix("mlp.layers.")] = value
    return state


class ImageRewardModel(nn.Module):
    """ViT + cross-attending BERT + MLP head (module docstring); ``forward`` gives the raw MLP output.

    Args:
        official: the official state dict (read for the ViT's size; the weights are loaded by the caller).
        med_config: BLIP's ``med_config.json`` as a dict (BERT size, vocabulary, LayerNorm eps).

    Raises:
        ValueError: the state dict lacks the ViT keys or ``med_config`` a BERT size.
    """

    def __init__(self, official: dict[str, Tensor], med_config: dict[str, Any]) -> None:
        super().__init__()
        from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

        try:
            width = int(official["blip.visual_encoder.cls_token"].shape[-1])
            patch = int(official["blip.visual_encoder.patch_embed.proj.weight"].shape[-1])
            positions = int(official["blip.visual_encoder.pos_embed"].shape[1])
            intermediate = int(official["blip.visual_encoder.blocks.0.mlp.fc1.weight"].shape[0])
        except KeyError as error:
            raise ValueError(f"not an ImageReward checkpoint: no {error.args[0]!r}") from error
        depth = len({k.split(".")[3] for k in official if k.startswith("blip.visual_encoder.blocks.")})
        grid = round((positions - 1) ** 0.5)
        vision = BlipVisionConfig(hidden_size=width, intermediate_size=intermediate, num_hidden_layers=depth,
                                  num_attention_heads=max(width // VIT_HEAD_WIDTH, 1), image_size=grid * patch,
                                  patch_size=patch, hidden_act="gelu", layer_norm_eps=1e-6, attention_dropout=0.0)
        try:
            text = BlipTextConfig(
                vocab_size=med_config["vocab_size"], hidden_size=med_config["hidden_size"],
                encoder_hidden_size=width, intermediate_size=med_config["intermediate_size"],
                num_hidden_layers=med_config["num_hidden_layers"],
                num_attention_heads=med_config["num_attention_heads"],
                max_position_embeddings=med_config["max_position_embeddings"],
                hidden_act=med_config.get("hidden_act", "gelu"), layer_norm_eps=med_config.get("layer_norm_eps", 1e-12),
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                pad_token_id=med_config.get("pad_token_id", 0), bos_token_id=None, eos_token_id=None, sep_token_id=None,
                # builds the cross-attention layers; forward runs with is_decoder=False (bidirectional self-attention)
                is_decoder=True,
            )
        except KeyError as error:
            raise ValueError(f"med_config.json lacks {error.args[0]!r}") from error
        self.vision = BlipVisionModel(vision)
        self.text = BlipTextModel(text, add_pooling_layer=False)
        sizes = (text.hidden_size, *HEAD_SIZES)
        layers: list[nn.Module] = []
        for index, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(fan_in, fan_out))
            if index < 3:  # the official Sequential's Dropout slots (indices 1, 3, 5), so checkpoint indices match
                layers.append(nn.Identity())
        self.head = nn.Sequential(*layers)
        self.image_size = vision.image_size

    def forward(self, pixels: Tensor, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """``pixels [B, 3, S, S]`` normalised, ``input_ids`` / ``attention_mask [B, 35]`` int64 -> ``[B]`` float32
        raw MLP output (before the published mean / std)."""
        image = self.vision(pixel_values=pixels).last_hidden_state
        image_mask = torch.ones(image.shape[:-1], dtype=torch.long, device=image.device)
        hidden = self.text(input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image,
                           encoder_attention_mask=image_mask).last_hidden_state
        return self.head(hidden[:, 0].float()).squeeze(-1)


def load_image_reward(model_dir: str, device: torch.device, dtype: torch.dtype) -> ImageRewardModel:
    """The frozen eval-mode :class:`ImageRewardModel` from ``model_dir/ImageReward.pt`` + ``med_config.json``; the
    head stays float32 whatever ``dtype``.

    Raises:
        ValueError: a missing / unreadable file, or a checkpoint whose weights do not fit the model.
    """
    checkpoint, config_path = os.path.join(model_dir, "ImageReward.pt"), os.path.join(model_dir, "med_config.json")
    for path in (checkpoint, config_path):
        if not os.path.isfile(path):
            raise ValueError(f"model_path={model_dir!r} has no {os.path.basename(path)} "
                             "(huggingface THUDM/ImageReward)")
    try:
        official = torch.load(checkpoint, map_location="cpu", weights_only=True)
        with open(config_path) as handle:
            med_config = json.load(handle)
    except Exception as error:  # pickle / zip / JSON errors of a corrupt file
        raise ValueError(f"could not read the ImageReward files in {model_dir!r}: {error}") from error
    if not isinstance(official, dict):
        raise ValueError(f"{checkpoint!r} does not hold a state dict, got {type(official).__name__}")
    model = ImageRewardModel(official, med_config)
    missing, unexpected = model.load_state_dict(transformers_state(official), strict=False)
    missing = [key for key in missing if not key.endswith("position_ids")]
    if missing or unexpected:
        raise ValueError(f"{checkpoint!r} does not fit ImageReward: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model = model.eval().requires_grad_(False)
    model.vision.to(device=device, dtype=dtype)
    model.text.to(device=device, dtype=dtype)
    model.head.to(device=device, dtype=torch.float32)
    return model


class ImageRewardScorer:
    """ImageReward (Xu et al. 2023): the normalised BLIP reward of each image for its prompt, about N(0, 1) over the
    paper's generations (higher is better).

    Args:
        model_path: local directory of huggingface ``THUDM/ImageReward`` (``ImageReward.pt``, ``med_config.json``).
        tokenizer_path: local directory of ``bert-base-uncased``'s tokenizer (``vocab.txt``); None = ``model_path``.
        normalize: apply the published ``(r - mean) / std`` (the official ``score``); False gives the raw MLP output.
        device, dtype, batch_size: as :class:`~flowforge.rewards.scorers.pickscore.PickScore`.

    Raises:
        ValueError: a missing path or file, a bad option, a stub tokenizer, or files that do not fit together.
    """

    name = "image_reward"
    needs_group: ClassVar[bool] = False

    def __init__(self, model_path: str | os.PathLike | None = None,
                 tokenizer_path: str | os.PathLike | None = None, *, normalize: bool = True,
                 device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
                 batch_size: int = 16) -> None:
        if not isinstance(normalize, bool):
            raise ValueError(f"normalize must be True or False, got {normalize!r}")
        self.normalize = normalize
        self.batch_size = check_batch_size(batch_size)
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        model_dir = str(local_dir(model_path, "model_path", "THUDM/ImageReward (ImageReward.pt, med_config.json)"))
        tokenizer_dir = str(local_dir(tokenizer_path if tokenizer_path is not None else model_path, "tokenizer_path",
                                      "the bert-base-uncased tokenizer (vocab.txt)"))
        self.model = load_cached(("ImageReward", model_dir, str(self.device), self.dtype),
                                 lambda: load_image_reward(model_dir, self.device, self.dtype))
        self.tokenizer = load_cached(("ImageReward.tokenizer", tokenizer_dir), lambda: _load_tokenizer(tokenizer_dir))
        if len(self.tokenizer) > self.model.text.config.vocab_size:
            raise ValueError(f"the tokenizer has {len(self.tokenizer)} tokens but the text encoder only "
                             f"{self.model.text.config.vocab_size}: tokenizer_path and model_path do not belong "
                             "together")
        size = self.model.image_size
        self.preprocess = ImagePreprocess(size, None, (size, size), CLIP_MEAN, CLIP_STD, "bicubic", crop_offset="round")

    @torch.no_grad()
    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """``media [B, 3, H, W]`` in [0, 1] -> ``[B]`` float32 ImageReward on ``media``'s device. Prompts longer than
        35 tokens (specials included) are cut, as the official code does, and flagged in ``sample_flags["truncated"]``
        (``reward/image_reward_truncated_fraction``)."""
        batch = check_inputs(media, prompts, metadata)
        lengths = [len(ids) for ids in self.tokenizer(list(prompts), truncation=False)["input_ids"]] if batch else []
        self.sample_flags = {"truncated": torch.tensor([n > TEXT_LENGTH for n in lengths], dtype=torch.bool)}
        if batch == 0:
            return torch.empty(0, dtype=torch.float32, device=media.device)
        scores = []
        for start in range(0, batch, self.batch_size):
            pixels = self.preprocess(media[start : start + self.batch_size].detach().to(self.device)).to(self.dtype)
            tokens = self.tokenizer(list(prompts[start : start + self.batch_size]), padding="max_length",
                                    truncation=True, max_length=TEXT_LENGTH, return_tensors="pt")
            scores.append(self.model(pixels, tokens["input_ids"].to(self.device),
                                     tokens["attention_mask"].to(self.device)))
        raw = torch.cat(scores)
        if self.normalize:
            raw = (raw - IMAGE_REWARD_MEAN) / IMAGE_REWARD_STD
        return raw.to(media.device)


def _load_tokenizer(tokenizer_dir: str) -> Any:
    """bert-base-uncased + BLIP's specials (``[DEC]`` as bos, ``[ENC]``), as the official ``init_tokenizer``."""
    from transformers import BertTokenizer

    try:
        tokenizer = BertTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ValueError(f"could not load a BERT tokenizer from {tokenizer_dir!r}: {error}") from error
    if len(tokenizer) < 10:
        raise ValueError(f"the tokenizer in {tokenizer_dir!r} has only {len(tokenizer)} tokens (a stub); point "
                         "tokenizer_path at bert-base-uncased's files")
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tokenizer
