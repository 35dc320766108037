"""GPU acceptance in one run (one H100 / H200, meant to finish in under 10 minutes): the GPU tests, a real-size
SD3.5-Medium GRPO LoRA step and a Qwen-Image-sized FlowGRPO step, printed and written as JSON.

    python bench/gpu_acceptance.py [--device cuda] [--out results.json]
    python bench/gpu_acceptance.py --device cpu --tiny --out results.json   # the same code at tiny sizes (seconds)

1. ``python -m pytest -q -n 0 -m gpu tests/gpu``: counts of passed / failed / skipped (skipped without CUDA).
2. **SD3.5-Medium GRPO LoRA step**: a random-init diffusers ``SD3Transformer2DModel`` with SD3.5-Medium's published
   transformer config (:data:`SD35_MEDIUM`; 2.24B parameters), text embeddings of the real shapes (333 tokens =
   CLIP 77 + T5 256 of width 4096, pooled 2048) drawn at random, 256 px (32x32 latents), 2 denoising steps (the
   first is the trained SDE step; the last is never trained), 2 prompts x 8 candidates, micro-batch 8.
3. **Qwen-Image-sized FlowGRPO step**: a random-init ``QwenImageTransformer2DModel`` with Qwen-Image's config
   (diffusers' defaults, :data:`QWEN_IMAGE`; 20B parameters), 512 px, 8 denoising steps, no CFG, every
   non-degenerate step trained (7, flow_grpo's ``timestep_fraction`` ~1), 2 prompts x 4 candidates, micro-batch 2,
   activation checkpointing; reported in images/GPU/s beside verl-omni's published 0.51 (their number, their
   setting: not reproduced here).

Each part: one untimed warm-up step, then the mean of 3 (SD3.5-M) / 2 (Qwen-Image) timed steps.

A step is flowforge's own stages 2 and 5: :func:`flowforge.rollout.rollout_chunked` under the sampling policy,
then the ``grpo`` objective's ``optimize`` (replay, clipped surrogate, backward, AdamW; no KL term, as
``grpo.kl_weight`` defaults to 0) on random advantages (rewards are not what is measured), LoRA r32 / alpha 64 on
the adapter's default targets. Precision as ``model.dtype=bfloat16`` trains: frozen weights in bf16, LoRA masters in
fp32, log-probs in fp32 (flowforge does not use ``torch.autocast``).

FLOPs: one velocity forward at the micro-batch's shape is counted by torch's ``FlopCounterMode``; a step counts
``num_steps`` forwards per rollout chunk and 3 forwards (forward + backward as 2x) per trained transition
(activation-checkpointing recomputation is not counted: model FLOPs, not hardware FLOPs). MFU = step FLOPs / step
time / the device's dense bf16 peak (:func:`flowforge.train.perf.device_peak`: the datasheet's for a known GPU,
else a measured matrix product, as on the CPU). Peak memory: ``torch.cuda.max_memory_allocated`` per part (the
process's max RSS on the CPU). Bad arguments: one line ``error: ...``, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported after the arguments are checked (a bad argument answers at once)
    import torch

ROOT = Path(__file__).resolve().parents[1]
VERL_OMNI_IMAGES_PER_GPU_S = 0.51  # verl-omni's published Qwen-Image FlowGRPO throughput (as cited in issue 44)

# SD3.5-Medium's transformer/config.json (stabilityai/stable-diffusion-3.5-medium)
SD35_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                   attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                   caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
                   dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
# Qwen-Image's transformer/config.json (Qwen/Qwen-Image) = diffusers' QwenImageTransformer2DModel defaults
QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))

# name -> (model config, tiny config, run settings, tiny run settings)
PARTS = {
    "sd35m_grpo_lora": (
        SD35_MEDIUM,
        dict(SD35_MEDIUM, num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
             caption_projection_dim=32, pooled_projection_dim=32, pos_embed_max_size=16, sample_size=8,
             dual_attention_layers=(0,)),
        dict(px=256, steps=2, prompts=2, group=8, micro=8, text_tokens=333, checkpointing=False, timed=3),
        dict(px=64, steps=2, prompts=2, group=4, micro=4, text_tokens=7, checkpointing=False, timed=2)),
    "qwen_image_flowgrpo": (
        QWEN_IMAGE,
        dict(QWEN_IMAGE, num_layers=1, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
             axes_dims_rope=(4, 6, 6)),
        dict(px=512, steps=8, prompts=2, group=4, micro=2, text_tokens=128, checkpointing=True, timed=2),
        dict(px=64, steps=8, prompts=2, group=2, micro=2, text_tokens=5, checkpointing=True, timed=2)),
}
VAE_FACTOR = 8  # pixels per latent cell of the SD3 and Qwen-Image VAEs (the VAEs themselves are not built)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (flowforge's convention), instead of usage + message
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse(argv):
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (cpu needs --tiny)")
    p.add_argument("--tiny", action="store_true", help="tiny model sizes (runs on the CPU in seconds)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--skip-tests", action="store_true", help="do not run tests/gpu")
    args = p.parse_args(argv)
    kind, _, index = args.device.partition(":")
    if kind not in ("cuda", "cpu") or (index and (kind != "cuda" or not index.isdigit())):
        p.error(f"--device={args.device!r} is not one of cuda, cuda:N, cpu")
    if kind == "cpu" and not args.tiny:
        p.error("--device=cpu needs --tiny (the real-size models are GPU work)")
    if args.out is not None and args.out.is_dir():
        p.error(f"--out={str(args.out)!r} is a directory; give a file name")
    import torch  # after the cheap checks: a bad argument answers at once

    if kind == "cuda" and not torch.cuda.is_available():
        p.error(f"--device={args.device!r} but CUDA is not available; use --device cpu --tiny")
    return args


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Build modules directly in ``dtype`` (a 20B model in fp32 would not fit beside its bf16 copy)."""
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build(name: str, config: dict, device: torch.device):
    """A random-init transformer of ``config`` built on ``device`` in bf16 behind its flowforge adapter (no VAE, no
    text encoder: conditioning comes from :func:`conditioning`, latent shapes from the VAE factor)."""
    import torch
    from diffusers import QwenImageTransformer2DModel, SD3Transformer2DModel

    from flowforge.models.qwen_image.adapter import QwenImageAdapter
    from flowforge.models.sd3.adapter import SD3Adapter

    torch.manual_seed(0)
    with torch.device(device), default_dtype(torch.bfloat16):
        if name.startswith("sd35m"):
            return SD3Adapter(SD3Transformer2DModel(**config), None)
        return QwenImageAdapter(QwenImageTransformer2DModel(**config), None)


