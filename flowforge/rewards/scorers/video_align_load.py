"""VideoAlign's reward model (:class:`VideoAlignModel`) and its loading from a VideoAlign checkpoint directory.

A checkpoint directory (huggingface ``KwaiVGI/VideoReward``) holds ``model_config.json`` (the training run's
``data_config``, ``model_config``, ``peft_lora_config`` and ``inference_config`` with ``VQ_mean`` ... ``TA_std``) and
``checkpoint-<step>/`` folders with either ``model.pth`` (the whole ``Qwen2VLRewardModelBT`` state dict, transformers
4.45 key layout) or a LoRA adapter (``adapter_model.safetensors``) plus ``non_lora_state_dict.pth`` (the trained
non-LoRA parameters: vision tower, merger, embeddings, ``rm_head``) on the base Qwen2-VL's weights. LoRA deltas are
merged into the weights on load (``W + alpha / r * B @ A``; ``alpha / sqrt(r)`` with rsLoRA), which is what PEFT's
unmerged forward computes, up to rounding.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch
from torch import Tensor, nn

from flowforge.rewards.scorers.hpsv3 import build_qwen2vl_in_dtype, check_chat_tokenizer, qwen2vl_hidden

DIMENSIONS = ("VQ", "MQ", "TA")
SPECIAL_TOKENS = ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")
"""Added to the base tokenizer in this order (their ids follow its vocabulary), one per reward dimension."""
_RENAMES = (  # official (4.45 or 5.x layout) -> VideoAlignModel; anything else (lm_head) is dropped
    ("model.language_model.", "backbone.language_model."), ("model.visual.", "backbone.visual."),
    ("model.", "backbone.language_model."), ("visual.", "backbone.visual."), ("rm_head.", "head."),
)


class VideoAlignModel(nn.Module):
    """Qwen2-VL backbone + VideoAlign's bias-free linear reward head; ``forward`` gives ``[B, 3]`` (VQ, MQ, TA) at
    the three reward tokens, in the model's dtype."""

    def __init__(self, config: Any, output_dim: int, reward_token_ids: list[int]) -> None:
        super().__init__()
        from transformers import Qwen2VLModel

        self.backbone = Qwen2VLModel(config)
        self.head = nn.Linear(config.text_config.hidden_size, output_dim, bias=False)
        self.reward_token_ids = reward_token_ids
        self.video_token_id = config.video_token_id

    def forward(self, input_ids: Tensor, attention_mask: Tensor, pixel_values: Tensor, grid_thw: Tensor) -> Tensor:
        """``input_ids`` / ``attention_mask [B, S]`` (right-padded, each reward token once per row, in VQ, MQ, TA
        order), ``pixel_values [N, 1176]``, ``grid_thw [B, 3]`` -> ``[B, 3]``.

        Raises:
            ValueError: a row without exactly one of each reward token (a prompt containing one?).
        """
        hidden = qwen2vl_hidden(self.backbone, input_ids, attention_mask, pixel_values, grid_thw, self.video_token_id)
        slots = torch.zeros_like(input_ids, dtype=torch.bool)
        for token_id in self.reward_token_ids:
            if not bool(((input_ids == token_id).sum(dim=1) == 1).all()):
                raise ValueError(f"each row must hold each of {', '.join(SPECIAL_TOKENS)} exactly once")
            slots |= input_ids == token_id
        rewards = self.head(hidden[slots]).view(input_ids.shape[0], len(DIMENSIONS), -1)  # in sequence order
        return rewards[..., 0] if rewards.shape[-1] == 1 else rewards.diagonal(dim1=1, dim2=2)


def rename(official: dict[str, Tensor]) -> dict[str, Tensor]:
    """An official (or PEFT-wrapped: ``base_model.model.``, ``.base_layer.``, ``.modules_to_save.default.``) state
    dict renamed onto :class:`VideoAlignModel`; LoRA keys keep their ``.lora_*`` suffix, ``lm_head`` is dropped."""
    state = {}
    for key, value in official.items():
        if ".original_module." in key:
            continue
        key = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        key = key.replace(".modules_to_save.default.", ".")
        for old, new in _RENAMES:
            if key.startswith(old):
                state[new + key.removeprefix(old)] = value
                break
    return state


