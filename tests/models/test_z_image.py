"""Z-Image / Z-Image-Turbo adapter (flowforge/models/z_image/adapter.py) against diffusers' ``ZImagePipeline`` on a tiny
random pipeline (tests/models/tiny_image_families.py): velocity == the pipeline's transformer call, a whole ODE
generation (flowforge's Euler transition over the pipeline's sigmas) == the pipeline's latents and images, bitwise in
fp32; the few-step (Turbo) schedule's first SDE step."""
from __future__ import annotations

import pytest
import torch

from flowforge.algorithms.sde import transition
from flowforge.models import ADAPTERS, build_adapter
from flowforge.models.base import FlowModel
from tests.models import tiny_image_families as tiny

PROMPTS = ["a red cat sitting under a tree", "two dogs"]
SEQ_LEN = 32
MIN_TOK = 10
SIZE = (16, 16)  # pixels; latent [4, 8, 8]


@pytest.fixture(scope="module")
def parts():
    from diffusers import ZImagePipeline

    from flowforge.models.z_image.adapter import ZImageAdapter, z_image_text

    c = tiny.z_image_components()
    text = z_image_text(components={k: c[k] for k in ("tokenizer", "text_encoder")}, max_sequence_length=SEQ_LEN,
                        min_tokenizer_size=MIN_TOK)
    adapter = ZImageAdapter(c["transformer"], text, c["vae"], scheduler_config=dict(c["scheduler"].config))
    return dict(components=c, adapter=adapter, pipe=ZImagePipeline(**c), cond=adapter.encode(PROMPTS))


def _latents(seed: int = 0) -> torch.Tensor:
    return torch.randn(len(PROMPTS), 4, 8, 8, generator=torch.Generator().manual_seed(seed))


def test_registered_protocol_and_geometry(parts):
    a = parts["adapter"]
    assert "z_image" in ADAPTERS and isinstance(a, FlowModel)
    assert a.tasks == ("t2i",) and a.latent_shape(*SIZE) == (4, 8, 8)
    with pytest.raises(ValueError):
        a.latent_shape(18, 16)
    names = [n for n, _ in a.transformer.named_modules()]
    for target in a.lora_targets:
        assert sum(n.endswith(target) for n in names) == 3  # noise refiner, context refiner, main layer
    assert len(a.blocks()) == 3 and all(type(b).__name__ == "ZImageTransformerBlock" for b in a.blocks())


def test_encoding_is_the_pipelines(parts):
    """cond.prompt_embeds cut by cond.mask == ZImagePipeline.encode_prompt's variable-length list; negative ""."""
    cond, pipe = parts["cond"], parts["pipe"]
    with torch.no_grad():
        pos, neg = pipe.encode_prompt(list(PROMPTS), negative_prompt=None, max_sequence_length=SEQ_LEN)
    assert cond.mask.sum(1).tolist() == [len(p) for p in pos] and cond.mask.sum(1)[0] > cond.mask.sum(1)[1]
    for i in range(2):
        n = len(pos[i])
        assert torch.equal(cond.prompt_embeds[i, :n], pos[i]) and cond.prompt_embeds[i, n:].abs().max() == 0
        assert torch.equal(cond.negative.prompt_embeds[i, : len(neg[i])], neg[i])


def test_velocity_is_the_pipeline_transformer_call(parts):
    """Adapter velocity == ``-transformer(list(x.unsqueeze(2)), (1000 - 1000 sigma) / 1000, embeds)``, bitwise."""
    a, pipe = parts["adapter"], parts["pipe"]
    x, sigma = _latents(1), torch.tensor([0.37, 0.81])
    with torch.no_grad():
        pos, _ = pipe.encode_prompt(list(PROMPTS), do_classifier_free_guidance=False, max_sequence_length=SEQ_LEN)
        t = (1000 - sigma * 1000) / 1000
        out = pipe.transformer(list(x.unsqueeze(2).unbind(0)), t, pos, return_dict=False)[0]
        v = a.velocity(x, sigma, parts["cond"], 1.0)
    expected = -torch.stack([o.float() for o in out]).squeeze(2)
    assert v.dtype == torch.float32 and torch.equal(v, expected)
    with torch.no_grad():
        assert (a.velocity(x, sigma, parts["cond"].index([1, 0]), 1.0) - v).abs().max() > 1e-5


