"""The shipped demo base policy (``demo:base``) loads and generates recognisable, prompt-dependent digits."""
import json

import torch

from flowforge.models import build_adapter
from flowforge.models.base import FlowModel
from flowforge.demo.paths import demo_base_dir, resolve_demo_path


def test_shipped_files_and_config():
    d = demo_base_dir()
    assert (d / "config.json").is_file() and (d / "diffusion_pytorch_model.safetensors").is_file()
    assert json.loads((d / "flowforge.json").read_text()) == {"text_encoder": "minilm", "max_length": 16}
    assert (d / "diffusion_pytorch_model.safetensors").stat().st_size < 12_000_000


def test_demo_base_generates_requested_digits():
    from flowforge.algorithms.schedules import flow_match_sigmas
    from flowforge.demo.classifiers import digit_eval_accuracy
    from flowforge.rollout import generate

    adapter = build_adapter("sd3", resolve_demo_path("demo:base"), dtype=torch.float32, device="cpu")
    assert isinstance(adapter, FlowModel)
    assert not adapter.transformer.training
    assert adapter.latent_shape(32, 32) == (1, 32, 32)
    assert 2_000_000 < sum(p.numel() for p in adapter.transformer.parameters()) < 3_000_000
    digits = list(range(10)) * 2
    cond = adapter.encode([f"a handwritten number {d}" for d in digits])
    x_T = torch.randn(len(digits), 1, 32, 32, generator=torch.Generator().manual_seed(0))
    images = adapter.decode(generate(adapter, cond, x_T, flow_match_sigmas(10, 3.0), 1.0))
    assert images.shape == (20, 3, 32, 32) and 0 <= images.min() and images.max() <= 1
    # chance is 0.1; the base sits around 0.8 (see flowforge/demo/weights/base/README.md)
    assert digit_eval_accuracy(images, digits) >= 0.25
