"""The shipped world-model demo: demo:world loads with every parameter from the checkpoint, its prompt sets are real
i2v records split by episode, and the world-model SFT writes a model that loads like demo:world."""

import json

import pytest

import torch

from flowforge.data.atari import AtariDataConfig
from flowforge.data.prompts import load_prompts
from flowforge.demo.paths import demo_world_dir, resolve_demo_path
from flowforge.models import build_adapter
from flowforge.settings.sections import DataConfig, RunConfig, SamplerConfig, SFTConfig


def test_demo_world_loads_with_full_provenance():
    path = resolve_demo_path("demo:world")
    assert path == demo_world_dir()
    adapter = build_adapter("world_model", str(path), task="i2v")
    assert {r.status for r in adapter.provenance} == {"loaded"}
    assert adapter.latent_shape(32, 32, 8) == (1, 8, 32, 32)
    assert (path / "diffusion_pytorch_model.safetensors").stat().st_size < 10_000_000  # like demo:base's budget


def test_world_prompt_sets_are_i2v_and_split_by_episode():
    train, held = load_prompts("demo:world-train"), load_prompts("demo:world-eval")
    assert len(train) == 128 and len(held) == 32
    assert all(r.metadata["task"] == "i2v" and len(r.prompt.split()) == 8 for r in train + held)
    assert not {r.metadata["clip"] for r in train} & {r.metadata["clip"] for r in held}
    assert not {r.metadata["episode"] for r in train} & {r.metadata["episode"] for r in held}  # split by episode


def test_world_sft_writes_a_model_that_loads_like_demo_world(tmp_path):
    from flowforge.train.sft.world import run_world_sft

    out = tmp_path / "world"
    sft = SFTConfig(steps=2, batch_size=2, eval_every=0, output=str(out), warmup_steps=1)
    small = AtariDataConfig(episodes=2, heldout_every=2, max_steps=24, seed=2)
    history = run_world_sft(sft, run=RunConfig(seed=0), data=DataConfig(cache_dir=str(tmp_path / "cache")),
                            sampler=SamplerConfig(num_steps=2), eval_clips=2, clips_config=small)
    assert [h["step"] for h in history] == [0, 2] and "fm" in history[-1] and "psnr" in history[-1]
    assert {"action_following_other", "coupling_gate_max"} <= set(history[-1])  # the null and the gates logged
    loaded = build_adapter("world_model", str(out), task="i2v")
    gates = history[-1]["coupling_gates"]  # every block's |gate| in order, the largest being coupling_gate_max
    assert gates == [float(b.coupling.gate.abs().max()) for b in loaded.transformer.blocks]
    assert max(gates) == history[-1]["coupling_gate_max"]
    shipped = json.loads((demo_world_dir() / "config.json").read_text())
    from flowforge.models.world_model.config import WorldModelConfig

    written = json.loads((out / "config.json").read_text())
    assert WorldModelConfig.from_dict(written) == WorldModelConfig.from_dict(shipped)  # demo:world's architecture
    gates = [float(b.coupling.gate.detach()) for b in loaded.transformer.blocks]
    assert all(abs(g) < 0.01 for g in gates)  # the coupling gates start at 0 and 2 steps barely move them
    assert {r.status for r in loaded.provenance} == {"loaded"}
    assert torch.isfinite(next(loaded.transformer.parameters())).all()


def test_world_sft_gate_init_paddle_weight_and_checkpoints(tmp_path):
    from flowforge.train.sft.world import run_world_sft

    out = tmp_path / "world"
    sft = SFTConfig(steps=2, batch_size=2, eval_every=1, output=str(out), warmup_steps=1, lr=1e-4,
                    coupling_gate_init=0.25, paddle_weight=10.0)
    small = AtariDataConfig(episodes=2, heldout_every=2, max_steps=24, seed=2)
    history = run_world_sft(sft, run=RunConfig(seed=0), data=DataConfig(cache_dir=str(tmp_path / "cache")),
                            sampler=SamplerConfig(num_steps=2), eval_clips=2, clips_config=small)
    assert [h["step"] for h in history] == [0, 1, 2]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    final = build_adapter("world_model", str(out), task="i2v").transformer.state_dict()
    last = build_adapter("world_model", str(out / "checkpoints" / "step_000002"), task="i2v").transformer.state_dict()
    assert all(torch.equal(v, last[k]) for k, v in final.items())  # the last checkpoint is the saved model
    gates = [float(v) for k, v in final.items() if k.endswith("coupling.gate")]
    assert len(gates) == 4 and all(abs(g - 0.25) < 0.01 for g in gates)  # started at 0.25, 2 small steps
    from flowforge.settings.schema import ConfigError

    for bad in ({"paddle_weight": 0.0}, {"coupling_gate_init": float("nan")}, {"paddle_rows": -1}):
        with pytest.raises(ConfigError, match="paddle|coupling_gate_init"):
            SFTConfig(**bad)
    assert not SFTConfig(paddle_rows=0).problems()


