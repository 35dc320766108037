"""Wan 2.2 A14B (two experts) against the real diffusers ``WanPipeline`` with ``transformer_2`` / ``boundary_ratio``,
on tiny random experts (tests/models/tiny_families.py's Wan parts; the low-noise expert is a second seed)."""
from __future__ import annotations

import copy

import pytest
import torch

from flowforge.models import build_adapter
from flowforge.models.lora import inject_lora, lora_parameters
from flowforge.models.wan.adapter import WanAdapter, wan_text
from flowforge.models.wan.experts import EXPERTS, WanExperts, expert_lora_targets
from tests.models import tiny_families as tiny

PROMPTS = ["a red cat sitting under a tree", "two dogs"]
SEQ_LEN, MIN_TOK, STEPS, GUIDANCE = 16, 10, 4, 4.0
LATENT = (4, 3, 2, 2)  # 9 frames of 16x16


def experts_components(boundary_ratio: float, seed: int = 0, **kw) -> dict:
    """``WanPipeline`` parts with a second, differently seeded transformer as the low-noise expert."""
    c = tiny.wan_components(seed, **kw)
    c["transformer_2"] = tiny.wan_components(seed + 1, **kw)["transformer"]
    c["boundary_ratio"] = boundary_ratio
    return c


def _timesteps() -> torch.Tensor:
    sched = copy.deepcopy(tiny.wan_components()["scheduler"])
    sched.set_timesteps(STEPS)
    return sched.timesteps.clone()


@pytest.fixture(scope="module")
def parts():
    """Boundary placed exactly on the pipeline's third timestep (its ``t == boundary`` case: high-noise expert)."""
    ratio = float(_timesteps()[2]) / 1000.0
    c = experts_components(ratio)
    text = wan_text(components={k: c[k] for k in ("tokenizer", "text_encoder")}, max_sequence_length=SEQ_LEN,
                    min_tokenizer_size=MIN_TOK)
    module = WanExperts(c["transformer"], c["transformer_2"], boundary_ratio=ratio)
    adapter = WanAdapter(module, text, c["vae"], scheduler_config=dict(c["scheduler"].config))
    from diffusers import WanPipeline

    return c, adapter, WanPipeline(**c)


def _run_pipeline(pipe, x):
    """Pipeline latents after the last step, its video [B, 3, F, H, W], its sigmas, and which expert ran each call."""
    calls, captured = [], {}
    hooks = [getattr(pipe, name).register_forward_pre_hook(
        lambda m, a, kw, name=name: calls.append((name, float(kw["timestep"].flatten()[0]))), with_kwargs=True)
        for name in EXPERTS]

    def grab(p, i, t, kw):
        captured["latents"] = kw["latents"].detach().clone()
        return {}

    try:
        with torch.no_grad():
            out = pipe(prompt=PROMPTS, height=16, width=16, num_frames=9, num_inference_steps=STEPS,
                       latents=x.clone(), output_type="pt", guidance_scale=GUIDANCE, negative_prompt="",
                       max_sequence_length=SEQ_LEN, callback_on_step_end=grab,
                       callback_on_step_end_tensor_inputs=["latents"])
    finally:
        for h in hooks:
            h.remove()
    return captured["latents"].float(), out.frames.permute(0, 2, 1, 3, 4), pipe.scheduler.sigmas.clone(), calls


def test_expert_switch_matches_the_pipeline(parts):
    """Each pipeline forward (cond and uncond per step) ran the expert the adapter picks for that timestep, the
    boundary timestep itself included (``t >= boundary``: high noise); both experts ran."""
    _, adapter, pipe = parts
    x = torch.randn(2, *LATENT, generator=torch.Generator().manual_seed(0))
    _, _, sigmas, calls = _run_pipeline(pipe, x)
    assert len(calls) == 2 * STEPS
    picked = [adapter.transformer.expert_of(sigmas[i].expand(1))[0] for i in range(STEPS)]
    assert [name for name, _ in calls] == [p for p in picked for _ in range(2)]
    assert picked == ["transformer", "transformer", "transformer", "transformer_2"]  # step 2 sits on the boundary
    b = adapter.transformer.boundary_timestep
    t = torch.tensor([b, b], dtype=torch.float32)
    t[1] = torch.nextafter(t[1], torch.tensor(0.0))
    assert adapter.transformer.high_noise_rows(t).tolist() == [True, False]


