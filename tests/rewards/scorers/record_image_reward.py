"""Record ``data/image_reward_official.json``: the official ImageReward code's scores on tiny random weights.

Not a test (pytest does not collect it): run by hand where the official code can be imported, e.g.::

    pip download image-reward==1.5 timm fairscale "torchvision==0.28.*" --no-deps -d wheels
    # unpack the four into one folder OVERLAY (torchvision's CUDA wheel: blank torchvision/_meta_registrations.py,
    # which registers kernels of its compiled ops; the PIL transforms used here are pure Python)
    PYTHONPATH=$PWD:OVERLAY python -m tests.rewards.scorers.record_image_reward

It builds the official modules of ``ImageReward/models/BLIP`` (``vit.VisionTransformer``, ``med.BertModel``), the
official ``ImageReward.MLP`` head and the official preprocessing ``ImageReward._transform`` (torchvision Resize
bicubic / CenterCrop / ToTensor / Normalize on a PIL image), tokenises with the official ``blip.init_tokenizer``
(its ``BertTokenizer.from_pretrained('bert-base-uncased')`` pointed at the tiny vocabulary), fills every parameter
with :func:`tests.rewards.scorers.tiny_image_reward.fill_state` and calls the official ``ImageReward.score`` on each
case of :data:`~tests.rewards.scorers.tiny_image_reward.CASES` (image saved as PNG, opened by the official code).

Two helpers that transformers 5 removed from ``PreTrainedModel`` and that ``med.py`` still calls are given back with
their transformers 4 behaviour: ``get_head_mask(None, n) -> [None] * n`` and ``invert_attention_mask`` (``(1 - m) *
finfo(dtype).min`` on ``[B, 1, 1, S]``); ``find_pruneable_heads_and_indices`` / ``prune_linear_layer`` (imported,
never called) are placeholders; the tokenizer's ``additional_special_tokens_ids`` (``init_tokenizer`` reads it for
``enc_token_id``, which ``score`` does not use) is ``[id of "[ENC]"]``; ``BertModel.init_weights`` (transformers 5
wants ``post_init`` first) is skipped, as every parameter is overwritten by ``fill_state``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import sys
import tempfile
import types
from pathlib import Path
from types import SimpleNamespace

import torch

from tests.rewards.scorers.tiny_image_reward import (
    CASES, GOLDEN, IMAGE_SIZE, MED_CONFIG, PATCH, VISION_DEPTH, VISION_HEADS, VISION_WIDTH, fill_state, smooth_image,
    write_med_config, write_tokenizer,
)

MEAN, STD = 0.16717362830052426, 1.0333394966054072  # ImageReward.__init__'s published normalisation


def _official_modules():
    import transformers.modeling_utils as modeling_utils
    import transformers.pytorch_utils as pytorch_utils

    modeling_utils.apply_chunking_to_forward = pytorch_utils.apply_chunking_to_forward
    modeling_utils.find_pruneable_heads_and_indices = lambda *args: None
    modeling_utils.prune_linear_layer = lambda *args: None
    root = Path(importlib.util.find_spec("ImageReward").submodule_search_locations[0])
    for name, folder in (("ImageReward", root), ("ImageReward.models", root / "models")):
        package = types.ModuleType(name)  # skip the package __init__ (it imports diffusers, datasets, CLIP ...)
        package.__path__ = [str(folder)]
        sys.modules[name] = package
    vit = importlib.import_module("ImageReward.models.BLIP.vit")
    med = importlib.import_module("ImageReward.models.BLIP.med")
    blip = importlib.import_module("ImageReward.models.BLIP.blip")
    reward = importlib.import_module("ImageReward.ImageReward")

    def get_head_mask(self, head_mask, num_layers):
        return [None] * num_layers if head_mask is None else head_mask

    def invert_attention_mask(self, mask):
        mask = mask[:, None, None, :].to(self.dtype) if mask.dim() == 2 else mask[:, None].to(self.dtype)
        return (1.0 - mask) * torch.finfo(self.dtype).min

    med.BertModel.get_head_mask, med.BertModel.invert_attention_mask = get_head_mask, invert_attention_mask
    med.BertModel.init_weights = lambda self: None  # transformers 5's needs post_init(); every weight is filled anyway
    return vit, med, blip, reward


def main() -> None:
    torch.set_num_threads(1)
    vit, med, blip, reward = _official_modules()
    work = Path(tempfile.mkdtemp())
    write_tokenizer(work / "tokenizer")
    write_med_config(work / "med_config.json")
    from_pretrained = blip.BertTokenizer.from_pretrained
    blip.BertTokenizer.from_pretrained = lambda name: from_pretrained(str(work / "tokenizer"))
    # transformers 5 dropped additional_special_tokens_ids; init_tokenizer reads it for enc_token_id (unused here)
    blip.BertTokenizer.additional_special_tokens_ids = property(lambda self: [self.convert_tokens_to_ids("[ENC]")])
    tokenizer = blip.init_tokenizer()
    config = med.BertConfig.from_json_file(str(work / "med_config.json"))
    config.encoder_width = VISION_WIDTH
    model = torch.nn.Module()
    model.blip = torch.nn.Module()
    model.blip.visual_encoder = vit.VisionTransformer(img_size=IMAGE_SIZE, patch_size=PATCH, embed_dim=VISION_WIDTH,
                                                      depth=VISION_DEPTH, num_heads=VISION_HEADS)
    model.blip.text_encoder = med.BertModel(config=config, add_pooling_layer=False)
    model.mlp = reward.MLP(MED_CONFIG["hidden_size"])
    keys_shapes = [(key, list(p.shape)) for key, p in model.named_parameters()]
    model.load_state_dict(fill_state(keys_shapes), strict=False)
    model.eval()
    blip_parts = SimpleNamespace(tokenizer=tokenizer, **dict(model.blip.named_children()))
    scorer = SimpleNamespace(device="cpu", blip=blip_parts,
                             preprocess=reward._transform(IMAGE_SIZE), mlp=model.mlp, mean=MEAN, std=STD)
    from PIL import Image

    cases = []
    with torch.no_grad():
        for prompt, height, width, seed in CASES:
            path = work / f"image_{seed}.png"
            Image.fromarray(smooth_image(height, width, seed).numpy()).save(path)
            pixels = scorer.preprocess(Image.open(path))
            ids = tokenizer(prompt, padding="max_length", truncation=True, max_length=35)["input_ids"]
            case = {"prompt": prompt, "height": height, "width": width, "seed": seed,
                    "score": reward.ImageReward.score(scorer, prompt, str(path)), "input_ids": ids,
                    "pixel_sum": pixels.double().sum().item()}
            if (height, width) != (IMAGE_SIZE, IMAGE_SIZE):  # official Resize + CenterCrop output: [S, S, 3] uint8
                resized = scorer.preprocess.transforms[1](scorer.preprocess.transforms[0](Image.open(path)))
                case["resized_uint8_hex"] = resized.tobytes().hex()
            cases.append(case)
    GOLDEN.write_text(json.dumps({
        "source": "official ImageReward code, pip package image-reward "
                  f"{importlib.metadata.version('image-reward')} (github THUDM/ImageReward): ImageReward/ImageReward.py"
                  " score(), _transform, MLP; models/BLIP/vit.py VisionTransformer, med.py BertModel, blip.py "
                  "init_tokenizer; recorded by tests/rewards/scorers/record_image_reward.py",
        "versions": {name: importlib.metadata.version(name) for name in ("torch", "transformers", "torchvision",
                                                                          "timm", "pillow")},
        "mean": MEAN, "std": STD, "keys_shapes": keys_shapes, "cases": cases,
    }, indent=1) + "\n")
    print(json.dumps([(c["prompt"][:20], c["score"]) for c in cases], indent=1))


if __name__ == "__main__":
    main()
