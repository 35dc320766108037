"""The memory planner against a published number: DiffusionNFT on SD3.5-Medium, 47.8 GB peak VRAM per GPU on 8 GPUs
(DiffusionOPSD's README, "Training efficiency" table, github.com/worldbench/DiffusionOPSD).

    python bench/plan_published.py [--out result.json]

Their setting, read from that repository (config/nft.py, config/base.py, scripts/train_nft_sd3.py):

* SD3.5-M at 512 px, LoRA r32 / alpha 64 on the 8 attention projections, DDP (not FSDP) on 8 GPUs;
* 48 prompts x 24 images per epoch -> 144 images per GPU per epoch, sampling and training micro-batch 9;
* 10 deterministic DPM2 steps, guidance 1 (no CFG), old-policy adapter + EMA of the LoRA weights on the GPU;
* ``StableDiffusion3Pipeline.from_pretrained`` without ``torch_dtype``: the transformer's weights stay **fp32**,
  forwards run under fp16 autocast; text encoders (CLIP-L, CLIP-G, T5-XXL) fp16 and the VAE fp32 stay on the GPU;
  T5 length 128 (77 + 128 = 205 text tokens); gradient checkpointing off unless ``SD3_TRANSFORMER_GRADCKPT=1``.

flowforge's planner plans flowforge's own run: ``examples/gpu/sd35m_pickscore_nft.yaml`` (the same recipe) with
``distributed.strategy=ddp`` and their text length, bf16 weights. Items flowforge does not have are added here from
the components' parameter counts (each built on the meta device from its config): fp32 instead of bf16 transformer
weights, resident text encoders and VAE, the reward model. What their README leaves out becomes a range: whether
"peak VRAM" is allocated or reserved memory (+0 to +10 % allocator slack), the reward model's precision (PickScore
CLIP-H/14, fp16 or fp32), and checkpointing (off by default there; on gives the low end).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PUBLISHED_GB = 47.8
# Component configs (Hugging Face config.json values of SD3.5-M's text_encoder / _2 / _3 and of PickScore_v1), built
# on the meta device to count parameters.
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              feed_forward_proj="gated-gelu")
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, projection_dim=768)
CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
              num_attention_heads=20, max_position_embeddings=77, projection_dim=1280)
CLIP_H = dict(text_config=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16),
              vision_config=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                                 num_attention_heads=16, patch_size=14, image_size=224), projection_dim=1024)


def component_params() -> dict[str, int]:
    import torch
    import transformers
    from diffusers import AutoencoderKL

    with torch.device("meta"):
        models = {"t5_xxl_encoder": transformers.T5EncoderModel(transformers.T5Config(**T5_XXL)),
                  "clip_l_text": transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(**CLIP_L)),
                  "clip_g_text": transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(**CLIP_G)),
                  "pickscore_clip_h": transformers.CLIPModel(transformers.CLIPConfig(**CLIP_H)),
                  # SD3's VAE: 16 latent channels, diffusers' AutoencoderKL with SD3's block widths
                  "vae": AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16,
                                       down_block_types=("DownEncoderBlock2D",) * 4,
                                       up_block_types=("UpDecoderBlock2D",) * 4,
                                       block_out_channels=(128, 256, 512, 512), layers_per_block=2)}
    return {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    import torch

    from flowforge.config import load_config
    from flowforge.tools.plan import plan_config, spec_for

    torch.set_num_threads(max(1, torch.get_num_threads()))
    yaml = ROOT / "examples" / "gpu" / "sd35m_pickscore_nft.yaml"
    spec = dataclasses.replace(spec_for("sd3", "stabilityai/stable-diffusion-3.5-medium"), text_tokens=205)
    results = {}
    counts = component_params()
    for ckpt in (False, True):
        cfg = load_config(yaml, ["distributed.strategy=ddp",
                                 f"distributed.activation_checkpointing={str(ckpt).lower()}"])
        plan = plan_config(cfg, 8, "h100-80gb", spec=spec, alternatives=False)
        params = plan.facts["params"]
        extra = {"fp32 transformer weights (theirs) instead of bf16": params * 2,
                 "text encoders fp16 (CLIP-L + CLIP-G + T5-XXL)": 2 * (counts["t5_xxl_encoder"] + counts["clip_l_text"]
                                                                      + counts["clip_g_text"]),
                 "VAE fp32": 4 * counts["vae"]}
        base = max(plan.phases["rollout"], plan.phases["train"]) + sum(extra.values())
        reward = {"fp16": 2 * counts["pickscore_clip_h"], "fp32": 4 * counts["pickscore_clip_h"]}
        low, high = base + reward["fp16"], (base + reward["fp32"]) * 1.10
        results[f"checkpointing={ckpt}"] = {
            "flowforge_plan_gb": plan.as_dict()["items_gb"], "flowforge_peak_gb": plan.peak / 1e9,
            "added_gb": {k: v / 1e9 for k, v in extra.items()}, "reward_model_gb": {k: v / 1e9 for k, v in
                                                                                    reward.items()},
            "predicted_low_gb": low / 1e9, "predicted_high_gb": high / 1e9,
            "ratio_low": low / 1e9 / PUBLISHED_GB, "ratio_high": high / 1e9 / PUBLISHED_GB}
        r = results[f"checkpointing={ckpt}"]
        print(f"checkpointing={ckpt}: flowforge plan {r['flowforge_peak_gb']:.1f} GB; with their extras "
              f"{r['predicted_low_gb']:.1f}-{r['predicted_high_gb']:.1f} GB vs published {PUBLISHED_GB} GB "
              f"(ratio {r['ratio_low']:.2f}-{r['ratio_high']:.2f})", flush=True)
    results["component_params"] = counts
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