@pytest.mark.slow  # 15-30 s of training on 2 cores: CI runs it in the slow set (the default run stays near 10 min)
def test_world_sft_lr_schedule_decays_after_the_first_step(tmp_path):
    """``sft.lr_schedule`` is the RL trainer's ``lr_lambda``: without warmup, linear decay leaves step 1 at the
    full LR (the same weights as a constant run) and scales step 2 by 2/3 (other weights)."""
    from flowforge.train.sft.world import run_world_sft

    small = AtariDataConfig(episodes=2, heldout_every=2, max_steps=24, seed=2)
    weights = {}
    for schedule in ("constant", "linear"):
        out = tmp_path / schedule
        sft = SFTConfig(steps=3, batch_size=2, eval_every=1, output=str(out), warmup_steps=0, lr_schedule=schedule)
        run_world_sft(sft, run=RunConfig(seed=0), data=DataConfig(cache_dir=str(tmp_path / "cache")),
                      sampler=SamplerConfig(num_steps=2), eval_clips=1, clips_config=small)
        weights[schedule] = [build_adapter("world_model", str(out / "checkpoints" / f"step_00000{k}"),
                                           task="i2v").transformer.state_dict() for k in (1, 2)]
    (c1, c2), (l1, l2) = weights["constant"], weights["linear"]
    assert all(torch.equal(v, l1[k]) for k, v in c1.items())
    assert any(not torch.equal(v, l2[k]) for k, v in c2.items())
    from flowforge.settings.schema import ConfigError

    with pytest.raises(ConfigError, match=r"sft.lr_schedule='step' is not one of \['constant', 'linear', 'cosine'\]"):
        SFTConfig(lr_schedule="step")


def test_world_sft_direct_action_dropout_routes_every_clip_through_the_latent_state(tmp_path):
    """``sft.direct_action_dropout=1``: no clip's actions enter the direct path, so ``action_embed.weight`` gets no
    gradient and stays at its seeded init (AdamW, no weight decay) while the gates move; the evaluation logs the
    state-only action following. Out-of-range values are refused naming the field."""
    from flowforge.models.world_model.tiny import build_world_model
    from flowforge.settings.schema import ConfigError
    from flowforge.train.sft.world import run_world_sft

    out = tmp_path / "world"
    sft = SFTConfig(steps=2, batch_size=2, eval_every=0, output=str(out), warmup_steps=1, coupling_gate_init=0.1,
                    direct_action_dropout=1.0, save_checkpoints=False)
    small = AtariDataConfig(episodes=2, heldout_every=2, max_steps=24, seed=2)
    history = run_world_sft(sft, run=RunConfig(seed=0), data=DataConfig(cache_dir=str(tmp_path / "cache")),
                            sampler=SamplerConfig(num_steps=2), eval_clips=2, clips_config=small)
    assert "action_following_state_only" in history[-1]
    trained = build_adapter("world_model", str(out), task="i2v").transformer
    init = build_world_model(seed=0)
    assert torch.equal(trained.action_embed.weight, init.action_embed.weight)
    assert not torch.equal(trained.latent_state_rollout.transition.action_embed.weight,
                           init.latent_state_rollout.transition.action_embed.weight)
    assert all(not torch.equal(b.coupling.gate, torch.full_like(b.coupling.gate, 0.1)) for b in trained.blocks)
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError, match=r"sft.direct_action_dropout=.* must be in \[0, 1\]"):
            SFTConfig(direct_action_dropout=bad)


def test_world_sft_loss_with_every_direct_path_kept_is_todays_loss():
    """``direct_keep`` all 1 gives the same loss, bit for bit, as the default path (``adapter.velocity``), so
    ``sft.direct_action_dropout=0`` (no mask drawn at all) trains exactly as before."""
    from flowforge.models.world_model.adapter import WorldModelAdapter
    from flowforge.models.world_model.tiny import build_world_model, test_config
    from flowforge.train.sft.world import world_sft_loss

    adapter = WorldModelAdapter(build_world_model(test_config(), seed=0))
    gen = torch.Generator().manual_seed(0)
    x0 = torch.rand(2, 1, 8, 32, 32, generator=gen) * 2 - 1
    actions = torch.nn.functional.one_hot(torch.randint(0, 3, (2, 8), generator=gen), 3).float()
    noise, sigma = torch.randn(x0.shape, generator=gen), torch.rand(2, generator=gen)
    today, _ = world_sft_loss(adapter, x0, actions, noise, sigma)
    kept, _ = world_sft_loss(adapter, x0, actions, noise, sigma, direct_keep=torch.ones(2))
    dropped, _ = world_sft_loss(adapter, x0, actions, noise, sigma, direct_keep=torch.zeros(2))
    assert torch.equal(today, kept) and not torch.equal(today, dropped)