# flowforge g = 0.5 (the pipeline's -0.5: not > 0, so no CFG), 1 (Turbo, guidance-free) and 4 (true CFG)
@pytest.mark.parametrize("pipeline_guidance", [-0.5, 0.0, 3.0])
def test_whole_generation_matches_the_pipeline(parts, pipeline_guidance):
    """4 Euler steps of flowforge's ``transition("ode")`` with the adapter's velocity (flowforge g = 1 + the
    pipeline's guidance_scale) over the adapter's pipeline_sigmas == ZImagePipeline's final latents and images,
    bitwise in fp32, at flowforge guidance 0.5, 1 and 4."""
    a, pipe = parts["adapter"], parts["pipe"]
    x = _latents(3)
    captured = {}

    def grab(p, i, t, kw):
        captured["latents"] = kw["latents"].clone()
        return {}

    with torch.no_grad():
        out = pipe(prompt=list(PROMPTS), height=SIZE[0], width=SIZE[1], num_inference_steps=4, latents=x.clone(),
                   guidance_scale=pipeline_guidance, output_type="pt", max_sequence_length=SEQ_LEN,
                   callback_on_step_end=grab)
    sigmas = a.pipeline_sigmas(4, *SIZE)
    assert torch.equal(sigmas, pipe.scheduler.sigmas)
    y = x.clone()
    with torch.no_grad():
        for i in range(4):
            v = a.velocity(y, sigmas[i].expand(2), parts["cond"], 1.0 + pipeline_guidance)
            y = transition("ode", y, v, sigmas[i], sigmas[i + 1], 0.0).x_next
        images = a.decode(y)
    assert (y - x).abs().max() > 0.5
    assert torch.equal(y, captured["latents"])  # max abs diff 0
    assert torch.equal(images, out.images.float())


def test_dynamic_shift_config_schedule():
    """A config with use_dynamic_shifting: mu from (H/2)(W/2) tokens, as the pipeline computes it."""
    from diffusers import ZImagePipeline

    from flowforge.algorithms.schedules import calculate_shift
    from flowforge.models.z_image.adapter import ZImageAdapter

    c = tiny.z_image_components(dynamic=True)
    a = ZImageAdapter(c["transformer"], vae=c["vae"], scheduler_config=dict(c["scheduler"].config))
    assert a.schedule_mu(32, 32) == pytest.approx(calculate_shift(64, 256, 4096, 0.5, 1.15))
    pipe = ZImagePipeline(**c)
    with torch.no_grad():
        pipe(prompt_embeds=[torch.zeros(3, 16)], height=32, width=32, num_inference_steps=3, guidance_scale=0.0,
             output_type="latent")
    assert torch.equal(a.pipeline_sigmas(3, 32, 32), pipe.scheduler.sigmas)
    static = ZImageAdapter(c["transformer"], scheduler_config={"shift": 3.0})  # use_dynamic_shifting omitted: off
    assert static.pipeline_sigmas(4, 32, 32)[1].item() == pytest.approx(3 * 0.75 / (1 + 2 * 0.75))


def test_few_step_sde_first_sigma_and_grid(parts):
    """Turbo's 8-step shift-3 grid: the SDE step at sigma = 1 has std eta exactly, finite mean / log-prob, and
    replaying the sampled step scores the same log-prob (what makes GRPO's first ratio 1)."""
    a = parts["adapter"]
    sigmas = a.pipeline_sigmas(8, *SIZE)
    assert sigmas[0] == 1 and sigmas[-1] == 0 and len(sigmas) == 9
    x = _latents(4)
    s = sigmas[0].expand(2)
    with torch.no_grad():
        v = a.velocity(x, s, parts["cond"], 1.0)
        eta = 0.5
        step = transition("sde", x, v, s, sigmas[1], eta, generator=torch.Generator().manual_seed(0))
        replay = transition("sde", x, v, s, sigmas[1], eta, x_next=step.x_next)
    torch.testing.assert_close(step.std, torch.full((2,), eta), rtol=1e-5, atol=0)
    assert torch.isfinite(step.mean).all() and torch.isfinite(step.log_prob).all()
    assert torch.equal(replay.log_prob, step.log_prob)


def test_save_pretrained_loads_through_registry(parts, tmp_path):
    parts["pipe"].save_pretrained(str(tmp_path))
    loaded = build_adapter("z_image", str(tmp_path), max_sequence_length=SEQ_LEN, min_tokenizer_size=MIN_TOK)
    assert type(loaded) is type(parts["adapter"]) and str(tmp_path.resolve()) in loaded.encoder_id
    cond = loaded.encode(PROMPTS)
    assert torch.equal(cond.prompt_embeds, parts["cond"].prompt_embeds)
    x, s = _latents(5), torch.tensor([0.2, 0.9])
    with torch.no_grad():
        for g in (1.0, 4.0):
            assert torch.equal(loaded.velocity(x, s, cond, g), parts["adapter"].velocity(x, s, parts["cond"], g))
    with pytest.raises(ValueError):
        build_adapter("z_image", str(tmp_path), task="i2i")