def conditioning(name: str, config: dict, batch: int, tokens: int, device: torch.device):
    """Random text embeddings of the model's real shapes: SD3 ``[B, tokens, joint]`` + pooled ``[B, pooled]``;
    Qwen-Image ``[B, tokens, joint]`` with an all-ones mask."""
    import torch
    from flowforge.models.base import Conditioning

    g = torch.Generator(device="cpu").manual_seed(1)
    embeds = torch.randn(batch, tokens, config["joint_attention_dim"], generator=g).to(device, torch.bfloat16)
    if name.startswith("sd35m"):
        pooled = torch.randn(batch, config["pooled_projection_dim"], generator=g).to(device, torch.bfloat16)
        return Conditioning(prompt_embeds=embeds, pooled=pooled)
    return Conditioning(prompt_embeds=embeds, mask=torch.ones(batch, tokens, dtype=torch.int64, device=device))


def sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gib(device: torch.device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def grpo_stepper(name: str, config: dict, r: dict, device: torch.device):
    """Build part ``name``'s model of ``config`` on ``device`` with run settings ``r`` (the keys of :data:`PARTS`'
    run dicts; ``timed`` is not read) behind a LoRA :class:`~flowforge.policy.Policy` and the ``grpo`` objective.

    Returns ``(adapter, policy, latent_shape, step)``: ``step(step_index)`` is one GRPO LoRA step (rollout, then
    ``optimize`` on random advantages ``[B]``) and returns ``(rollout_s, update_s, trained_steps, metrics)``, where
    ``metrics`` is the objective's dict (``loss``, ``first_update_ratio_dev``, ...). Used by :func:`grpo_step_part`
    and by the real-size CPU test (tests/bench/test_real_size_cpu.py)."""
    import torch

    from flowforge.config import load_config
    from flowforge.objectives import OBJECTIVES, TrainBatch
    from flowforge.objectives.anchors import anchor_policy_bank
    from flowforge.policy import OptimizerSettings, Policy, TrainableWeights
    from flowforge.rollout import rollout_chunked
    from flowforge.rollout.loop import sigmas_for

    batch = r["prompts"] * r["group"]
    cfg = load_config(None, ["train.algorithm=grpo", f"sampler.num_steps={r['steps']}",
                             f"sampler.num_sde_steps={r['steps'] - 1}", "sampler.guidance_scale=1.0",
                             f"data.prompts_per_step={r['prompts']}", f"data.group_size={r['group']}",
                             f"train.micro_batch_size={r['micro']}", "train.num_updates_per_batch=1",
                             "lora.rank=32", "lora.alpha=64", "train.lr=3e-4", "grpo.clip_low=1e-4"])
    adapter = build(name, config, device)
    if r["checkpointing"]:
        adapter.enable_gradient_checkpointing()
    objective_cls = OBJECTIVES["grpo"]
    ctx = objective_cls.context(cfg)
    policy = Policy(adapter, TrainableWeights.from_section(cfg.lora), OptimizerSettings.from_section(cfg.train),
                    total_optimizer_steps=4, **anchor_policy_bank(cfg.anchor, objective_cls.policy_bank(ctx)))
    objective = objective_cls(ctx, adapter, policy)
    side = r["px"] // VAE_FACTOR
    latent_shape = (config["in_channels"] // (4 if name.startswith("qwen") else 1), side, side)
    cond = conditioning(name, config, batch, r["text_tokens"], device)
    sigmas = sigmas_for(cfg.sampler, latent_shape)
    ids = list(range(batch))
    group_ids = torch.arange(batch, device=device) // r["group"]

    def step(step_index: int):
        spec = objective.rollout_spec(step_index)
        t0 = time.perf_counter()
        with policy.using(objective.sampling_policy):
            traj = rollout_chunked(adapter, cond, ids, sigmas, spec, latent_shape=latent_shape, seed=0,
                                   batch_size=r["micro"], device=device)
        sync(device)
        t1 = time.perf_counter()
        adv = torch.randn(batch, generator=torch.Generator().manual_seed(step_index)).to(device)
        metrics = objective.optimize(TrainBatch(traj=traj, cond=cond, advantages=adv, group_ids=group_ids,
                                                rewards=adv, candidate_ids=torch.tensor(ids, device=device),
                                                step=step_index))
        sync(device)
        return t1 - t0, time.perf_counter() - t1, len(traj.trained_steps), metrics

    return adapter, policy, latent_shape, step


def grpo_step_part(name: str, tiny: bool, device: torch.device, peak_flops: float) -> dict:
    """One timed GRPO LoRA step (after one warm-up step) of part ``name``; returns its measurements."""
    import torch

    from torch.utils.flop_counter import FlopCounterMode

    model_cfg, tiny_cfg, run, tiny_run = PARTS[name]
    config, r = (tiny_cfg, tiny_run) if tiny else (model_cfg, run)
    batch = r["prompts"] * r["group"]
    gc.collect()  # the previous part's model, before this part's peak memory is counted
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    adapter, _, latent_shape, step = grpo_stepper(name, config, r, device)
    build_s = time.perf_counter() - started
    params = sum(p.numel() for p in adapter.transformer.parameters())
    trainable = sum(p.numel() for p in adapter.transformer.parameters() if p.requires_grad)
    cond = conditioning(name, config, r["micro"], r["text_tokens"], device)  # the FLOP count's micro-batch

    first = step(0)  # warm-up (kernel selection, allocator); its first update's ratio must be exactly 1
    timed = [step(i) for i in range(1, 1 + r["timed"])]
    rollout_s = sum(t[0] for t in timed) / len(timed)  # means over the timed steps
    update_s = sum(t[1] for t in timed) / len(timed)
    trained, metrics = timed[-1][2], timed[-1][3]
    x = torch.zeros(r["micro"], *latent_shape, device=device)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        adapter.velocity(x, torch.full((r["micro"],), 0.5, device=device), cond, 1.0)
    chunks = batch // r["micro"]
    step_flops = counter.get_total_flops() * chunks * (r["steps"] + 3 * trained)
    step_s = rollout_s + update_s
    out = {"resolution": r["px"], "latent_shape": list(latent_shape), "num_steps": r["steps"],
           "timed_steps": len(timed),
           "trained_steps": trained, "batch": batch, "micro_batch": r["micro"], "text_tokens": r["text_tokens"],
           "activation_checkpointing": r["checkpointing"], "params": params, "trainable_params": trainable,
           "build_s": build_s, "rollout_s": rollout_s, "update_s": update_s, "step_s": step_s,
           "transitions_per_s": batch * trained / step_s, "images_per_s": batch / step_s,
           "forward_flops_per_micro_batch": float(counter.get_total_flops()), "step_flops": float(step_flops),
           "mfu": step_flops / step_s / peak_flops, "peak_memory_gib": peak_memory_gib(device),
           "first_update_ratio_dev": float(first[3]["first_update_ratio_dev"]),
           "loss": float(metrics["loss"]), "config": {k: list(v) if isinstance(v, tuple) else v
                                                            for k, v in config.items()}}
    return out


def gpu_tests(device: torch.device) -> dict:
    """Run ``tests/gpu`` in a subprocess; counts from its JUnit XML."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    if device.type == "cuda":
        env.setdefault("CUDA_VISIBLE_DEVICES", str(device.index or 0))
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "gpu", "-p", "no:cacheprovider",
                               f"--junitxml={xml}", "tests/gpu"], cwd=ROOT, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - started
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    if proc.returncode not in (0, 5):  # 5: nothing collected
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
    return {"passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": counts["failures"] + counts["errors"], "skipped": counts["skipped"],
            "returncode": proc.returncode, "seconds": seconds}


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    import torch

    from flowforge.train.perf import device_peak

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    started = time.perf_counter()
    peak = device_peak(device, torch.bfloat16)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results = {"device": name, "tiny": args.tiny, "torch": torch.__version__, "peak_flops": peak.flops,
               "peak_source": peak.source,
               "flops_counting": "FlopCounterMode on one velocity forward per micro-batch; num_steps forwards per "
                                 "rollout chunk + 3 forwards (backward = 2x) per trained transition; recomputation "
                                 "of activation checkpointing not counted"}
    print(f"device: {name}; bf16 peak {peak.flops / 1e12:.1f} TFLOP/s ({peak.source})", flush=True)
    if not args.skip_tests:
        results["gpu_tests"] = t = gpu_tests(device)
        print(f"tests/gpu: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped ({t['seconds']:.0f} s)",
              flush=True)
    for part in PARTS:
        results[part] = m = grpo_step_part(part, args.tiny, device, peak.flops)
        print(f"{part}: {m['params'] / 1e9:.3f}B params ({m['trainable_params'] / 1e6:.1f}M LoRA), "
              f"{m['resolution']} px, {m['num_steps']} steps ({m['trained_steps']} trained), batch {m['batch']}: "
              f"step {m['step_s']:.2f} s (rollout {m['rollout_s']:.2f} + update {m['update_s']:.2f}), "
              f"{m['transitions_per_s']:.2f} transitions/s, {m['images_per_s']:.3f} images/GPU/s, "
              f"MFU {m['mfu']:.1%}, peak memory {m['peak_memory_gib']:.1f} GiB, "
              f"first ratio dev {m['first_update_ratio_dev']:.1e}", flush=True)
    q = results["qwen_image_flowgrpo"]
    q["reference_images_per_gpu_s"] = VERL_OMNI_IMAGES_PER_GPU_S
    q["reference"] = "verl-omni, published (its own setting; not reproduced here)"
    print(f"Qwen-Image FlowGRPO: {q['images_per_s']:.3f} images/GPU/s; verl-omni published "
          f"{VERL_OMNI_IMAGES_PER_GPU_S} images/GPU/s")
    results["seconds"] = time.perf_counter() - started
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2, allow_nan=False))
    failed = results.get("gpu_tests", {}).get("failed", 0)
    return 1 if failed or not all(math.isfinite(results[p]["loss"]) for p in PARTS) else 0


if __name__ == "__main__":
    sys.exit(main())
