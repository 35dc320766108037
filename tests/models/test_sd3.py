"""SD3 adapter on a tiny transformer built from a config (no downloads)."""
import pytest
import torch

from flowforge.demo.model import build_tiny_sd3, test_sd3_config, tiny_sd3_config
from flowforge.models import ADAPTERS, build_adapter
from flowforge.models.base import Conditioning, FlowModel
from flowforge.models.sd3.adapter import SD3_LORA_TARGETS, SD3Adapter, load_sd3


class FakeText:
    """Deterministic stand-in for a text encoder: embeddings from a hash of the prompt."""

    encoder_id = "fake"

    def encode(self, prompts):
        rows = [torch.Generator().manual_seed(sum(map(ord, p)) + 7 * len(p)) for p in prompts]
        embeds = torch.stack([torch.randn(16, 384, generator=g) for g in rows])
        pooled = torch.stack([torch.randn(384, generator=g) for g in rows])
        return embeds, torch.ones(len(prompts), 16, dtype=torch.long), pooled


@pytest.fixture(scope="module")
def adapter():
    return SD3Adapter(build_tiny_sd3(test_sd3_config(), seed=0), FakeText())


def _inputs(b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 1, 32, 32, generator=g), torch.rand(b, generator=g)


def test_is_flow_model_and_eval_mode(adapter):
    assert isinstance(adapter, FlowModel)
    assert not adapter.transformer.training
    assert len(adapter.blocks()) == 2
    assert adapter.latent_shape(32, 32) == (1, 32, 32)
    with pytest.raises(ValueError):
        adapter.latent_shape(31, 32)
    with pytest.raises(ValueError):
        adapter.latent_shape(32, 32, frames=4)


def test_velocity_shape_dtype_fp32_even_in_bf16():
    a = SD3Adapter(build_tiny_sd3(test_sd3_config(), seed=0).to(torch.bfloat16), FakeText())
    x, s = _inputs()
    v = a.velocity(x, s, a.encode(["a", "b", "c"]), 1.0)
    assert v.shape == x.shape and v.dtype == torch.float32


def test_transformer_receives_1000_sigma(adapter):
    seen = {}

    def hook(module, args, kwargs):
        seen["timestep"] = kwargs["timestep"].clone()

    handle = adapter.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        x, s = _inputs()
        adapter.velocity(x, s, adapter.encode(["a", "b", "c"]), 1.0)
    finally:
        handle.remove()
    torch.testing.assert_close(seen["timestep"], 1000 * s, rtol=0, atol=1e-4)


def test_velocity_depends_on_prompt_and_sigma(adapter):
    x, s = _inputs()
    cond = adapter.encode(["one", "two", "three"])
    v = adapter.velocity(x, s, cond, 1.0)
    v_other = adapter.velocity(x, s, adapter.encode(["nine", "eight", "seven"]), 1.0)
    v_sigma = adapter.velocity(x, s * 0.5, cond, 1.0)
    assert (v - v_other).abs().max() > 1e-4
    assert (v - v_sigma).abs().max() > 1e-4


def test_guidance_one_is_conditional_only_and_cfg_formula(adapter):
    x, s = _inputs()
    cond = adapter.encode(["one", "two", "three"])
    v_c = adapter.velocity(x, s, Conditioning(cond.prompt_embeds, cond.pooled, cond.mask), 1.0)
    assert torch.equal(adapter.velocity(x, s, cond, 1.0), v_c)
    v_u = adapter.velocity(x, s, cond.negative, 1.0)
    v_g = adapter.velocity(x, s, cond, 4.0)
    torch.testing.assert_close(v_g, v_u + 4.0 * (v_c - v_u), rtol=1e-4, atol=1e-4)
    assert (v_g - v_c).abs().max() > 1e-3
    with pytest.raises(ValueError, match="negative"):
        adapter.velocity(x, s, Conditioning(cond.prompt_embeds, cond.pooled), 2.0)


def test_velocity_rejects_bad_sigma(adapter):
    x, s = _inputs()
    with pytest.raises(ValueError, match="sigma"):
        adapter.velocity(x, s[:2], adapter.encode(["a", "b", "c"]), 1.0)


def test_encode_negative_is_empty_prompt(adapter):
    cond = adapter.encode(["x", "y"])
    empty = adapter.encode([""])
    assert torch.equal(cond.negative.prompt_embeds[1], empty.prompt_embeds[0])
    assert torch.equal(cond.negative.prompt_embeds[0], cond.negative.prompt_embeds[1])


def test_pixel_decode_and_encode_images(adapter):
    x = torch.tensor([-2.0, -1.0, 0.0, 1.0]).view(1, 1, 2, 2)
    img = adapter.decode(x)
    assert img.shape == (1, 3, 2, 2) and img.dtype == torch.float32
    assert torch.equal(img[0, 0].flatten(), torch.tensor([0.0, 0.0, 0.5, 1.0]))
    assert torch.equal(img[0, 0], img[0, 2])
    pix = torch.rand(2, 1, 32, 32)
    torch.testing.assert_close(adapter.decode(adapter.encode_images(pix))[:, :1], pix)


def test_default_lora_targets_exist():
    model = build_tiny_sd3(test_sd3_config(), seed=0)
    names = [n for n, _ in model.named_modules()]
    for target in SD3_LORA_TARGETS:
        assert any(n.endswith(target) for n in names), target


def test_tiny_config_size():
    n = sum(p.numel() for p in build_tiny_sd3(tiny_sd3_config(), seed=0).parameters())
    assert 2_000_000 <= n <= 3_000_000


def test_registry_errors_and_bring_your_own(tmp_path):
    assert "sd3" in ADAPTERS
    with pytest.raises(ValueError, match="allowed"):
        build_adapter("nope", "demo:base")
    with pytest.raises(ValueError, match="no attribute"):
        build_adapter("flowforge.models.sd3.adapter:Nope", "demo:base")
    with pytest.raises(TypeError, match="FlowModel"):
        build_adapter("builtins:list", "x")
    with pytest.raises(FileNotFoundError):
        load_sd3(tmp_path)
    with pytest.raises(FileNotFoundError, match="resolve_demo_path"):  # demo names are resolved above models/
        load_sd3("demo:base")


def test_load_bare_transformer_dir_with_meta(tmp_path):
    model = build_tiny_sd3(test_sd3_config(), seed=3)
    model.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="text_encoder"):
        load_sd3(tmp_path)
    (tmp_path / "flowforge.json").write_text('{"text_encoder": "minilm", "max_length": 8}')
    a = build_adapter("flowforge.models.sd3.adapter:SD3Adapter", str(tmp_path))
    assert a.text_encoder.max_length == 8 and not a.text_encoder.loaded
    x, s = _inputs()
    cond = Conditioning(torch.randn(3, 8, 384), torch.randn(3, 384))
    torch.testing.assert_close(a.velocity(x, s, cond, 1.0), SD3Adapter(model).velocity(x, s, cond, 1.0))
