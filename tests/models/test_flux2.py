"""FLUX.2 Klein adapter (flowforge/models/flux2/adapter.py) against diffusers' ``Flux2KleinPipeline`` on a tiny random
pipeline (tests/models/tiny_image_families.py): velocity == the pipeline's transformer call, a whole ODE generation
(flowforge's Euler transition over the pipeline's sigmas) == the pipeline's latents and images, bitwise in fp32;
the few-step grid's first SDE step."""
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
SIZE = (16, 16)  # pixels; patchified latent [16, 4, 4]


@pytest.fixture(scope="module")
def parts():
    from diffusers import Flux2KleinPipeline

    from flowforge.models.flux2.adapter import Flux2KleinAdapter, flux2_klein_text

    c = tiny.flux2_klein_components()
    text = flux2_klein_text(components={k: c[k] for k in ("tokenizer", "text_encoder")},
                            max_sequence_length=SEQ_LEN, min_tokenizer_size=MIN_TOK)
    adapter = Flux2KleinAdapter(c["transformer"], text, c["vae"], scheduler_config=dict(c["scheduler"].config))
    return dict(adapter=adapter, pipe=Flux2KleinPipeline(**c), cond=adapter.encode(PROMPTS))


def _latents(seed: int = 0) -> torch.Tensor:
    return torch.randn(len(PROMPTS), 16, 4, 4, generator=torch.Generator().manual_seed(seed))


def test_registered_protocol_and_geometry(parts):
    a = parts["adapter"]
    assert "flux2" in ADAPTERS and isinstance(a, FlowModel)
    assert a.tasks == ("t2i", "i2i") and a.latent_shape(*SIZE) == (16, 4, 4)
    with pytest.raises(ValueError):
        a.latent_shape(18, 16)
    names = [n for n, _ in a.transformer.named_modules()]
    for target in a.lora_targets:
        assert any(n.endswith(target) for n in names), target
    assert len(a.blocks()) == 2


def test_velocity_is_the_pipeline_transformer_call(parts):
    """Adapter velocity == the pipeline's call: packed tokens, ids, ``t.to(dtype) / 1000``, bitwise."""
    a, pipe = parts["adapter"], parts["pipe"]
    x, sigma = _latents(1), torch.tensor([0.37, 0.81])
    with torch.no_grad():
        embeds, text_ids = pipe.encode_prompt(list(PROMPTS), max_sequence_length=SEQ_LEN)
        tokens = pipe._pack_latents(x)
        out = pipe.transformer(hidden_states=tokens, timestep=(sigma * 1000) / 1000, guidance=None,
                               encoder_hidden_states=embeds, txt_ids=text_ids,
                               img_ids=pipe._prepare_latent_ids(x), return_dict=False)[0]
        expected = pipe._unpack_latents_with_ids(out, pipe._prepare_latent_ids(x), 4, 4)
        v = a.velocity(x, sigma, parts["cond"], 1.0)
    assert torch.equal(parts["cond"].prompt_embeds, embeds)
    assert v.dtype == torch.float32 and torch.equal(v, expected)


# guidance-free (0.5: the pipeline's `guidance_scale > 1` is false; 1: distilled use) and true CFG (base Klein)
@pytest.mark.parametrize("guidance", [0.5, 1.0, 4.0])
def test_whole_generation_matches_the_pipeline(parts, guidance):
    a, pipe = parts["adapter"], parts["pipe"]
    x = _latents(3)
    captured = {}

    def grab(p, i, t, kw):
        captured["latents"] = kw["latents"].clone()
        return {}

    with torch.no_grad():
        out = pipe(prompt=list(PROMPTS), height=SIZE[0], width=SIZE[1], num_inference_steps=4, latents=x.clone(),
                   guidance_scale=guidance, output_type="pt", max_sequence_length=SEQ_LEN, callback_on_step_end=grab)
    sigmas = a.pipeline_sigmas(4, *SIZE)
    assert torch.equal(sigmas, pipe.scheduler.sigmas)
    y = x.clone()
    with torch.no_grad():
        for i in range(4):
            v = a.velocity(y, sigmas[i].expand(2), parts["cond"], guidance)
            y = transition("ode", y, v, sigmas[i], sigmas[i + 1], 0.0).x_next
        images = a.decode(y)
    final = pipe._unpack_latents_with_ids(captured["latents"], pipe._prepare_latent_ids(x), 4, 4)
    assert (y - x).abs().max() > 0.5
    assert torch.equal(y, final)  # max abs diff 0
    assert torch.equal(images, out.images.float())


def test_distilled_ignores_guidance(parts):
    from flowforge.models.flux2.adapter import Flux2KleinAdapter

    a = parts["adapter"]
    d = Flux2KleinAdapter(a.transformer, is_distilled=True)
    x, s = _latents(2), torch.tensor([0.5, 0.9])
    with torch.no_grad():
        assert torch.equal(d.velocity(x, s, parts["cond"], 4.0), a.velocity(x, s, parts["cond"], 1.0))
        assert not torch.equal(a.velocity(x, s, parts["cond"], 4.0), a.velocity(x, s, parts["cond"], 1.0))


def test_few_step_sde_first_sigma(parts):
    """4-step grid: the SDE step at sigma = 1 has std eta, finite mean / log-prob, and replays to the same log-prob."""
    a = parts["adapter"]
    sigmas = a.pipeline_sigmas(4, *SIZE)
    assert sigmas[0] == 1 and sigmas[-1] == 0
    x = _latents(4)
    with torch.no_grad():
        v = a.velocity(x, sigmas[0].expand(2), parts["cond"], 1.0)
        step = transition("sde", x, v, sigmas[0].expand(2), sigmas[1], 0.5, generator=torch.Generator().manual_seed(0))
        replay = transition("sde", x, v, sigmas[0].expand(2), sigmas[1], 0.5, x_next=step.x_next)
    torch.testing.assert_close(step.std, torch.full((2,), 0.5), rtol=1e-5, atol=0)
    assert torch.isfinite(step.mean).all() and torch.equal(replay.log_prob, step.log_prob)


def test_save_pretrained_loads_through_registry(parts, tmp_path):
    parts["pipe"].save_pretrained(str(tmp_path))
    loaded = build_adapter("flux2", str(tmp_path), max_sequence_length=SEQ_LEN, min_tokenizer_size=MIN_TOK)
    assert type(loaded) is type(parts["adapter"]) and not loaded.is_distilled
    cond = loaded.encode(PROMPTS)
    assert torch.equal(cond.prompt_embeds, parts["cond"].prompt_embeds)
    x, s = _latents(5), torch.tensor([0.2, 0.9])
    with torch.no_grad():
        assert torch.equal(loaded.velocity(x, s, cond, 4.0), parts["adapter"].velocity(x, s, parts["cond"], 4.0))
