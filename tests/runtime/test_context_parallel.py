"""Context parallelism through diffusers' hooks, on CPU: what one process can check (the accelerator shim, the
plan probe, the checks on a loaded model). The 2-rank equality tests are in tests/test_context_parallel.py."""

import pytest
import torch

from flowforge.config import load_config
from flowforge.runtime import context_parallel as cp
from flowforge.train.preflight.parallel import loaded_context_parallel_problems


@pytest.fixture(scope="module")
def wan():
    from tests.models.families import build_family

    return build_family("wan").adapter


def test_accelerator_count_shim_is_scoped():
    real = torch.accelerator.device_count
    before = real()
    with pytest.raises(RuntimeError, match="inside"):
        with cp.cpu_accelerator_count():
            assert torch.accelerator.device_count() == max(before, 1)
            raise RuntimeError("inside")
    assert torch.accelerator.device_count is real and real() == before  # restored, also after an error


def test_degree_problems():
    assert cp.degree_problems(2, 1, 4) == []
    assert cp.degree_problems(3, 1, 4) == ["distributed.context_parallel: ulysses x ring = 3 x 1 = 3 does not divide "
                                           "the world size 4; launch a multiple of 3 ranks (torchrun --nproc_per_node)"]
    assert cp.degree_problems(0, 1, 4) == ["distributed.context_parallel.ulysses=0 must be an integer >= 1"]


def test_split_sizes_reads_the_plan_on_one_call(wan):
    x = torch.zeros(1, 4, 3, 4, 4)  # 3 latent frames of 4 x 4, patch 1 x 2 x 2: 12 tokens
    cond = wan.encode([""])
    sizes = cp.split_sizes(wan.transformer, lambda: wan.velocity(x, torch.tensor([0.5]), cond, 1.0))
    assert sizes == [("rope output 0", 1, 12), ("rope output 1", 1, 12), ("blocks.0 input 'hidden_states'", 1, 12)]
    assert cp.divisibility_problems(sizes, 2) == []
    (p, *_) = cp.divisibility_problems(sizes, 5, " at here")
    assert p == ("distributed.context_parallel: degree 5 does not divide the 12 tokens of rope output 0 (dim 1) at "
                 "here; choose sizes whose token counts are multiples of 5")
    assert not wan.transformer._forward_pre_hooks and not wan.transformer.blocks[0]._forward_pre_hooks


def test_loaded_model_checks(wan):
    def problems(*overrides):
        cfg = load_config(None, ["model.adapter=wan", "model.task=t2v", *overrides])
        return loaded_context_parallel_problems(cfg, wan)

    assert problems("model.height=32", "model.width=32", "model.frames=9") == []  # off
    on = "distributed.context_parallel.ulysses=2"
    assert problems(on, "model.height=32", "model.width=32", "model.frames=9") == []  # 12 tokens
    odd = problems(on, "model.height=16", "model.width=16", "model.frames=9")  # 3 latent frames of 2 x 2: 3 tokens
    assert odd and all("degree 2 does not divide the 3 tokens" in p and "model.height=16, width=16, frames=9" in p
                       for p in odd)
    assert problems("distributed.context_parallel.ulysses=4") == [
        "distributed.context_parallel.ulysses=4 does not divide the 2 attention heads of WanTransformer3DModel "
        "(Ulysses gives each rank whole heads); use a divisor of 2"]