def merge_lora(state: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
    """``state`` with its ``X.lora_A.weight`` / ``X.lora_B.weight`` (Linear) and ``X.lora_embedding_A`` / ``_B``
    (Embedding) pairs folded into ``X.weight`` (in float32, cast back).

    Raises:
        ValueError: a LoRA pair whose base weight is missing.
    """
    merged = {key: value for key, value in state.items() if ".lora_" not in key}
    for key in [k for k in state if k.endswith(".lora_A.weight") or k.endswith(".lora_embedding_A")]:
        embedding = key.endswith(".lora_embedding_A")
        module = key.removesuffix(".lora_embedding_A" if embedding else ".lora_A.weight")
        down, up = state[key].float(), state[key.replace("_A", "_B")].float()
        base = merged.get(module + ".weight")
        if base is None:
            raise ValueError(f"LoRA weights for {module!r} but no base weight")
        delta = (up @ down).T if embedding else up @ down
        merged[module + ".weight"] = (base.float() + scale * delta).to(base.dtype)
    return merged


def checkpoint_dir(model_dir: str, step: int | None) -> str:
    """``model_dir/checkpoint-<step>``, the latest when ``step`` is None.

    Raises:
        ValueError: no checkpoint folders, or no folder for ``step`` (the message lists the steps there).
    """
    steps = sorted(int(path.rsplit("-", 1)[1]) for path in glob.glob(os.path.join(model_dir, "checkpoint-*"))
                   if path.rsplit("-", 1)[1].isdigit())
    if not steps:
        raise ValueError(f"model_path={model_dir!r} has no checkpoint-<step> folder (huggingface KwaiVGI/VideoReward)")
    if step is not None and step not in steps:
        raise ValueError(f"checkpoint_step={step} is not in {model_dir!r}; allowed: {steps}")
    return os.path.join(model_dir, f"checkpoint-{steps[-1] if step is None else step}")


def _settings(config: dict[str, Any], path: str) -> dict[str, Any]:
    """The scoring settings of a model_config.json; raises ValueError for a run this scorer does not reproduce."""
    data, model = config.get("data_config", {}), config.get("model_config", {})
    facts = {"data_config.prompt_template_type": (data.get("prompt_template_type"), "detailed_special"),
             "data_config.sample_type": (data.get("sample_type", "uniform"), "uniform"),
             "model_config.reward_token": (model.get("reward_token"), "special"),
             "model_config.use_special_tokens": (model.get("use_special_tokens"), True)}
    for field, (value, expected) in facts.items():
        if value != expected:
            raise ValueError(f"{path}: {field} is {value!r}; the video_align scorer supports only {expected!r}")
    if model.get("output_dim", 1) not in (1, 3):
        raise ValueError(f"{path}: model_config.output_dim must be 1 or 3, got {model.get('output_dim')!r}")
    norm = config.get("inference_config") or {}  # without it the official rewards are not normalised
    return {"fps": float(data.get("fps") or 2.0), "num_frames": data.get("num_frames"),
            "max_frame_pixels": int(data.get("max_frame_pixels") or 240 * 320),
            "output_dim": model.get("output_dim", 1),
            "norm": {k: (float(norm.get(f"{k}_mean", 0.0)), float(norm.get(f"{k}_std", 1.0))) for k in DIMENSIONS}}


def _state(model_dir: str, base_dir: str, step: int | None, config: dict[str, Any]) -> dict[str, Tensor]:
    """The renamed, LoRA-merged state dict of the chosen checkpoint."""
    from safetensors.torch import load_file

    folder = checkpoint_dir(model_dir, step)
    full = os.path.join(folder, "model.pth")
    if os.path.isfile(full):
        return rename(torch.load(full, map_location="cpu", weights_only=True))
    adapter = os.path.join(folder, "adapter_model.safetensors")
    non_lora = os.path.join(folder, "non_lora_state_dict.pth")
    if not (os.path.isfile(adapter) and os.path.isfile(non_lora)):
        raise ValueError(f"{folder!r} has neither model.pth nor adapter_model.safetensors + non_lora_state_dict.pth")
    base_files = sorted(glob.glob(os.path.join(base_dir, "*.safetensors")))
    if not base_files:
        raise ValueError(f"base_path={base_dir!r} has no *.safetensors weights (a LoRA checkpoint needs them)")
    state = {}
    for path in base_files:  # the official order: base, then non-LoRA, then the adapter file
        state.update(rename(load_file(path, device="cpu")))
    state.update(rename(torch.load(non_lora, map_location="cpu", weights_only=True)))
    state.update(rename(load_file(adapter, device="cpu")))
    lora = config.get("peft_lora_config", {})
    rank, alpha = int(lora.get("lora_r", 16)), float(lora.get("lora_alpha", 32))
    return merge_lora(state, alpha / rank**0.5 if lora.get("use_rslora") else alpha / rank)


def load_video_align(model_dir: str, base_dir: str, step: int | None, device: torch.device,
                     dtype: torch.dtype) -> _Loaded:
    """The frozen eval-mode :class:`VideoAlignModel` (built on ``device`` in ``dtype``), the base tokenizer with the
    three reward tokens and the base's chat template, and the checkpoint's scoring settings (``fps``,
    ``num_frames``, ``max_frame_pixels``, ``norm``: ``{dim: (mean, std)}``).

    Raises:
        ValueError: missing / unreadable files, a stub tokenizer, an unsupported run, or weights that do not fit.
    """
    from transformers import AutoTokenizer, Qwen2VLConfig

    config_path = os.path.join(model_dir, "model_config.json")
    try:
        with open(config_path) as handle:
            run = json.load(handle)
        config = Qwen2VLConfig.from_pretrained(base_dir, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(base_dir, local_files_only=True, padding_side="right")
        settings = _settings(run, config_path)
        state = _state(model_dir, base_dir, step, run)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"could not read VideoAlign from {model_dir!r} / base {base_dir!r}: {error}") from error
    check_chat_tokenizer(tokenizer, base_dir, "Qwen2-VL-2B-Instruct")
    tokenizer.add_tokens(list(SPECIAL_TOKENS), special_tokens=True)
    embed = state.get("backbone.language_model.embed_tokens.weight")
    if embed is None or embed.shape[0] != len(tokenizer):
        raise ValueError(f"the checkpoint in {model_dir!r} does not fit the base tokenizer plus the reward tokens "
                         f"({len(tokenizer)} tokens)")
    # VideoAlign resized the embeddings to the base tokenizer plus its reward tokens
    model = build_qwen2vl_in_dtype(config, int(embed.shape[0]), device, dtype, lambda: VideoAlignModel(
        config, settings["output_dim"], tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"the checkpoint in {model_dir!r} does not fit VideoAlign: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return _Loaded(model.eval().requires_grad_(False), tokenizer, settings)


class _Loaded:
    """The model, its tokenizer and the checkpoint's scoring settings as one weakly cacheable value."""

    def __init__(self, model: VideoAlignModel, tokenizer: Any, settings: dict[str, Any]) -> None:
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
