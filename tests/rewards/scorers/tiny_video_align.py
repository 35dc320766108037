"""The tiny VideoAlign setting shared by the VideoAlign test and its official-code recorder
(:mod:`tests.rewards.scorers.record_video_align`): the checkpoint's model_config.json sections, the clips and the
golden file. The Qwen2-VL base is :mod:`tests.rewards.scorers.tiny_qwen2vl`'s."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.rewards.scorers.tiny_qwen2vl import smooth_image

GOLDEN = Path(__file__).parent / "data" / "video_align_official.json"

DATA_CONFIG = {  # train.sh's data options (the released checkpoint's): fps 2, 448 * 448 pixels a frame at most
    "max_frame_pixels": 200704, "num_frames": None, "fps": 2.0, "eval_dim": ["VQ", "MQ", "TA"],
    "prompt_template_type": "detailed_special", "sample_type": "uniform",
}
INFERENCE_CONFIG = {"VQ_mean": 0.3, "VQ_std": 2.0, "MQ_mean": -0.2, "MQ_std": 0.5, "TA_mean": 0.1, "TA_std": 4.0}
LORA = {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.05, "use_rslora": False}

CASES = [  # (prompt, frames, height, width, clip fps, seed): fps sampling 10 @ 8 fps -> 4 frames, 17 @ 16 -> 4
    ("a red fox running through the snow", 10, 240, 320, 8.0, 1),
    ("the camera pans slowly over a quiet city at night, neon lights on wet streets", 10, 240, 320, 8.0, 2),
    ("two dogs", 17, 320, 320, 16.0, 3),
]
NUM_FRAMES_CASE = 6
"""``num_frames`` of the second official call (the first clip only): 6 of its 10 frames."""


def video_frames(frames: int, height: int, width: int, seed: int) -> torch.Tensor:
    """``[F, 3, H, W]`` uint8 clip of smooth random frames (as a video reader's TCHW output)."""
    return torch.stack([smooth_image(height, width, 100 * seed + f).permute(2, 0, 1) for f in range(frames)])