def test_ltx2_gets_flowforge_plan_ring_only():
    """LTX-2's own plan splits 3-dim RoPE and no audio; flowforge's splits every stream and RoPE in the split layout
    (the sizes read at 32 x 32, 1 frame at 12.5 fps: 256 video + 2 audio tokens); Ulysses is refused in one line."""
    from tests.cp_worker import build

    adapter, _ = build("ltx2")

    def problems(*overrides):
        cfg = load_config(None, ["model.adapter=ltx2", "model.task=t2v", "model.height=32", "model.width=32",
                                 "model.frames=1", *overrides])
        return loaded_context_parallel_problems(cfg, adapter)

    assert problems("distributed.context_parallel.ring=2") == []
    (ulysses,) = problems("distributed.context_parallel.ulysses=2")
    assert ulysses.startswith("distributed.context_parallel.ulysses=2 cannot split LTX2VideoTransformer3DModel: its "
                              "cross-attentions") and ulysses.endswith("use distributed.context_parallel.ring instead")
    assert "\n" not in ulysses
    with pytest.raises(ValueError, match="ulysses=2 cannot split LTX2VideoTransformer3DModel"):
        cp.enable(adapter.transformer, cp.ContextMesh(None, ulysses=2, ring=1))
    x = torch.zeros(1, *adapter.latent_shape(32, 32, 1))
    sizes = cp.split_sizes(adapter.transformer, lambda: adapter.velocity(x, torch.tensor([0.5]), adapter.encode([""]),
                                                                         1.0))
    split = {where: (dim, n) for where, dim, n in sizes}
    assert split["LTX2VideoTransformer3DModel input 'audio_hidden_states'"] == (1, 2)
    assert split["rope output 0"] == (2, 256) and split["cross_attn_audio_rope output 1"] == (2, 2)


def test_enable_refuses_a_transformer_without_a_plan():
    from flowforge.demo.model import build_tiny_sd3, test_sd3_config

    with pytest.raises(ValueError, match="SD3Transformer2DModel declares no _cp_plan"):
        cp.enable(build_tiny_sd3(test_sd3_config(), seed=0), cp.ContextMesh(None, ulysses=2, ring=1))


def test_ring_with_a_backend_without_log_sum_exp_is_refused_in_one_line():
    """On CPU only ``native`` (switched to the CPU flash kernel) carries ring; another backend is refused before
    diffusers' hooks are placed."""
    from tests.models import tiny_families as tiny

    t = tiny.wan_components()["transformer"]
    with pytest.raises(ValueError) as err:
        cp.enable(t, cp.ContextMesh(None, ulysses=1, ring=2), attention_backend="flex")
    assert cp.active_backend(tiny.wan_components()["transformer"]) == "native"  # other models keep the default
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("distributed.context_parallel.ring=2 needs an attention backend that returns "
                                     "the log-sum-exp, one of ['flash',")
    assert "(CUDA; 'native' on CPU); this model uses 'flex'" in str(err.value)


def test_planned_modules_are_the_model_or_its_experts():
    from flowforge.demo.model import build_tiny_sd3, test_sd3_config
    from flowforge.models.wan.experts import WanExperts
    from tests.models import tiny_families as tiny

    one, two = tiny.wan_components(0)["transformer"], tiny.wan_components(1)["transformer"]
    assert cp.planned_modules(one) == [one]
    experts = WanExperts(one, two, boundary_ratio=0.5)
    assert cp.planned_modules(experts) == [one, two]
    assert cp.planned_modules(build_tiny_sd3(test_sd3_config(), seed=0)) == []


def test_scale_gathered_gradients_scales_parameter_gradients_not_the_output(wan):
    t = wan.transformer
    x, cond = torch.randn(1, 4, 3, 4, 4, generator=torch.Generator().manual_seed(0)), wan.encode([""])

    def run():
        t.zero_grad(set_to_none=True)
        w = t.patch_embedding.weight
        w.requires_grad_(True)
        v = wan.velocity(x, torch.tensor([0.5]), cond, 1.0)
        v.square().sum().backward()
        w.requires_grad_(False)
        return v.detach(), w.grad.clone()

    v0, g0 = run()
    handles = cp.scale_gathered_gradients(t, cp.ContextMesh(None, ulysses=2, ring=1))
    assert len(handles) == 1  # Wan gathers at proj_out
    v1, g1 = run()
    for h in handles:
        h.remove()
    assert torch.equal(v1, v0) and torch.allclose(g1, 2 * g0, rtol=1e-6, atol=0)
