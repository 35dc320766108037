"""Record ``data/hpsv3_official.json``: the official HPSv3 code's scores on a tiny random Qwen2-VL.

Not a test (pytest does not collect it): run by hand where the official code imports, with the transformers it pins
(4.45.2; its reward model reads ``self.model.embed_tokens``, a layout transformers 5 changed)::

    pip download hpsv3==1.0.0 transformers==4.45.2 tokenizers==0.20.3 huggingface_hub==0.25.2 \
        "torchvision==0.28.*" --no-deps -d wheels
    # unpack them into OVERLAY (torchvision's CUDA wheel: blank torchvision/_meta_registrations.py, which registers
    # kernels of its compiled ops; only its pure-Python parts are imported)
    PYTHONPATH=OVERLAY:$PWD python -m tests.rewards.scorers.record_hpsv3

It runs the official ``hpsv3/inference.py`` ``HPSv3RewardInferencer.reward`` (``prepare_batch``: the INSTRUCTION
template + ``<|Reward|>`` prompt, the chat template, ``hpsv3/dataset/utils.py``'s ``process_vision_info`` at
``256 * 28 * 28`` pixels, the Qwen2-VL processor, right padding) and ``hpsv3/model/qwen2vl_trainer.py``'s
``Qwen2VLRewardModelBT`` (``rm_head_type="ranknet"``, ``output_dim=2``, ``special_token_ids=[<|Reward|>]``, as
``create_model_and_processor`` builds it from ``config/HPSv3_7B.yaml``) on the tiny model of
:mod:`tests.rewards.scorers.tiny_qwen2vl`, every parameter filled by its ``fill_state``. The imports that only the
trainer half of those modules needs (peft, trl, datasets, matplotlib, omegaconf and the training module) are
placeholders; no code that scoring runs is replaced.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import json
import sys
import tempfile
import types
from pathlib import Path

import torch

from tests.rewards.scorers.tiny_qwen2vl import CASES, GOLDEN, config_dict, fill_state, smooth_image, write_processor


def _placeholders() -> None:
    class Anything:
        def __init__(self, *args, **kwargs):
            pass

    for name in ("peft", "trl", "datasets", "matplotlib", "matplotlib.pyplot", "matplotlib.patches",
                 "hpsv3.utils.training_utils", "hpsv3.utils.parser", "hpsv3.train"):
        module = types.ModuleType(name)
        module.__getattr__ = lambda attribute: Anything
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = module
    root = Path(importlib.util.find_spec("hpsv3").submodule_search_locations[0])
    for name, folder in (("hpsv3", root), ("hpsv3.model", root / "model"), ("hpsv3.dataset", root / "dataset"),
                         ("hpsv3.utils", root / "utils")):
        package = types.ModuleType(name)  # skip the package __init__ files (they import the training stack)
        package.__path__ = [str(folder)]
        sys.modules[name] = package


def main() -> None:
    torch.set_num_threads(1)
    from PIL import Image
    from transformers import AutoProcessor, Qwen2VLConfig

    _placeholders()

    trainer = importlib.import_module("hpsv3.model.qwen2vl_trainer")
    inference = importlib.import_module("hpsv3.inference")
    work = Path(tempfile.mkdtemp())
    vocab_size = write_processor(work)
    (work / "config.json").write_text(json.dumps(config_dict(vocab_size)))
    processor = AutoProcessor.from_pretrained(str(work), padding_side="right")  # as create_model_and_processor
    processor.tokenizer.add_special_tokens({"additional_special_tokens": ["<|Reward|>"]})
    special_token_ids = processor.tokenizer.convert_tokens_to_ids(["<|Reward|>"])
    config = Qwen2VLConfig.from_pretrained(str(work))
    config._attn_implementation = "sdpa"
    model = trainer.Qwen2VLRewardModelBT(config, output_dim=2, reward_token="special",
                                         special_token_ids=special_token_ids, rm_head_type="ranknet")
    model.resize_token_embeddings(len(processor.tokenizer))
    model.config.pad_token_id = processor.tokenizer.pad_token_id  # as create_model_and_processor
    keys_shapes = [(key, list(p.shape)) for key, p in model.named_parameters()]
    model.load_state_dict(fill_state(keys_shapes), strict=True)
    model.eval()
    inferencer = inference.HPSv3RewardInferencer.__new__(inference.HPSv3RewardInferencer)
    inferencer.model, inferencer.processor, inferencer.device, inferencer.use_special_tokens = (
        model, processor, "cpu", True)
    paths, prompts = [], []
    for prompt, height, width, seed in CASES:
        paths.append(str(work / f"image_{seed}.png"))
        Image.fromarray(smooth_image(height, width, seed).numpy()).save(paths[-1])
        prompts.append(prompt)
    batch = inferencer.prepare_batch(paths, prompts)
    logits = inferencer.reward(paths, prompts)  # [B, 2]: mu, sigma; HPSv3's score is mu
    per_image = torch.split(batch["pixel_values"].double(), batch["image_grid_thw"].prod(-1).tolist())
    GOLDEN.write_text(json.dumps({
        "source": f"official HPSv3 code, pip package hpsv3 {importlib.metadata.version('hpsv3')} (github "
                  "MizzenAI/HPSv3): hpsv3/inference.py HPSv3RewardInferencer.prepare_batch / reward, "
                  "hpsv3/model/qwen2vl_trainer.py Qwen2VLRewardModelBT, hpsv3/dataset/utils.py process_vision_info; "
                  "recorded by tests/rewards/scorers/record_hpsv3.py",
        "versions": {name: importlib.metadata.version(name) for name in ("torch", "transformers", "pillow")},
        "keys_shapes": keys_shapes, "reward_token_id": special_token_ids[0],
        "cases": [{"prompt": p, "height": h, "width": w, "seed": s, "mu": logits[i, 0].item(),
                   "sigma": logits[i, 1].item(), "input_ids": batch["input_ids"][i][batch["attention_mask"][i] > 0]
                   .tolist()} for i, (p, h, w, s) in enumerate(CASES)],
        "image_grid_thw": batch["image_grid_thw"].tolist(),
        "pixel_values": [{"shape": list(p.shape), "sum": p.sum().item(), "abs_sum": p.abs().sum().item(),
                          "weighted_sum": (p * (torch.arange(p.numel(), dtype=torch.float64).view_as(p) % 1009)).sum()
                          .item()} for p in per_image],  # checksums per image; the weights make order matter
    }) + "\n")
    print(logits)


if __name__ == "__main__":
    main()
