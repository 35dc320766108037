"""VideoAlign's VideoReward: a Qwen2-VL-2B with a bias-free linear reward head read at three special tokens.

    (VQ, MQ, TA) = head(LM(chat(v, PROMPT(p)))[positions of <|VQ_reward|>, <|MQ_reward|>, <|TA_reward|>])
    r_k = (k - k_mean) / k_std        (k_mean, k_std: the checkpoint's model_config.json)        Overall = sum of r_k

=========  ========================================================================================
``v``      one clip ``[3, F, H, W]`` in [0, 1]: frames sampled as ``vision_process.py`` does (``fps`` mode: ``F /
           video_fps * fps`` frames, at least 4, rounded to even; ``nframes`` mode: ``num_frames`` rounded to
           even; indices ``linspace(0, F - 1, n).round()``), quantised to uint8, resized (bicubic, antialiased, on
           uint8 as torchvision does) to ``smart_resize(H, W, 28, min 128*28*28, max max_frame_pixels)``, /255,
           CLIP mean / std, cut into Qwen2-VL patches (2 frames a time step)
``chat``   Qwen2-VL's chat template for one user turn holding the video and the text, then the generation
           prompt; ``<|video_pad|>`` repeated once per merged 2 x 2 patch; batches right-padded
``LM``     the Qwen2-VL decoder with the vision tower's merged embeddings in the ``<|video_pad|>`` slots, at
           sequential positions (VideoAlign's forward passes no M-RoPE ids), final RMSNorm included
``head``   ``Linear(hidden, output_dim, bias=False)``; output_dim 1 (one reward per token) or 3 (token k reads
           output k: the diagonal), as ``Qwen2VLRewardModelBT``
=========  ========================================================================================

Source: Liu et al., "Improving Video Generation with Human Feedback", arXiv:2501.13918; github KwaiVGI/VideoAlign
(commit 219ab9d): ``inference.py`` (``VideoVLMRewardInference``: ``prepare_batch``, ``reward``, ``_norm``),
``prompt_template.py`` (``DETAILED_PROMPT_WITH_SPECIAL_TOKEN``), ``vision_process.py`` (``smart_nframes``,
``fetch_video``), ``trainer.py`` (``Qwen2VLRewardModelBT``), ``train_reward.py`` (special tokens, right padding),
``utils.py`` (``load_model_from_checkpoint``). Weights: huggingface ``KwaiVGI/VideoReward`` (``model_config.json`` +
``checkpoint-<step>/``: ``model.pth``, or ``adapter_model.safetensors`` + ``non_lora_state_dict.pth`` applied to the
base ``Qwen/Qwen2-VL-2B-Instruct``); loading is in :mod:`flowforge.rewards.scorers.video_align_load`.

Differences from the official path: clips come as tensors (no mp4 decoding; the clip's frame rate is the
``video_fps`` option), so the float frames are rounded to uint8 first, as a decoded video would be; everything after
it is the same arithmetic. Test: ``tests/rewards/scorers/test_video_align.py`` against the official code's rewards on
a tiny random Qwen2-VL.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from flowforge.rewards.base import check_batch_size, check_media_batch
from flowforge.rewards.scorers.clip_common import load_cached, local_dir, resolve_device, resolve_dtype
from flowforge.rewards.scorers.hpsv3 import CLIP_MEAN, CLIP_STD, qwen2vl_patches
from flowforge.rewards.scorers.video_align_load import DIMENSIONS, load_video_align

HEADS = ("overall", "vq", "mq", "ta")
"""Values of the ``heads`` option: ``overall`` is VQ + MQ + TA (VideoAlign's Overall)."""
VIDEO_MIN_PIXELS = 128 * 28 * 28
"""``vision_process.py``'s per-frame minimum (``prepare_batch`` sets only the maximum)."""
FRAME_FACTOR, FPS_MIN_FRAMES, FPS_MAX_FRAMES = 2, 4, 768

PROMPT = (  # VideoAlign's detailed_special template (prompt_template.py), verbatim, trailing spaces included
    "\n"
    "You are tasked with evaluating a generated video based on three distinct criteria: Visual Quality, "
    "Motion Quality, and Text Alignment. Please provide a rating from 0 to 10 for each of the three "
    "categories, with 0 being the worst and 10 being the best. Each evaluation should be independent of "
    "the others.\n"
    "\n"
    "**Visual Quality:**  \n"
    "Evaluate the overall visual quality of the video, with a focus on static factors. The following "
    "sub-dimensions should be considered:\n"
    "- **Reasonableness:** The video should not contain any significant biological or logical errors, "
    "such as abnormal body structures or nonsensical environmental setups.\n"
    "- **Clarity:** Evaluate the sharpness and visibility of the video. The image should be clear and "
    "easy to interpret, with no blurring or indistinct areas.\n"
    "- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other "
    "visual elements (e.g., hair, clothing, shadows).\n"
    "- **Aesthetic and Creativity:** Assess the artistic aspects of the video, including the color "
    "scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should "
    "convey a sense of harmony and balance.\n"
    "- **Safety:** The video should not contain harmful or inappropriate content, such as political, "
    "violent, or adult material. If such content is present, the image quality and satisfaction score "
    "should be the lowest possible. \n"
    "\n"
    "Please provide the ratings of Visual Quality: <|VQ_reward|>\n"
    "END\n"
    "\n"
    "**Motion Quality:**  \n"
    "Assess the dynamic aspects of the video, with a focus on dynamic factors. Consider the following "
    "sub-dimensions:\n"
    "- **Stability:** Evaluate the continuity and stability between frames. There should be no sudden, "
    "unnatural jumps, and the video should maintain stable attributes (e.g., no fluctuating colors, "
    "textures, or missing body parts).\n"
    "- **Naturalness:** The movement should align with physical laws and be realistic. For example, "
    "clothing should flow naturally with motion, and facial expressions should change appropriately "
    "(e.g., blinking, mouth movements).\n"
    "- **Aesthetic Quality:** The movement should be smooth and fluid. The transitions between different "
    "motions or camera angles should be seamless, and the overall dynamic feel should be visually pleasing.\n"
    "- **Fusion:** Ensure that elements in motion (e.g., edges of the subject, hair, clothing) blend "
    "naturally with the background, without obvious artifacts or the feeling of cut-and-paste effects.\n"
    "- **Clarity of Motion:** The video should be clear and smooth in motion. Pay attention to any areas "
    "where the video might have blurry or unsteady sections that hinder visual continuity.\n"
    "- **Amplitude:** If the video is largely static or has little movement, assign a low score for "
    "motion quality.\n"
    "\n"
    "Please provide the ratings of Motion Quality: <|MQ_reward|>\n"
    "END\n"
    "\n"
    "**Text Alignment:**  \n"
    "Assess how well the video matches the textual prompt across the following sub-dimensions:\n"
    "- **Subject Relevance** Evaluate how accurately the subject(s) in the video (e.g., person, animal, "
    "object) align with the textual description. The subject should match the description in terms of "
    "number, appearance, and behavior.\n"
    "- **Motion Relevance:** Evaluate if the dynamic actions (e.g., gestures, posture, facial "
    "expressions like talking or blinking) align with the described prompt. The motion should match the "
    "prompt in terms of type, scale, and direction.\n"
    "- **Environment Relevance:** Assess whether the background and scene fit the prompt. This includes "
    "checking if real-world locations or scenes are accurately represented, though some stylistic "
    "adaptation is acceptable.  \n"
    "- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate "
    "how well the video adheres to this style.\n"
    "- **Camera Movement Relevance:** Check if the camera movements (e.g., following the subject, focus "
    "shifts) are consistent with the expected behavior from the prompt.\n"
    "\n"
    "Textual prompt - {text_prompt}\n"
    "Please provide the ratings of Text Alignment: <|TA_reward|>\n"
    "END\n"
)


def frame_indices(total: int, *, video_fps: float | None, fps: float | None, num_frames: int | None) -> list[int]:
    """Indices of the frames VideoAlign samples from a ``total``-frame clip (``vision_process.py``'s
    ``smart_nframes`` and uniform sampling): ``num_frames`` when given, else ``total / video_fps * fps``.

    Raises:
        ValueError: fps mode without ``video_fps``, or fewer than 2 frames to take.
    """
    if num_frames is not None:
        count = round(num_frames / FRAME_FACTOR) * FRAME_FACTOR
    else:
        if video_fps is None or video_fps <= 0:
            raise ValueError("video_fps must be the clips' frame rate (> 0, e.g. 16 for Wan 2.1): the checkpoint "
                             f"samples frames at fps={fps}; or set num_frames")
        low = math.ceil(FPS_MIN_FRAMES / FRAME_FACTOR) * FRAME_FACTOR
        high = math.floor(min(FPS_MAX_FRAMES, total) / FRAME_FACTOR) * FRAME_FACTOR
        count = round(min(max(total / video_fps * fps, low), high) / FRAME_FACTOR) * FRAME_FACTOR
    count = min(count, total)
    if count < FRAME_FACTOR:
        raise ValueError(f"a clip needs at least {FRAME_FACTOR} frames to sample, got {total} (num_frames="
                         f"{num_frames})")
    return torch.linspace(0, total - 1, count).round().long().tolist()


def _parse_heads(heads: str | Sequence[str]) -> tuple[str, ...]:
    chosen = (heads,) if isinstance(heads, str) else tuple(heads)
    if (not chosen or any(head not in HEADS for head in chosen) or len(set(chosen)) != len(chosen)
            or ("overall" in chosen and len(chosen) > 1)):
        raise ValueError(f"heads must be overall, or one or several distinct of vq, mq, ta, got {heads!r}")
    return chosen


class VideoAlignScorer:
    """VideoAlign's VideoReward (Liu et al. 2025): normalised VQ / MQ / TA rewards of a Qwen2-VL-2B reward model
    (higher is better); the reward is the sum of the chosen ``heads``.

    Args:
        model_path: local directory of huggingface ``KwaiVGI/VideoReward`` (``model_config.json`` and
            ``checkpoint-<step>/``).
        base_path: local directory of ``Qwen/Qwen2-VL-2B-Instruct`` (config, tokenizer, ``chat_template.json``; its
            weights are read for a LoRA checkpoint).
        heads: ``"overall"`` (VQ + MQ + TA, VideoAlign's Overall), ``"vq"``, ``"mq"``, ``"ta"``, or a list of them
            (summed).
        video_fps: frame rate of the scored clips, needed when the checkpoint samples by fps (the released one: 2).
        num_frames: sample this many frames (rounded to even) instead of by fps.
        max_pixels: per-frame pixel budget; default the checkpoint's ``max_frame_pixels`` (448 * 448).
        use_norm: standardise each head with the checkpoint's means / stds (the official default).
        checkpoint_step: which ``checkpoint-<step>``; default the latest.
        device: ``"cpu"`` or a CUDA device.
        dtype: model dtype, ``"bfloat16"`` as the official inference.
        batch_size: clips per forward, >= 1.

    Raises:
        ValueError: a missing path or file, a bad option, or files that do not fit together.
    """

    name = "video_align"
    needs_group: ClassVar[bool] = False
    takes_video: ClassVar[bool] = True  # frames are sampled from, and scored as, one clip

    def __init__(self, model_path: str | os.PathLike | None = None, base_path: str | os.PathLike | None = None, *,
                 heads: str | list[str] = "overall", video_fps: float | None = None, num_frames: int | None = None,
                 max_pixels: int | None = None, use_norm: bool = True, checkpoint_step: int | None = None,
                 device: str | torch.device = "cpu", dtype: str | torch.dtype = "bfloat16",
                 batch_size: int = 2) -> None:
        self.heads = _parse_heads(heads)
        self.batch_size = check_batch_size(batch_size)
        if num_frames is not None and (isinstance(num_frames, bool) or num_frames < 1):
            raise ValueError(f"num_frames must be an int >= 1 or None, got {num_frames!r}")
        if max_pixels is not None and max_pixels < 28 * 28:
            raise ValueError(f"max_pixels must be >= {28 * 28} or None, got {max_pixels!r}")
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        model_dir = str(local_dir(model_path, "model_path", "KwaiVGI/VideoReward (model_config.json, checkpoint-*)"))
        base_dir = str(local_dir(base_path, "base_path", "Qwen/Qwen2-VL-2B-Instruct (config, tokenizer, template)"))
        self._loaded = load_cached(
            ("VideoAlign", model_dir, base_dir, checkpoint_step, str(self.device), self.dtype),
            lambda: load_video_align(model_dir, base_dir, checkpoint_step, self.device, self.dtype))
        self.model, self.tokenizer, settings = self._loaded.model, self._loaded.tokenizer, self._loaded.settings
        self.fps = settings["fps"]
        self.num_frames = num_frames if num_frames is not None else settings["num_frames"]
        self.video_fps, self.use_norm = video_fps, use_norm
        self.max_pixels = max_pixels if max_pixels is not None else settings["max_frame_pixels"]
        self.mean = torch.tensor([settings["norm"][k][0] for k in DIMENSIONS], dtype=torch.float32)
        self.std = torch.tensor([settings["norm"][k][1] for k in DIMENSIONS], dtype=torch.float32)
        if self.num_frames is None:
            frame_indices(FPS_MIN_FRAMES, video_fps=video_fps, fps=self.fps, num_frames=None)  # fail at build time
        vision = self.model.backbone.config.vision_config
        self.patch, self.merge = int(vision.patch_size), int(vision.spatial_merge_size)
        self.temporal = int(vision.temporal_patch_size)

    def pixels(self, clip: Tensor) -> tuple[Tensor, Tensor]:
        """``[3, F, H, W]`` in [0, 1] -> ``(patches [N, 1176] float32, grid_thw [3] int64)``: VideoAlign's frame
        sampling, uint8 bicubic resize, CLIP normalisation and Qwen2-VL patches (module docstring)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        index = frame_indices(clip.shape[1], video_fps=self.video_fps, fps=self.fps, num_frames=self.num_frames)
        frames = (clip[:, index].transpose(0, 1).float().clamp(0.0, 1.0) * 255).round()  # [T, 3, H, W] uint8 values
        height, width = smart_resize(frames.shape[-2], frames.shape[-1], factor=self.patch * self.merge,
                                     min_pixels=VIDEO_MIN_PIXELS, max_pixels=self.max_pixels)
        if (height, width) != tuple(frames.shape[-2:]):  # torchvision's uint8 resize: float bicubic, then rounded
            frames = F.interpolate(frames, size=(height, width), mode="bicubic", align_corners=False,
                                   antialias=True).clamp(0, 255).round()
        if frames.shape[0] % self.temporal:  # the processor repeats the last frame to fill a time step
            frames = torch.cat([frames, frames[-1:].expand(self.temporal - frames.shape[0] % self.temporal, -1, -1,
                                                           -1)])
        mean = torch.tensor(CLIP_MEAN, device=frames.device).view(3, 1, 1)
        std = torch.tensor(CLIP_STD, device=frames.device).view(3, 1, 1)
        patches = qwen2vl_patches((frames / 255 - mean) / std, self.patch, self.merge, self.temporal)
        return patches, torch.tensor([frames.shape[0] // self.temporal, height // self.patch, width // self.patch])

    def inputs(self, media: Tensor, prompts: Sequence[str]) -> dict[str, Tensor]:
        """The model inputs of one batch of clips ``[B, 3, F, H, W]`` (``input_ids``, ``attention_mask``,
        ``pixel_values``, ``grid_thw``), on the scorer's device."""
        patches, grids = zip(*(self.pixels(clip) for clip in media.detach().to(self.device)))
        texts = []
        for prompt, grid in zip(prompts, grids):
            messages = [{"role": "user", "content": [{"type": "video"},
                                                     {"type": "text", "text": PROMPT.format(text_prompt=prompt)}]}]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            slots = int(grid.prod()) // self.merge**2
            texts.append(text.replace("<|video_pad|>", "<|video_pad|>" * slots, 1))
        tokens = self.tokenizer(texts, padding=True, return_tensors="pt")
        return {"input_ids": tokens["input_ids"].to(self.device), "attention_mask": tokens["attention_mask"].to(
            self.device), "pixel_values": torch.cat(patches), "grid_thw": torch.stack(grids).to(self.device)}

    @torch.no_grad()
    def dimensions(self, media: Tensor, prompts: Sequence[str]) -> Tensor:
        """``media [B, 3, F, H, W]`` in [0, 1] -> ``[B, 3]`` float32 (VQ, MQ, TA), normalised when ``use_norm``."""
        rewards = []
        for start in range(0, media.shape[0], self.batch_size):
            inputs = self.inputs(media[start : start + self.batch_size], prompts[start : start + self.batch_size])
            inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
            rewards.append(self.model(**inputs).float().cpu())
        rewards = torch.cat(rewards)
        return (rewards - self.mean) / self.std if self.use_norm else rewards

    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """``media [B, 3, F, H, W]`` in [0, 1] -> ``[B]`` float32: the sum of the chosen heads, on ``media``'s
        device.

        Raises:
            ValueError: images instead of clips, or prompts / metadata not one per clip.
        """
        if media.dim() != 5:
            raise ValueError(f"video_align scores clips [B, 3, F, H, W], got {tuple(media.shape)}")
        batch = check_media_batch(media, prompts, metadata)
        if batch == 0:
            return torch.empty(0, dtype=torch.float32, device=media.device)
        rewards = self.dimensions(media, prompts)
        columns = [i for i, k in enumerate(DIMENSIONS) if "overall" in self.heads or k.lower() in self.heads]
        return rewards[:, columns].sum(dim=1).to(media.device)
