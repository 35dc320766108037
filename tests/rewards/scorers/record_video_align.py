"""Record ``data/video_align_official.json``: the official VideoAlign (VideoReward) code's rewards on a tiny random
Qwen2-VL, for a LoRA checkpoint (``adapter_model.safetensors`` + ``non_lora_state_dict.pth``, output_dim 3, as the
released one was trained by ``train.sh``) and a full one (``model.pth``, output_dim 1).

Not a test (pytest does not collect it): run by hand with the transformers the official code pins (4.45.2) and a
checkout of github KwaiVGI/VideoAlign (commit 219ab9d; its top-level modules on the path)::

    # the HPSv3 recorder's overlay (transformers 4.45.2, tokenizers 0.20.3, huggingface_hub 0.25.2, torchvision)
    PYTHONPATH=OVERLAY:VIDEOALIGN:$PWD python -m tests.rewards.scorers.record_video_align

It runs ``inference.py``'s ``VideoVLMRewardInference`` (``create_model_and_processor`` of ``train_reward.py``,
``load_model_from_checkpoint`` of ``utils.py``, ``prepare_batch``: ``prompt_template.py``'s ``detailed_special``
prompt, ``vision_process.py``'s frame sampling and uint8 bicubic resize, the Qwen2-VL processor; ``reward``:
``trainer.py``'s ``Qwen2VLRewardModelBT``, the model_config.json normalisation, Overall = VQ + MQ + TA). What is not
the official path: the training-only imports (``datasets``, ``trl``; ``trl.get_quantization_config`` returns None as
trl's does without 4 / 8-bit options) are placeholders, attention is ``sdpa`` instead of flash-attention 2 (no CUDA
here), and ``torchvision.io.read_video`` (file decoding) returns the stored uint8 frames of each "file" instead of
decoding an mp4: the official frame sampling and resizing run on them unchanged.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import json
import os
import sys
import tempfile
import types
from pathlib import Path

import torch

from tests.rewards.scorers.tiny_qwen2vl import config_dict, fill_state, write_processor
from tests.rewards.scorers.tiny_video_align import (
    CASES, DATA_CONFIG, GOLDEN, INFERENCE_CONFIG, LORA, NUM_FRAMES_CASE, video_frames,
)


def _placeholders() -> None:
    class Anything:
        def __init__(self, *args, **kwargs):
            pass

    def _anything(attribute):
        if attribute.startswith("__"):  # inspect / importlib probes see a plain module
            raise AttributeError(attribute)
        return Anything

    for name in ("datasets", "trl"):
        module = types.ModuleType(name)
        module.__getattr__ = _anything
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__version__ = "2.21.0"  # read by transformers' version probes (datasets is installed, but needs a
        sys.modules[name] = module     # newer huggingface_hub than transformers 4.45's)
    sys.modules["trl"].get_quantization_config = lambda model_config: None  # trl's answer without 4 / 8-bit
    sys.modules["trl"].get_kbit_device_map = lambda: None


def _model_config(base: Path, output_dim: int, lora: bool) -> dict:
    return {
        "data_config": {**DATA_CONFIG, "meta_data": "unused.csv", "data_dir": "unused"},
        "model_config": {"model_name_or_path": str(base), "output_dim": output_dim, "use_special_tokens": True,
                         "reward_token": "special", "torch_dtype": "float32"},
        "peft_lora_config": {**LORA, "lora_enable": lora, "vision_lora": False,
                             "lora_namespan_exclude": ["lm_head", "rm_head", "embed_tokens", "visual"]},
        "inference_config": INFERENCE_CONFIG,
    }


def main() -> None:
    torch.set_num_threads(1)
    os.environ["FORCE_QWENVL_VIDEO_READER"] = "torchvision"
    _placeholders()
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    train_reward = importlib.import_module("train_reward")
    utils = importlib.import_module("utils")
    inference = importlib.import_module("inference")
    vision_process = importlib.import_module("vision_process")
    from peft import get_peft_model_state_dict

    def training_config(**kwargs):  # no flash-attention 2 on CPU: sdpa, as the official --disable_flash_attn2
        return utils.TrainingConfig(**{**kwargs, "disable_flash_attn2": True})

    inference.TrainingConfig = training_config
    work = Path(tempfile.mkdtemp())
    videos = {}

    def read_video(path, start_pts=0.0, end_pts=None, pts_unit="sec", output_format="TCHW"):
        frames, fps = videos[path.removeprefix("file://")]
        return frames, None, {"video_fps": fps}

    vision_process.io.read_video = read_video
    base = work / "base"
    vocab_size = write_processor(base)
    (base / "config.json").write_text(json.dumps(config_dict(vocab_size)))
    config = Qwen2VLConfig.from_pretrained(str(base))
    config._attn_implementation = "sdpa"
    backbone = Qwen2VLForConditionalGeneration(config)
    base_keys = [(key, list(p.shape)) for key, p in backbone.named_parameters()]
    backbone.load_state_dict(fill_state(base_keys), strict=True)
    backbone.save_pretrained(str(base))  # the base weights a LoRA checkpoint is applied to
    paths, prompts = [], []
    for prompt, frames, height, width, fps, seed in CASES:
        paths.append(str(work / f"video_{seed}.mp4"))
        videos[paths[-1]] = (video_frames(frames, height, width, seed), fps)
        prompts.append(prompt)
    record = {
        "source": "official VideoAlign code, github KwaiVGI/VideoAlign 219ab9d: inference.py VideoVLMRewardInference "
                  "(prepare_batch / reward), train_reward.py create_model_and_processor, utils.py "
                  "load_model_from_checkpoint, trainer.py Qwen2VLRewardModelBT, vision_process.py, prompt_template.py; "
                  "recorded by tests/rewards/scorers/record_video_align.py",
        "versions": {name: importlib.metadata.version(name) for name in ("torch", "transformers", "peft")},
        "base_keys_shapes": base_keys,
    }
    for variant, output_dim, lora, step in (("lora", 3, True, 7), ("full", 1, False, 3)):
        root = work / variant
        (root / f"checkpoint-{step}").mkdir(parents=True)
        model_config = _model_config(base, output_dim, lora)
        (root / "model_config.json").write_text(json.dumps(model_config))
        model, _, _ = train_reward.create_model_and_processor(
            utils.ModelConfig(**model_config["model_config"]), utils.PEFTLoraConfig(**model_config["peft_lora_config"]),
            training_config(output_dir=""))
        if lora:  # LoRA + the trainable non-LoRA parameters of train.sh (vision tower, merger, embeddings, rm_head)
            trained = [(key, list(p.shape)) for key, p in model.named_parameters()
                       if "lora_" in key or any(part in key for part in ("visual.", "embed_tokens", "rm_head"))]
            model.load_state_dict(fill_state(trained, seed=1), strict=False)
            adapter = get_peft_model_state_dict(model)
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in adapter.items()},
                      str(root / f"checkpoint-{step}" / "adapter_model.safetensors"))
            non_lora = {key: p.detach().clone() for key, p in model.named_parameters() if "lora_" not in key and any(
                part in key for part in ("visual.", "embed_tokens", "rm_head"))}
            torch.save(non_lora, root / f"checkpoint-{step}" / "non_lora_state_dict.pth")
            saved = {"trained_keys_shapes": trained,
                     "adapter_keys_shapes": [(k, list(v.shape)) for k, v in adapter.items()],
                     "non_lora_keys_shapes": [(k, list(v.shape)) for k, v in non_lora.items()]}
        else:
            keys = [(key, list(p.shape)) for key, p in model.named_parameters()]
            model.load_state_dict(fill_state(keys, seed=2), strict=True)
            torch.save(model.state_dict(), root / f"checkpoint-{step}" / "model.pth")
            saved = {"model_keys_shapes": keys}
        inferencer = inference.VideoVLMRewardInference(str(root), device="cpu", dtype=torch.float32)
        with torch.no_grad():
            batch = inferencer.prepare_batch(paths, prompts)
            raw = inferencer.reward(paths, prompts, use_norm=False)
            normed = inferencer.reward(paths, prompts, use_norm=True)
            by_frames = inferencer.reward(paths[:1], prompts[:1], num_frames=NUM_FRAMES_CASE, use_norm=True)
        grids = batch["video_grid_thw"]
        per_video = torch.split(batch["pixel_values_videos"].double(), grids.prod(-1).tolist())
        record[variant] = {
            **saved, "output_dim": output_dim, "step": step, "raw": raw, "normed": normed,
            "num_frames_normed": by_frames,
            "input_ids": [batch["input_ids"][i][batch["attention_mask"][i] > 0].tolist() for i in range(len(paths))],
            "video_grid_thw": grids.tolist(),
            "pixel_values": [{"shape": list(p.shape), "sum": p.sum().item(), "abs_sum": p.abs().sum().item(),
                              "weighted_sum": (p * (torch.arange(p.numel(), dtype=torch.float64).view_as(p) % 1009))
                              .sum().item()} for p in per_video],
        }
        print(variant, raw, normed, by_frames)
    GOLDEN.write_text(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
