"""The world-model network: shapes, the zero-gate coupling identity, action binning, the transition heads."""

import pytest
import torch

from flowforge.models.world_model.config import WorldModelConfig
from flowforge.models.world_model.layers import fsq
from flowforge.models.world_model.tiny import build_world_model, test_config, tiny_config


def _inputs(model, b=2, f=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    x = torch.randn(b, cfg.in_channels, f, cfg.sample_size, cfg.sample_size, generator=gen)
    actions = torch.nn.functional.one_hot(torch.randint(0, 3, (b, cfg.video_frames(f)), generator=gen), 3).float()
    return x, torch.rand(b, generator=gen), actions, x[:, :, :1].clone()


def test_shapes_and_zero_velocity_on_the_condition_slot():
    model = build_world_model(test_config(), seed=0)
    x, sigma, actions, first = _inputs(model)
    with torch.no_grad():
        v = model(x, sigma, actions, first)
        logits = model.transition_logits(first, actions, 8)
        labels = model.transition_labels(x)
    assert v.shape == x.shape and v.dtype == torch.float32
    assert bool((v[:, :, 0] == 0).all()) and float(v[:, :, 1:].abs().mean()) > 0
    k = model.config.codebook_size
    assert logits.shape == (2, 7, 4, k) and labels.shape == (2, 7, 4)
    assert labels.dtype == torch.int64 and 0 <= int(labels.min()) and int(labels.max()) < k
    assert torch.isfinite(model.transition_tokenizer.reconstruction_loss(x))


def test_zero_gate_makes_the_coupling_path_the_identity():
    model = build_world_model(test_config(), seed=0)
    x, sigma, actions, first = _inputs(model)
    assert all(float(b.coupling.gate.detach()) == 0.0 for b in model.blocks)  # the init
    with torch.no_grad():
        ref = model(x, sigma, actions, first)
        for block in model.blocks:  # any coupling weights at all: no effect while the gate is 0
            for name in ("q", "k", "v", "out"):
                getattr(block.coupling, name).weight.normal_()
        for p in model.latent_state_rollout.parameters():
            p.add_(torch.randn_like(p))
        assert torch.equal(model(x, sigma, actions, first), ref)
        model.blocks[0].coupling.gate.fill_(0.5)
        assert not torch.allclose(model(x, sigma, actions, first), ref)


def test_actions_and_first_frame_reach_the_velocity():
    model = build_world_model(test_config(), seed=0)
    with torch.no_grad():
        for block in model.blocks:
            block.coupling.gate.fill_(0.5)
    x, sigma, actions, first = _inputs(model)
    with torch.no_grad():
        ref = model(x, sigma, actions, first)
        assert not torch.allclose(model(x, sigma, actions.roll(1, dims=1), first), ref)
        assert not torch.allclose(model(x, sigma, actions, first + 0.5), ref)


def test_action_bins_general_temporal_factor():
    model = build_world_model(test_config(temporal_factor=4, max_frames=3), seed=0)
    ids = torch.tensor([[0, 1, 1, 2, 2, 0, 0, 0, 1]])
    bins = model.bin_actions(torch.nn.functional.one_hot(ids, 3).float(), 3)
    assert bins.shape == (1, 3, 3)
    assert torch.equal(bins[0, 0], torch.tensor([1.0, 0.0, 0.0]))
    assert torch.allclose(bins[0, 1], torch.tensor([0.0, 0.5, 0.5]))
    assert torch.allclose(bins[0, 2], torch.tensor([0.75, 0.25, 0.0]))
    with pytest.raises(ValueError, match="actions must be"):
        model.bin_actions(torch.zeros(1, 8, 3), 3)


def test_state_rollout_uses_the_first_f_minus_1_bins_and_step_0_is_frozen_only():
    model = build_world_model(test_config(), seed=0)
    x, _, actions, first = _inputs(model)
    with torch.no_grad():
        bins = model.bin_actions(actions, 8)
        states = model.latent_state_rollout(first, bins)
        changed = bins.clone()
        changed[:, -1] = torch.tensor([0.0, 0.0, 1.0]) - changed[:, -1]  # the last bin has no successor frame
        assert states.shape == (2, 8, 4, model.config.state_dim)
        assert torch.equal(model.latent_state_rollout(first, changed), states)
    logits = model.transition_logits(first, actions, 8)
    transition = list(model.latent_state_rollout.transition.parameters())
    grads = torch.autograd.grad(logits[:, 0].sum(), transition, allow_unused=True, retain_graph=True)
    # step 0 of the transition CE reads s_0 (initializer) only: no gradient reaches B
    assert all(g is None or not bool(g.any()) for g in grads)
    grads = torch.autograd.grad(logits[:, 1].sum(), transition, allow_unused=True)
    assert any(g is not None and float(g.abs().sum()) > 0 for g in grads)


def test_fsq_codes_and_indices():
    codes, index = fsq(torch.tensor([[-10.0, 0.0, 10.0], [0.3, -0.3, 0.0]]), (3, 3, 3))
    assert torch.equal(codes, torch.tensor([[-1.0, 0.0, 1.0], [0.0, 0.0, 0.0]]))
    assert index.tolist() == [0 * 9 + 1 * 3 + 2, 1 * 9 + 1 * 3 + 1]


def test_config_validation_and_round_trip():
    cfg = tiny_config()
    assert WorldModelConfig.from_dict(cfg.to_dict()) == cfg and cfg.codebook_size == 27
    with pytest.raises(ValueError, match="odd"):
        tiny_config(fsq_levels=(4, 3))
    with pytest.raises(ValueError, match="multiple"):
        tiny_config(patch_size=5)
    with pytest.raises(ValueError, match="unknown"):
        WorldModelConfig.from_dict({"width": 3})


def test_without_direct_actions_the_actions_reach_the_video_only_through_the_open_coupling():
    model = build_world_model(test_config(direct_actions=False), seed=0)
    assert model.action_embed is None and WorldModelConfig.from_dict(model.config.to_dict()) == model.config
    x, sigma, actions, first = _inputs(model)
    other = actions.roll(1, dims=1)
    with torch.no_grad():
        assert torch.equal(model(x, sigma, actions, first), model(x, sigma, other, first))  # gates at 0: blind
        for block in model.blocks:
            block.coupling.gate.fill_(0.5)
        assert not torch.allclose(model(x, sigma, actions, first), model(x, sigma, other, first))
    with pytest.raises(ValueError, match="direct_actions"):
        test_config(direct_actions=1)


def test_action_history_conditions_each_frame_on_the_commands_before_it():
    bins = torch.nn.functional.one_hot(torch.tensor([[0, 1, 2, 1, 1, 2, 0, 0]]), 3).float()
    later = bins.clone()
    later[0, 5] = torch.tensor([0.0, 1.0, 0.0])  # only frame 5's command changes
    sigma = torch.tensor([0.5])
    for history in (True, False):
        model = build_world_model(test_config(action_history=history), seed=0)
        assert (model.history_embed is not None) == history
        with torch.no_grad():
            a, b = model.frame_conditioning(sigma, bins), model.frame_conditioning(sigma, later)
        same = [bool(torch.equal(a[0, j], b[0, j])) for j in range(8)]
        # frames 0-4 never see frame 5's command; frame 5 sees it as its own bin; 6-7 only through the history
        assert same == [True] * 5 + [False] + [not history] * 2
    plain = build_world_model(test_config(action_history=False), seed=0).state_dict()
    with_history = build_world_model(test_config(action_history=True), seed=0).state_dict()
    assert all(torch.equal(v, with_history[k]) for k, v in plain.items())  # the history is initialised last
    assert not tiny_config().action_history  # demo:world was made without it
    with pytest.raises(ValueError, match="needs direct_actions"):
        test_config(direct_actions=False, action_history=True)
    with pytest.raises(ValueError, match="action_history must be"):
        test_config(action_history="yes")


def test_direct_keep_zero_sends_the_actions_only_through_the_latent_state():
    """``direct_keep`` 0 gives a row's direct action path the null actions: that row's velocity no longer depends on
    ``action_embed`` / ``history_embed`` (equal to :func:`without_direct_actions`), the direct path gets no gradient
    and the coupling gates do; 1 (and None) is today's forward, bit for bit; rows are independent."""
    from flowforge.models.world_model.network import without_direct_actions

    model = build_world_model(test_config(action_history=True), seed=0)
    x, sigma, actions, first = _inputs(model)
    with torch.no_grad():
        for block in model.blocks:
            block.coupling.gate.fill_(0.1)
        plain = model(x, sigma, actions, first)
        assert torch.equal(model(x, sigma, actions, first, direct_keep=torch.ones(2)), plain)
        mixed = model(x, sigma, actions, first, direct_keep=torch.tensor([1.0, 0.0]))
        assert torch.equal(mixed[0], plain[0]) and not torch.allclose(mixed[1], plain[1])
        blind = without_direct_actions(model)
        assert torch.equal(blind(x, sigma, actions, first), model(x, sigma, actions, first, direct_keep=torch.zeros(2)))
        assert not torch.equal(model.action_embed.weight, torch.zeros_like(model.action_embed.weight))  # a copy
    model.train()
    model(x, sigma, actions, first, direct_keep=torch.zeros(2)).square().mean().backward()
    for layer in (model.action_embed, model.history_embed):
        assert torch.count_nonzero(layer.weight.grad) == 0
    assert all(float(b.coupling.gate.grad.abs().max()) > 0 for b in model.blocks)
    assert float(model.latent_state_rollout.transition.action_embed.weight.grad.abs().max()) > 0  # B still reads them
