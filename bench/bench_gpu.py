"""bf16 replay throughput of an SD3.5-Medium-sized transformer at 512x512 (64x64 latents) on one GPU.

    python bench/bench_gpu.py [--batch 8] [--iters 10]

Replays FlowGRPO steps the way training does (forward with grad through the SD3 adapter, the SDE transition
log-prob, the clipped surrogate, backward) on a random-init ``SD3Transformer2DModel`` with SD3.5-Medium's config
(no download). Prints transitions/s, model FLOP/s utilization against the device's dense bf16 peak, and peak memory
with and without activation checkpointing (diffusers' gradient checkpointing of the blocks). Exits cleanly where
CUDA is not available.
"""

import argparse
import sys
import time

import torch

SD35_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                   attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                   caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
                   dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12}
TEXT_TOKENS = 333  # T5 256 + CLIP 77


def model_flops(params: int, layers: int, width: int, tokens: int, batch: int) -> float:
    """Forward + backward FLOPs: 6 N T for the weights plus 3 x 4 T^2 D per layer for attention."""
    return batch * (6 * params * tokens + 3 * 4 * layers * tokens**2 * width)


def run(batch: int, iters: int, checkpointing: bool) -> tuple[float, float, float]:
    from diffusers import SD3Transformer2DModel

    from flowforge.algorithms import losses
    from flowforge.algorithms.sde import transition
    from flowforge.models.base import Conditioning
    from flowforge.models.sd3 import SD3Adapter

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

    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / iters
    params = sum(p.numel() for p in model.parameters())
    tokens = (64 // 2) ** 2 + TEXT_TOKENS
    flops = model_flops(params, SD35_MEDIUM["num_layers"], 64 * 24, tokens, batch) / dt
    return batch / dt, flops, torch.cuda.max_memory_allocated() / 2**30


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: CUDA is not available; skipped")
        return 0
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    print(f"device: {name}; SD3.5-Medium-sized transformer, 512x512 (64x64 latents), bf16, batch {args.batch}")
    for ckpt in (False, True):
        tps, flops, mem = run(args.batch, args.iters, ckpt)
        mfu = f"{flops / peak:.1%}" if peak else "unknown peak"
        print(f"activation checkpointing {'on ' if ckpt else 'off'}: {tps:.1f} transitions/s, "
              f"{flops / 1e12:.0f} TFLOP/s ({mfu} MFU), peak memory {mem:.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