def test_velocity_is_the_experts_forward_bitwise(parts):
    """A uniform batch: the adapter's velocity is the pipeline's call of that expert, bit for bit; a mixed batch
    (one row each side) gives each row its expert's output for that row alone."""
    c, adapter, _ = parts
    cond = adapter.encode(PROMPTS)
    x = torch.randn(2, *LATENT, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for sigma, expert in ((0.9, c["transformer"]), (0.2, c["transformer_2"])):
            s = torch.full((2,), sigma)
            ref = expert(hidden_states=x, timestep=1000.0 * s, encoder_hidden_states=cond.prompt_embeds,
                         return_dict=False)[0]
            assert torch.equal(adapter.velocity(x, s, cond, 1.0), ref)
        mixed = adapter.velocity(x, torch.tensor([0.9, 0.2]), cond, 1.0)
        for row, (sigma, expert) in enumerate(((0.9, c["transformer"]), (0.2, c["transformer_2"]))):
            ref = expert(hidden_states=x[row:row + 1], timestep=torch.tensor([1000.0 * sigma]),
                         encoder_hidden_states=cond.prompt_embeds[row:row + 1], return_dict=False)[0]
            assert torch.equal(mixed[row:row + 1], ref)
        assert (mixed[0] - mixed[1]).abs().max() > 0


def test_generation_reproduces_the_pipeline(parts):
    """Four Euler steps (``transition("ode")``, the scheduler's step) with CFG over the pipeline's sigmas (two
    experts, switch at step 3) give its latents and its decoded video bit for bit: the adapter runs the conditional
    and the unconditional forward separately, as the pipeline (max abs differences printed)."""
    from flowforge.algorithms.sde import transition

    _, adapter, pipe = parts
    x = torch.randn(2, *LATENT, generator=torch.Generator().manual_seed(3))
    final, video, sigmas, _ = _run_pipeline(pipe, x)
    cond = adapter.encode(PROMPTS)
    y = x.clone()
    with torch.no_grad():
        for i in range(STEPS):
            v = adapter.velocity(y, sigmas[i].expand(2), cond, GUIDANCE)
            y = transition("ode", y, v, sigmas[i], sigmas[i + 1], 0.0).x_next
        decoded = adapter.decode(y)
    print(f"Wan 2.2 experts, CFG {GUIDANCE}: latents max abs diff {(y - final).abs().max().item():.3g}, "
          f"video {(decoded - video.float()).abs().max().item():.3g}")
    assert torch.equal(y, final) and torch.equal(decoded, video.float())
    assert (y - x).abs().max() > 1e-3
    # not vacuous: one expert alone gives another video
    alone = WanAdapter(pipe.transformer, adapter.text_encoder, adapter.vae)
    z = x.clone()
    with torch.no_grad():
        for i in range(STEPS):
            z = z + (sigmas[i + 1] - sigmas[i]) * alone.velocity(z, sigmas[i].expand(2), cond, GUIDANCE)
    assert (z - final).abs().max() > 1e-4


def test_saved_pipeline_loads_both_experts(parts, tmp_path):
    c, adapter, pipe = parts
    pipe.save_pretrained(str(tmp_path))
    loaded = build_adapter("wan", str(tmp_path), max_sequence_length=SEQ_LEN, min_tokenizer_size=MIN_TOK)
    assert type(loaded) is WanAdapter and isinstance(loaded.transformer, WanExperts)
    assert loaded.transformer.boundary_ratio == adapter.transformer.boundary_ratio
    assert loaded.blocks() == [*loaded.transformer.transformer.blocks, *loaded.transformer.transformer_2.blocks]
    cond = loaded.encode(PROMPTS)
    x = torch.randn(2, *LATENT, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for s in ([0.9, 0.2], [0.2, 0.9]):
            s = torch.tensor(s)
            assert torch.equal(loaded.velocity(x, s, cond, GUIDANCE), adapter.velocity(x, s, cond, GUIDANCE))


def test_refuses_half_a_two_expert_directory(parts, tmp_path):
    import json

    parts[2].save_pretrained(str(tmp_path))
    index = json.loads((tmp_path / "model_index.json").read_text())
    index.pop("transformer_2")
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="transformer_2"):
        build_adapter("wan", str(tmp_path), max_sequence_length=SEQ_LEN, min_tokenizer_size=MIN_TOK)
    with pytest.raises(ValueError, match="boundary_ratio"):
        WanExperts(parts[0]["transformer"], parts[0]["transformer_2"], boundary_ratio=1.0)


def test_lora_on_one_expert_leaves_the_other_exact(parts):
    """LoRA on the low-noise expert only (``expert_lora_targets``): after moving its B weights, high-noise rows
    are unchanged bit for bit and low-noise rows change; the default targets cover both experts."""
    _, adapter, _ = parts
    module = copy.deepcopy(adapter.transformer)
    targets = expert_lora_targets(module, ["transformer_2"], adapter.lora_targets)
    assert targets[0] == "transformer_2.blocks.0.attn1.to_q"
    params = inject_lora(module, 4, 4.0, targets)
    assert params and all(name.startswith("transformer_2.")
                          for name in lora_parameters(module, "default"))
    other = copy.copy(adapter)
    other.transformer = module
    cond = adapter.encode(PROMPTS)
    x = torch.randn(2, *LATENT, generator=torch.Generator().manual_seed(7))
    s = torch.tensor([0.9, 0.2])
    with torch.no_grad():
        before = other.velocity(x, s, cond, 1.0)
        for p in params:
            p.add_(0.05)
        after = other.velocity(x, s, cond, 1.0)
    assert torch.equal(after[0], before[0]) and (after[1] - before[1]).abs().max() > 1e-4
    both = copy.deepcopy(adapter.transformer)
    names = lora_parameters(both, "default") if inject_lora(both, 4, 4.0, adapter.lora_targets) else {}
    assert {n.split(".")[0] for n in names} == set(EXPERTS)
    with pytest.raises(ValueError, match="expert"):
        expert_lora_targets(module, ["low"], adapter.lora_targets)
