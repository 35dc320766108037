"""bf16 rollout and replay throughput of an SD3.5-Medium-sized transformer at 512x512 (64x64 latents) on one GPU.

    python bench/bench_gpu.py [--batch 8] [--iters 10]

On a random-init ``SD3Transformer2DModel`` with SD3.5-Medium's config (no download):

* **rollout**: velocity forwards without grad through the SD3 adapter, as a rollout's denoising steps make them;
* **update**: FlowGRPO replay steps the way training does (forward with grad, the SDE transition log-prob, the
  clipped surrogate, backward), with and without activation checkpointing (diffusers' gradient checkpointing).

Prints transitions/s, MFU and peak memory. MFU is counted as in training (:mod:`flowforge.train.perf`): the FLOPs
of one forward by torch's ``FlopCounterMode``, a backward as twice its forward, against the device's dense bf16 peak
from flowforge's table (measured by a matrix product for a GPU not in it). Exits cleanly where CUDA is not available.
"""

import argparse
import sys
import time

import torch

SD35_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                   attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                   caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
                   dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
TEXT_TOKENS = 333  # T5 256 + CLIP 77


def forward_flops(adapter, x, sigma, cond) -> float:
    """FLOPs of one velocity forward, counted by torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        adapter.velocity(x, sigma, cond, 1.0)
    return counter.get_total_flops()


def run(batch: int, iters: int, checkpointing: bool) -> tuple[float, float, float, float, float]:
    """``(update transitions/s, update FLOP/s, peak GiB, rollout transitions/s, rollout FLOP/s)``."""
    from diffusers import SD3Transformer2DModel

    from flowforge.algorithms import losses
    from flowforge.algorithms.sde import transition
    from flowforge.models.base import Conditioning
    from flowforge.models.sd3.adapter import SD3Adapter

    torch.cuda.reset_peak_memory_stats()
    model = SD3Transformer2DModel(**SD35_MEDIUM).to("cuda", torch.bfloat16).train()
    if checkpointing:
        model.enable_gradient_checkpointing()
    adapter = SD3Adapter(model, None)
    cond = Conditioning(prompt_embeds=torch.randn(batch, TEXT_TOKENS, 4096, device="cuda", dtype=torch.bfloat16),
                        pooled=torch.randn(batch, 2048, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(batch, 16, 64, 64, device="cuda")
    x_next = x + 0.01 * torch.randn_like(x)
    old = torch.zeros(batch, device="cuda")
    adv = torch.randn(batch, device="cuda")
    sigma, sigma_next = torch.full((batch,), 0.8, device="cuda"), torch.full((batch,), 0.7, device="cuda")

    def step():
        v = adapter.velocity(x, sigma, cond, 1.0)
        tr = transition("sde", x, v, sigma, sigma_next, 0.7, x_next=x_next)
        loss, _ = losses.grpo_clip_loss(tr.log_prob, old + tr.log_prob.detach(), adv, 1e-4)
        loss.backward()

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / iters

    flops = forward_flops(adapter, x, sigma, cond)
    dt = timed(step)
    memory = torch.cuda.max_memory_allocated() / 2**30
    with torch.no_grad():
        rollout_dt = timed(lambda: adapter.velocity(x, sigma, cond, 1.0))
    return batch / dt, 3 * flops / dt, memory, batch / rollout_dt, flops / rollout_dt


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: CUDA is not available; skipped")
        return 0
    from flowforge.train.perf import device_peak

    peak = device_peak(torch.device("cuda"), torch.bfloat16)
    print(f"device: {torch.cuda.get_device_name()}; SD3.5-Medium-sized transformer, 512x512 (64x64 latents), bf16, "
          f"batch {args.batch}; peak {peak.flops / 1e12:.0f} TFLOP/s ({peak.source})")
    for ckpt in (False, True):
        tps, flops, mem, rollout_tps, rollout_flops = run(args.batch, args.iters, ckpt)
        if not ckpt:
            print(f"rollout (no grad): {rollout_tps:.1f} transitions/s, {rollout_flops / 1e12:.0f} TFLOP/s "
                  f"(MFU {rollout_flops / peak.flops:.1%})")
        print(f"update, activation checkpointing {'on ' if ckpt else 'off'}: {tps:.1f} transitions/s, "
              f"{flops / 1e12:.0f} TFLOP/s (MFU {flops / peak.flops:.1%}), peak memory {mem:.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
