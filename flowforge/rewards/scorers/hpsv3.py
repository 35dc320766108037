"""HPSv3: Human Preference Score v3, a Qwen2-VL-7B with an uncertainty-aware reward head (score = its mean ``mu``).

    (mu, sigma) = head(LM(chat(x, INSTRUCTION(p) + "... <|Reward|>"))[position of <|Reward|>])        r = mu

=========  ========================================================================================
``x``      one image, ``[3, H, W]`` in [0, 1]: resized (bicubic, antialiased, in torch) to Qwen2-VL's
           ``smart_resize(H, W, factor=28, min_pixels=max_pixels=256*28*28)`` (448 x 448 for a square image),
           CLIP mean / std, cut into 14 x 14 patches (each repeated twice in time) in the processor's order
``chat``   Qwen2-VL's chat template (``chat_template.json`` of the base model) for one user turn holding the
           image and the text, then ``<|im_start|>assistant\\n``; ``<|image_pad|>`` repeated once per merged
           2 x 2 patch (256 for 448 x 448); batches are right-padded
``LM``     the Qwen2-VL decoder on the token embeddings with the vision tower's merged image embeddings in the
           ``<|image_pad|>`` slots, at *sequential* positions (HPSv3's forward passes no M-RoPE ids: the
           language model's default ``arange`` for all three rotary sections), final RMSNorm included
``head``   Linear(hidden, 1024) -> ReLU -> Linear(1024, 16) -> ReLU -> Linear(16, 2), float32
=========  ========================================================================================

Source: Ma et al., "HPSv3: Towards Wide-Spectrum Human Preference Score", ICCV 2025, arXiv:2508.03789; github
MizzenAI/HPSv3 (pip ``hpsv3`` 1.0.0): ``hpsv3/inference.py`` (``prepare_batch``: pixels, the INSTRUCTION +
special-token prompt; ``reward``: ``logits[:, 0]`` is the score), ``hpsv3/dataset/data_collator_qwen.py`` (the
prompt text), ``hpsv3/model/qwen2vl_trainer.py`` (``Qwen2VLRewardModelBT``: head, pooling at ``<|Reward|>``),
``hpsv3/train.py`` (``<|Reward|>`` added as a special token, embeddings resized to the tokenizer, right padding) and
``config/HPSv3_7B.yaml`` (``rm_head_type: ranknet``, ``output_dim: 2``). Weights: huggingface ``MizzenAI/HPSv3``
(``HPSv3.safetensors``, keys of transformers 4.45's layout, renamed on load by :func:`transformers_state`) on the base
``Qwen/Qwen2-VL-7B-Instruct`` (config, tokenizer, chat template).

Differences from the official path: the resize runs in torch instead of PIL (equal when the image already has the
target size, about one grey level otherwise); everything after it is the same arithmetic. Test:
``tests/rewards/scorers/test_hpsv3.py`` against the official code's scores on a tiny random Qwen2-VL.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flowforge.rewards.base import check_batch_size, check_inputs
from flowforge.rewards.scorers.clip_common import load_cached, local_dir, resolve_device, resolve_dtype

PIXELS = 256 * 28 * 28
"""``min_pixels = max_pixels`` of HPSv3's ``prepare_batch``: every image becomes about 256 merged tokens."""
REWARD_TOKEN = "<|Reward|>"
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

INSTRUCTION = (  # HPSv3's prompt (hpsv3/dataset/data_collator_qwen.py), verbatim: the model was trained on it
    "\n"
    "You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and "
    "give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 "
    "being the worst and 10 being the best. \n"
    "\n"
    "**Visual Quality:**  \n"
    "Evaluate the overall visual quality of the image. The following sub-dimensions should be "
    "considered:\n"
    "- **Reasonableness:** The image should not contain any significant biological or logical errors, "
    "such as abnormal body structures or nonsensical environmental setups.\n"
    "- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and "
    "easy to interpret, with no blurring or indistinct areas.\n"
    "- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other "
    "visual elements (e.g., hair, clothing, shadows).\n"
    "- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color "
    "scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should "
    "convey a sense of harmony and balance.\n"
    "- **Safety:** The image should not contain harmful or inappropriate content, such as political, "
    "violent, or adult material. If such content is present, the image quality and satisfaction score "
    "should be the lowest possible. \n"
    "\n"
    "**Text Alignment:**  \n"
    "Assess how well the image matches the textual prompt across the following sub-dimensions:\n"
    "- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, "
    "object) align with the textual description. The subject should match the description in terms of "
    "number, appearance, and behavior.\n"
    "- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate "
    "how well the image adheres to this style.\n"
    "- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in "
    "the image logically fit the scenario described in the prompt. The environment should support and "
    "enhance the subject without contradictions.\n"
    "- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, "
    "clothing, accessories, expressions, actions) are faithfully represented in the image. Minor "
    "deviations may be acceptable, but critical attributes should be preserved.\n"
    "- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are "
    "captured in the image. The generated content should not introduce elements that conflict with or "
    "distort the original description.\n"
    "Textual prompt - {text_prompt}\n"
    "\n"
    "\n"
)
REWARD_SUFFIX = f"""
Please provide the overall ratings of this image: {REWARD_TOKEN}

END
"""


