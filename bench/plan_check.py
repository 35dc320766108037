"""The memory planner against a measurement on the CPU: one GRPO LoRA step of a real-architecture transformer at real
width and reduced depth (2 layers; an extra case at 6), under torch's ``MemTracker``, beside ``flowforge plan``'s
prediction for the same setting.

    python bench/plan_check.py [--cases sd35m,wan21_1_3b,qwen_image] [--out results.json]

Each case: a random-init transformer of the family's published config (``flowforge/tools/plan/families.yaml``)
with ``num_layers=2``, behind its flowforge adapter (no VAE, no text encoder: text embeddings of the real width drawn
at random, as ``bench/gpu_acceptance.py`` does), LoRA r32 in bf16 with fp32 masters, one step of flowforge's stages
2 and 5 (``rollout_chunked`` under the sampling policy, then the ``grpo`` objective's ``optimize``: replay, clipped
surrogate, backward, AdamW) — the same step as ``bench/gpu_acceptance.py``. The model and policy are built before
the tracker starts (the plan's ``load`` phase is not compared); the measured peak is everything the tracker sees
during the step: weights, buffers, LoRA masters, copies, gradients, optimizer states (allocated at the step),
conditioning, trajectories and activations. Printed: measured peak, the plan's peak of its rollout and train phases,
and their ratio (acceptance: within +-20%).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# name -> (published entry, px, frames, prompts, group, micro, steps, text tokens, layers)
CASES = {
    "sd35m": ("sd35-medium", 256, None, 2, 4, 4, 2, 333, 2),
    "wan21_1_3b": ("wan21-t2v-1.3b", 128, 9, 2, 2, 2, 2, 512, 2),
    "qwen_image": ("qwen-image", 256, None, 2, 2, 2, 2, 128, 2),
}
EXTRA_CASES = {  # beyond the acceptance: 6 layers, so the plan extrapolates in depth from its 1- and 2-block measure
    "sd35m_6_layers": ("sd35-medium", 256, None, 2, 4, 4, 2, 333, 6),
}
LORA_RANK = 32


def case_config(name: str):
    """``(spec, cfg)`` of case ``name``: the 2-layer spec and the run config (grpo, LoRA r32, bf16)."""
    from flowforge.config import load_config
    from flowforge.tools.plan.activations import depth_overrides
    from flowforge.tools.plan.sizes import published, spec_for

    entry, px, frames, prompts, group, micro, steps, tokens, layers = {**CASES, **EXTRA_CASES}[name]
    e = published()[entry]
    spec = spec_for(e["adapter"], e["hub_id"])
    spec = dataclasses.replace(spec.with_config(**depth_overrides(spec, {"num_layers": layers})), text_tokens=tokens)
    overrides = [f"model.adapter={e['adapter']}", "model.dtype=bfloat16", f"model.height={px}", f"model.width={px}",
                 "train.algorithm=grpo", f"sampler.num_steps={steps}", f"sampler.num_sde_steps={steps - 1}",
                 "sampler.guidance_scale=1.0", f"data.prompts_per_step={prompts}", f"data.group_size={group}",
                 f"train.micro_batch_size={micro}", "train.num_updates_per_batch=1", f"lora.rank={LORA_RANK}",
                 f"lora.alpha={2 * LORA_RANK}", "train.lr=3e-4", "grpo.clip_low=1e-4"]
    if frames:
        overrides += [f"model.frames={frames}", "model.task=t2v"]
    return spec, load_config(None, overrides)


def measure_step(spec, cfg) -> dict:
    """Peak bytes of one GRPO LoRA step (rollout + optimize) under ``MemTracker``; model built before it starts."""
    import torch

    from bench.gpu_acceptance import default_dtype
    from flowforge.models import adapter_class
    from flowforge.models.base import Conditioning
    from flowforge.objectives import OBJECTIVES, TrainBatch
    from flowforge.objectives.anchors import anchor_policy_bank
    from flowforge.policy import OptimizerSettings, Policy, TrainableWeights
    from flowforge.rollout import rollout_chunked
    from flowforge.rollout.loop import sigmas_for
    from flowforge.tools.plan.activations import frozen_safe_tracker, latent_for, tracking
    from flowforge.tools.plan.sizes import build_transformer

    torch.manual_seed(0)
    with default_dtype(torch.bfloat16):
        adapter = adapter_class(spec.adapter)(build_transformer(spec, "cpu"))
    cls = OBJECTIVES["grpo"]
    ctx = cls.context(cfg)
    policy = Policy(adapter, TrainableWeights.from_section(cfg.lora), OptimizerSettings.from_section(cfg.train),
                    total_optimizer_steps=4, **anchor_policy_bank(cfg.anchor, cls.policy_bank(ctx)))
    objective = cls(ctx, adapter, policy)
    batch = cfg.data.prompts_per_step * cfg.data.group_size
    latent = latent_for(spec, cfg.model.height, cfg.model.width, cfg.model.frames)
    sigmas = sigmas_for(cfg.sampler, latent)
    dim = spec.config.get("joint_attention_dim") or spec.config.get("text_dim")
    pooled = spec.config.get("pooled_projection_dim")
    tracker = frozen_safe_tracker(adapter.transformer, policy.optimizer)
    started = time.perf_counter()
    with tracking(tracker, adapter.transformer):
        g = torch.Generator().manual_seed(1)
        cond = Conditioning(
            prompt_embeds=torch.randn(batch, spec.text_tokens, dim, generator=g).to(torch.bfloat16),
            pooled=None if pooled is None else torch.randn(batch, pooled, generator=g).to(torch.bfloat16),
            mask=torch.ones(batch, spec.text_tokens, dtype=torch.int64))
        with policy.using(objective.sampling_policy):
            traj = rollout_chunked(adapter, cond, list(range(batch)), sigmas, objective.rollout_spec(0),
                                   latent_shape=latent, seed=0, batch_size=cfg.train.micro_batch_size,
                                   device=torch.device("cpu"))
        adv = torch.randn(batch, generator=g)
        metrics = objective.optimize(TrainBatch(traj=traj, cond=cond, advantages=adv,
                                                group_ids=torch.arange(batch) // cfg.data.group_size, rewards=adv,
                                                candidate_ids=torch.arange(batch), step=0))
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return {"measured_peak_bytes": peak["Total"], "measured_breakdown": {str(k): v for k, v in peak.items()},
            "step_s": time.perf_counter() - started, "loss": float(metrics["loss"]),
            "params": sum(p.numel() for p in adapter.transformer.parameters())}


def check(name: str) -> dict:
    """Measured vs planned for case ``name``."""
    import torch

    from flowforge.tools.plan import plan_config

    torch.set_num_threads(max(1, torch.get_num_threads()))
    spec, cfg = case_config(name)
    plan = plan_config(cfg, 1, "h100-80gb", spec=spec, alternatives=False)
    predicted = max(plan.phases["rollout"], plan.phases["train"])
    out = measure_step(spec, cfg)
    out.update({"case": name, "predicted_peak_bytes": predicted, "ratio": predicted / out["measured_peak_bytes"],
                "plan": plan.as_dict()})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {list(CASES) + list(EXTRA_CASES)}")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    names = args.cases.split(",")
    bad = [n for n in names if n not in {**CASES, **EXTRA_CASES}]
    if bad:
        print(f"error: --cases: {bad} not in {list(CASES) + list(EXTRA_CASES)}", file=sys.stderr)
        return 2
    results = []
    for name in names:
        r = check(name)
        results.append(r)
        print(f"{name}: measured {r['measured_peak_bytes'] / 1e9:.3f} GB, planned {r['predicted_peak_bytes'] / 1e9:.3f}"
              f" GB, ratio {r['ratio']:.3f} ({r['params'] / 1e6:.0f}M params, step {r['step_s']:.1f} s)", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
