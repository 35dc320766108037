"""Issue 44, "Real size on CPU": one GRPO LoRA step of the SD3.5-Medium transformer at its real size (2.24B
parameters, random init from the published config) on the CPU, through bench/gpu_acceptance.py's own
:func:`grpo_stepper` -- the same code the GPU acceptance times, with a GRPO group of 2 candidates of 1 prompt."""

import contextlib
import importlib.util
import math
import time
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_acceptance.py"


class _NoHook:
    def remove(self):
        pass


@contextlib.contextmanager
def _peak_tracker(module, optimizer):
    """torch's MemTracker over ``module`` (weights, gradients, activations) and ``optimizer`` (its state), entered.

    Two adjustments for a GRPO LoRA step (torch 2.13): MemTracker puts a gradient hook on every parameter of every
    module it sees run, and ``register_hook`` raises on a parameter that does not require grad -- the frozen base
    weights, which have no gradient to count, are entered as already hooked, with handles that remove nothing. And
    it takes a second call of the root module for a second iteration and refuses it, while one GRPO step calls the
    transformer once per denoising step and again in replay: its per-module statistics are cleared before each root
    call (a global hook registered first runs before MemTracker's). The device-wide peak, which is what is read,
    is kept across them."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(module, optimizer)
    for param in module.parameters():
        if not param.requires_grad:
            tracker._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())

    def reset(mod, args):
        if mod is module:
            tracker.reset_mod_stats()

    handle = torch.nn.modules.module.register_module_forward_pre_hook(reset)
    try:
        with tracker:
            yield tracker
    finally:
        handle.remove()


def _module():
    spec = importlib.util.spec_from_file_location("gpu_acceptance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # builds the 2.24B-parameter model (4.5 GB in bf16) and runs one step: see docs/guides/scaling.md
def test_sd35_medium_grpo_lora_step_at_real_size_on_cpu():
    """SD3.5-Medium's real transformer (24 layers, 24 heads x 64, joint 4096, caption 1536, pooled 2048, dual
    attention in layers 0..12, RMS qk-norm) in bf16 with fp32 LoRA r32 masters (as ``model.dtype=bfloat16`` trains;
    no autocast), random text embeddings of the real shapes (333 x 4096 tokens, pooled 2048), 256 px (16 x 32 x 32
    latents), 2 denoising steps (1 trained), 1 prompt x 2 candidates. The loss is finite, the first update's ratio is
    exactly 1, and torch's own MemTracker records the peak of the step (weights, LoRA, gradients, AdamW state,
    activations), which is printed beside the time."""
    ga = _module()
    name = "sd35m_grpo_lora"
    config, _, run, _ = ga.PARTS[name]
    r = dict(run, prompts=1, group=2, micro=2)  # the smallest GRPO group; everything else is the GPU run's
    cpu = torch.device("cpu")
    started = time.perf_counter()
    adapter, policy, latent_shape, step = ga.grpo_stepper(name, config, r, cpu)
    build_s = time.perf_counter() - started
    params = list(adapter.transformer.parameters())
    assert 2.2e9 < sum(p.numel() for p in params) < 2.3e9
    assert {p.dtype for p in params if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in params if p.requires_grad} == {torch.float32}
    assert latent_shape == (16, 32, 32)

    with _peak_tracker(adapter.transformer, policy.optimizer) as tracker:
        rollout_s, update_s, trained, metrics = step(0)
    peak = tracker.get_tracker_snapshot("peak")[cpu]
    loss, dev = float(metrics["loss"]), float(metrics["first_update_ratio_dev"])
    print(f"\nSD3.5-M real size on CPU: build {build_s:.1f} s, rollout {rollout_s:.1f} s, update {update_s:.1f} s, "
          f"loss {loss:.6g}, first ratio dev {dev:g}, MemTracker peak {peak['Total'] / 2**30:.2f} GiB "
          f"({ {getattr(k, 'value', k): round(v / 2**30, 3) for k, v in peak.items() if k != 'Total'} })")
    assert trained == 1
    assert math.isfinite(loss)
    assert dev == 0.0  # the first update starts on-policy, exactly
    weights = sum(p.numel() * p.element_size() for p in params)
    assert peak["Total"] > weights  # the step held the whole model at once, plus its training state