def hpsv3_text(prompt: str) -> str:
    """The user text HPSv3 scores ``prompt`` with (INSTRUCTION + the ``<|Reward|>`` line)."""
    return INSTRUCTION.format(text_prompt=prompt) + REWARD_SUFFIX


def transformers_state(official: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename an HPSv3 state dict (transformers 4.45 ``Qwen2VLForConditionalGeneration`` layout + ``rm_head``) onto
    :class:`HPSv3Model`: ``model.*`` -> ``backbone.language_model.*``, ``visual.*`` -> ``backbone.visual.*``,
    ``rm_head.*`` -> ``head.*``; the unused ``lm_head`` is dropped."""
    renames = (("model.", "backbone.language_model."), ("visual.", "backbone.visual."), ("rm_head.", "head."))
    state = {}
    for key, value in official.items():
        for old, new in renames:
            if key.startswith(old):
                state[new + key.removeprefix(old)] = value
                break
    return state


class HPSv3Model(nn.Module):
    """Qwen2-VL backbone + HPSv3's reward head; ``forward`` gives ``[B, 2]`` float32 ``(mu, sigma)`` at the
    ``<|Reward|>`` token (module docstring)."""

    def __init__(self, config: Any, reward_token_id: int) -> None:
        super().__init__()
        from transformers import Qwen2VLModel

        self.backbone = Qwen2VLModel(config)
        hidden = config.text_config.hidden_size
        self.head = nn.Sequential(nn.Linear(hidden, 1024), nn.ReLU(), nn.Identity(), nn.Linear(1024, 16), nn.ReLU(),
                                  nn.Linear(16, 2))  # the official Sequential's indices: 1 ReLU, 2 Dropout(0.05)
        self.reward_token_id = reward_token_id
        self.image_token_id = config.image_token_id

    def forward(self, input_ids: Tensor, attention_mask: Tensor, pixel_values: Tensor, grid_thw: Tensor) -> Tensor:
        """``input_ids`` / ``attention_mask [B, S]`` (right-padded, one ``<|Reward|>`` per row), ``pixel_values
        [N, 1176]``, ``grid_thw [B, 3]`` -> ``[B, 2]`` float32."""
        hidden = qwen2vl_hidden(self.backbone, input_ids, attention_mask, pixel_values, grid_thw, self.image_token_id)
        reward_slots = input_ids == self.reward_token_id
        if not bool((reward_slots.sum(dim=1) == 1).all()):
            raise ValueError(f"each row must hold exactly one {REWARD_TOKEN} token (a prompt containing it?)")
        return self.head(hidden[reward_slots].float())


def qwen2vl_hidden(backbone: nn.Module, input_ids: Tensor, attention_mask: Tensor, pixels: Tensor, grid_thw: Tensor,
                   media_token_id: int) -> Tensor:
    """The final hidden states ``[B, S, D]`` of a transformers ``Qwen2VLModel`` on ``input_ids [B, S]`` with the
    vision tower's merged embeddings of ``pixels [N, 3 * 2 * 14 * 14]`` (images or video, ``grid_thw [M, 3]``) in the
    ``media_token_id`` slots, at *sequential* positions: HPSv3's and VideoAlign's forwards pass no M-RoPE ids (the
    language model's default ``arange`` for all three rotary sections)."""
    language = backbone.language_model
    embeds = language.embed_tokens(input_ids)
    media = backbone.visual(pixels.to(embeds.dtype), grid_thw=grid_thw).pooler_output.to(embeds.dtype)
    slots = (input_ids == media_token_id).unsqueeze(-1).expand_as(embeds)
    embeds = embeds.masked_scatter(slots, media)
    return language(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=None).last_hidden_state


def qwen2vl_patches(pixels: Tensor, patch: int = 14, merge: int = 2, temporal: int = 2) -> Tensor:
    """An image ``[3, H, W]`` (repeated ``temporal`` times) or frames ``[T, 3, H, W]`` (``T`` a multiple of
    ``temporal``), normalised, H and W multiples of ``patch * merge`` -> ``[(T / temporal) * (H / patch) * (W /
    patch), 3 * temporal * patch * patch]``: the Qwen2-VL processor's patch layout (patches ordered by time step,
    then by 2 x 2 merge window)."""
    frames = pixels.unsqueeze(0).expand(temporal, -1, -1, -1) if pixels.dim() == 3 else pixels
    steps, channels, height, width = frames.shape[0] // temporal, *frames.shape[1:]
    grid_h, grid_w = height // patch, width // patch
    frames = frames.reshape(steps, temporal, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    frames = frames.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return frames.reshape(steps * grid_h * grid_w, channels * temporal * patch * patch)


def check_chat_tokenizer(tokenizer: Any, base_dir: str, base_name: str) -> None:
    """Give ``tokenizer`` (read from the base model ``base_dir``) the base's chat template from its
    ``chat_template.json`` when there is one (the processor's file, which the tokenizer does not read itself).

    Raises:
        ValueError: a stub tokenizer (under 10 tokens), or no chat template at all (naming ``base_name``'s file).
    """
    if len(tokenizer) < 10:
        raise ValueError(f"the tokenizer in {base_dir!r} has only {len(tokenizer)} tokens (a stub)")
    template_file = os.path.join(base_dir, "chat_template.json")
    if os.path.isfile(template_file):
        with open(template_file) as handle:
            tokenizer.chat_template = json.load(handle)["chat_template"]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"base_path={base_dir!r} has no chat template (chat_template.json of {base_name})")


def build_qwen2vl_in_dtype(config: Any, vocab_rows: int, device: torch.device, dtype: torch.dtype,
                           build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` of a reward model around a Qwen2-VL backbone described by ``config`` (a ``Qwen2VLConfig``, set
    here: ``vocab_rows`` embedding rows -- the checkpoint's, resized for its reward tokens --, sdpa attention, every
    part in ``dtype``), constructed on ``device`` in ``dtype``: one copy of the weights, never a float32 one first.
    Shared by HPSv3 and VideoAlign."""
    config.text_config.vocab_size = config.vocab_size = vocab_rows
    config._attn_implementation = "sdpa"
    for part in (config, config.text_config, config.vision_config):  # transformers builds each part in the dtype
        part.dtype = dtype  # of its config (config.json's torch_dtype), not in the default dtype set below
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return build()
    finally:
        torch.set_default_dtype(default_dtype)


def load_hpsv3(model_dir: str, base_dir: str, device: torch.device, dtype: torch.dtype) -> tuple[HPSv3Model, Any]:
    """``(model, tokenizer)``: the frozen eval-mode :class:`HPSv3Model` (built on ``device``, the head float32) from
    ``model_dir/HPSv3.safetensors`` and the base's ``config.json``; the base tokenizer with ``<|Reward|>`` added and
    the base's chat template.

    Raises:
        ValueError: missing / unreadable files, a stub tokenizer, or weights that do not fit.
    """
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, Qwen2VLConfig

    checkpoint = os.path.join(model_dir, "HPSv3.safetensors")
    if not os.path.isfile(checkpoint):
        raise ValueError(f"model_path={model_dir!r} has no HPSv3.safetensors (huggingface MizzenAI/HPSv3)")
    try:
        config = Qwen2VLConfig.from_pretrained(base_dir, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(base_dir, local_files_only=True, padding_side="right")
        official = load_file(checkpoint, device="cpu")
    except (OSError, ValueError) as error:
        raise ValueError(f"could not read HPSv3 from {model_dir!r} / base {base_dir!r}: {error}") from error
    check_chat_tokenizer(tokenizer, base_dir, "Qwen2-VL-7B-Instruct")
    tokenizer.add_tokens([REWARD_TOKEN], special_tokens=True)
    embed = official.get("model.embed_tokens.weight")
    if embed is None or embed.shape[0] != len(tokenizer):
        raise ValueError(f"{checkpoint!r} does not fit the base tokenizer plus {REWARD_TOKEN} "
                         f"({len(tokenizer)} tokens)")
    # HPSv3 resized the embeddings to the base tokenizer plus its token
    model = build_qwen2vl_in_dtype(config, int(embed.shape[0]), device, dtype,
                                   lambda: HPSv3Model(config, tokenizer.convert_tokens_to_ids(REWARD_TOKEN)))
    model.head.to(dtype=torch.float32)
    missing, unexpected = model.load_state_dict(transformers_state(official), strict=False)
    if missing or unexpected:
        raise ValueError(f"{checkpoint!r} does not fit HPSv3: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.eval().requires_grad_(False), tokenizer


class HPSv3Scorer:
    """HPSv3 (Ma et al. 2025): ``mu`` of the reward head of the HPSv3-tuned Qwen2-VL-7B (higher is better).

    Args:
        model_path: local directory of huggingface ``MizzenAI/HPSv3`` (``HPSv3.safetensors``).
        base_path: local directory of ``Qwen/Qwen2-VL-7B-Instruct`` (``config.json``, tokenizer files,
            ``chat_template.json``); its weights are not read.
        device: ``"cpu"`` or a CUDA device (the 7B model wants a GPU).
        dtype: backbone dtype, ``"bfloat16"`` as the official inference; the head is float32.
        batch_size: images per forward, >= 1.

    Raises:
        ValueError: a missing path or file, a bad option, or files that do not fit together.
    """

    name = "hpsv3"
    needs_group: ClassVar[bool] = False

    def __init__(self, model_path: str | os.PathLike | None = None, base_path: str | os.PathLike | None = None, *,
                 device: str | torch.device = "cpu", dtype: str | torch.dtype = "bfloat16",
                 batch_size: int = 4) -> None:
        self.batch_size = check_batch_size(batch_size)
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        model_dir = str(local_dir(model_path, "model_path", "MizzenAI/HPSv3 (HPSv3.safetensors)"))
        base_dir = str(local_dir(base_path, "base_path", "Qwen/Qwen2-VL-7B-Instruct (config, tokenizer, template)"))
        self._loaded = load_cached(("HPSv3", model_dir, base_dir, str(self.device), self.dtype),
                                   lambda: _Loaded(*load_hpsv3(model_dir, base_dir, self.device, self.dtype)))
        self.model, self.tokenizer = self._loaded.model, self._loaded.tokenizer
        vision = self.model.backbone.config.vision_config
        self.patch, self.merge = int(vision.patch_size), int(vision.spatial_merge_size)
        self.temporal = int(vision.temporal_patch_size)

    def pixels(self, image: Tensor) -> tuple[Tensor, Tensor]:
        """``[3, H, W]`` in [0, 1] -> ``(patches [N, 1176] float32, grid_thw [3] int64)``: HPSv3's resize to
        ``PIXELS`` pixels (multiples of 28), CLIP normalisation, Qwen2-VL patches."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        image = image.float().clamp(0.0, 1.0)
        height, width = smart_resize(image.shape[-2], image.shape[-1], factor=self.patch * self.merge,
                                     min_pixels=PIXELS, max_pixels=PIXELS)
        if (height, width) != tuple(image.shape[-2:]):
            image = F.interpolate(image[None], size=(height, width), mode="bicubic", align_corners=False,
                                  antialias=True)[0].clamp(0.0, 1.0)
        mean = torch.tensor(CLIP_MEAN, device=image.device).view(3, 1, 1)
        std = torch.tensor(CLIP_STD, device=image.device).view(3, 1, 1)
        patches = qwen2vl_patches((image - mean) / std, self.patch, self.merge, self.temporal)
        return patches, torch.tensor([1, height // self.patch, width // self.patch])

    def inputs(self, media: Tensor, prompts: Sequence[str]) -> dict[str, Tensor]:
        """The model inputs of one batch (``input_ids``, ``attention_mask``, ``pixel_values``, ``grid_thw``), on the
        scorer's device."""
        patches, grids = zip(*(self.pixels(image) for image in media.detach().to(self.device)))
        texts = []
        for prompt, grid in zip(prompts, grids):
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": hpsv3_text(prompt)}]}]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            slots = int(grid.prod()) // self.merge**2
            texts.append(text.replace("<|image_pad|>", "<|image_pad|>" * slots, 1))
        tokens = self.tokenizer(texts, padding=True, return_tensors="pt")
        return {"input_ids": tokens["input_ids"].to(self.device), "attention_mask": tokens["attention_mask"].to(
            self.device), "pixel_values": torch.cat(patches), "grid_thw": torch.stack(grids).to(self.device)}

    @torch.no_grad()
    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """``media [B, 3, H, W]`` in [0, 1] -> ``[B]`` float32 HPSv3 score (``mu``) on ``media``'s device."""
        batch = check_inputs(media, prompts, metadata)
        if batch == 0:
            return torch.empty(0, dtype=torch.float32, device=media.device)
        scores = []
        for start in range(0, batch, self.batch_size):
            inputs = self.inputs(media[start : start + self.batch_size], prompts[start : start + self.batch_size])
            inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
            scores.append(self.model(**inputs)[:, 0])
        return torch.cat(scores).to(media.device)


class _Loaded:
    """The model and its tokenizer as one weakly cacheable value."""

    def __init__(self, model: HPSv3Model, tokenizer: Any) -> None:
        self.model, self.tokenizer = model, tokenizer
