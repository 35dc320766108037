"""bench/gpu_acceptance.py at tiny sizes on the CPU: every field of its JSON is there and finite, the GRPO steps
start at ratio exactly 1, bad arguments are one line (exit 2); the real-size configs build and (SD3.5-M) run a
forward on the meta device (no memory, no compute)."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_acceptance.py"
PARTS = ("sd35m_grpo_lora", "qwen_image_flowgrpo")
PART_FIELDS = {"resolution", "latent_shape", "num_steps", "timed_steps", "trained_steps", "batch", "micro_batch",
               "text_tokens", "activation_checkpointing", "params", "trainable_params", "build_s", "rollout_s",
               "update_s", "step_s", "transitions_per_s", "images_per_s", "forward_flops_per_micro_batch", "step_flops",
               "mfu", "peak_memory_gib", "first_update_ratio_dev", "loss", "config"}


def _run(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def _numbers(value, path=""):
    """Every number inside ``value`` (nested dicts / lists) with its path."""
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _numbers(v, f"{path}[{i}]")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("acceptance") / "results.json"
    proc = _run("--device", "cpu", "--tiny", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_tiny_cpu_run_writes_every_field_finite(results):
    res, stdout = results
    assert {"device", "tiny", "torch", "peak_flops", "peak_source", "flops_counting", "gpu_tests", "seconds",
            *PARTS} <= res.keys()
    assert res["device"] == "cpu" and res["tiny"] is True
    tests = res["gpu_tests"]
    assert tests.keys() == {"passed", "failed", "skipped", "returncode", "seconds"}
    assert tests["failed"] == 0 and tests["passed"] + tests["skipped"] >= 7  # skipped here: no CUDA
    for part in PARTS:
        m = res[part]
        assert PART_FIELDS <= m.keys(), PART_FIELDS - m.keys()
        assert m["first_update_ratio_dev"] == 0.0  # the GRPO step's first update starts on-policy, exactly
        assert m["trainable_params"] > 0 and m["step_flops"] > 0 and m["mfu"] > 0 and m["peak_memory_gib"] > 0
        assert m["step_s"] == pytest.approx(m["rollout_s"] + m["update_s"])
    assert res["sd35m_grpo_lora"]["trained_steps"] == 1 and res["sd35m_grpo_lora"]["num_steps"] == 2
    q = res["qwen_image_flowgrpo"]
    assert q["num_steps"] == 8 and q["trained_steps"] == 7 and q["reference_images_per_gpu_s"] == 0.51
    numbers = dict(_numbers(res))
    assert len(numbers) > 40
    bad = {k: v for k, v in numbers.items() if not math.isfinite(v)}
    assert not bad
    for line in ("tests/gpu:", "sd35m_grpo_lora:", "qwen_image_flowgrpo:", "verl-omni published 0.51"):
        assert line in stdout


@pytest.mark.parametrize("args,names", [
    (["--device", "tpu"], "--device='tpu'"),
    (["--device", "cpu"], "--device=cpu needs --tiny"),
    (["--tiny", "--bogus"], "--bogus"),
    (["--device", "cuda", "--tiny"], "CUDA is not available"),
    (["--device", "cpu", "--tiny", "--out", "{tmp}"], "is a directory"),
])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, args, names):
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    proc = _run(*[a.format(tmp=tmp_path) for a in args])
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and names in lines[0], proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


def _module():
    spec = importlib.util.spec_from_file_location("gpu_acceptance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # builds the real-size models on the meta device, real widths at depth 1 on the CPU (~40 s)
def test_real_size_models_build_and_run_real_shapes():
    """The script's real-size path as far as the CPU goes. On the meta device (no memory, no compute) SD3.5-Medium
    (2.24B transformer parameters) and Qwen-Image (20.4B) build from the configs, and an SD3.5-M velocity runs at the
    real shapes (8 x 16 x 32 x 32 latents, 333 x 4096 text tokens). Qwen-Image's masked attention needs real data
    (torch.nonzero has no meta kernel), so both also run one real forward on the CPU at their real widths, text
    lengths and resolutions with a single layer: finite fp32 velocities of the latent's shape."""
    from torch.utils.flop_counter import FlopCounterMode

    ga = _module()
    meta, cpu = torch.device("meta"), torch.device("cpu")
    counts = {}
    for name, (config, _, run, _) in ga.PARTS.items():
        adapter = ga.build(name, config, meta)
        counts[name] = sum(p.numel() for p in adapter.transformer.parameters())
        assert {p.dtype for p in adapter.transformer.parameters()} == {torch.bfloat16}
        side = run["px"] // ga.VAE_FACTOR
        shape = (16, side, side)
        if name.startswith("sd35m"):
            cond = ga.conditioning(name, config, run["micro"], run["text_tokens"], meta)
            x = torch.zeros(run["micro"], *shape, device=meta)
            with torch.no_grad(), FlopCounterMode(display=False) as counter:
                v = adapter.velocity(x, torch.full((run["micro"],), 0.5, device=meta), cond, 1.0)
            assert v.shape == x.shape and v.dtype == torch.float32
            assert 0.8e12 < counter.get_total_flops() / run["micro"] < 1.0e12  # ~0.91 TFLOP an image at 256 px
        one_layer = ga.build(name, dict(config, num_layers=1), cpu)
        x = torch.randn(1, *shape, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            v = one_layer.velocity(x, torch.full((1,), 0.5), ga.conditioning(name, config, 1, run["text_tokens"], cpu),
                                   1.0)
        assert v.shape == x.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
    assert 2.2e9 < counts["sd35m_grpo_lora"] < 2.3e9 and 20.3e9 < counts["qwen_image_flowgrpo"] < 20.5e9
