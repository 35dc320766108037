"""World-model anchor losses on real Breakout clips: gradient reach per parameter mode and term, determinism, the
optimizer-step hook, inactive for other families."""

from pathlib import Path

import pytest
import torch
from tests.models.world_model.wm_helpers import make_adapter

from flowforge.config import LoraConfig, TrainConfig
from flowforge.data import atari
from flowforge.data.atari import AtariDataConfig
from flowforge.objectives.anchors import (REACH_FLOOR, AnchorConfig, AnchorLosses, anchor_policy_bank,
                                         build_anchor)
from flowforge.objectives.base import Objective, ObjectiveContext
from flowforge.policy import OptimizerSettings, Policy, TrainableWeights
from flowforge.settings import SamplerConfig

MODES = {"module": LoraConfig(trainable="module", modules=("latent_state_rollout.transition",)),
         "lora": LoraConfig(trainable="lora", rank=8, alpha=16.0),
         "module+lora": LoraConfig(trainable="module+lora", modules=("latent_state_rollout.transition",), rank=8,
                                   alpha=16.0)}


@pytest.fixture(scope="module")
def clips():
    c = atari.record_clips(AtariDataConfig(episodes=2, heldout_every=2, max_steps=24, seed=1))
    return c.clips(torch.arange(len(c.clip_starts)))


def _anchor(mode, clips, section=AnchorConfig(batch_size=2), keep_ref=False):
    adapter = make_adapter()
    policy = Policy(adapter, TrainableWeights.from_section(MODES[mode]),
                    OptimizerSettings.from_section(TrainConfig(lr=1e-2)), 10, keep_ref=keep_ref)
    return AnchorLosses(section, adapter, policy, *clips, seed=0), adapter, policy


def _grads(adapter):
    return {n: p.grad for n, p in adapter.transformer.named_parameters() if p.requires_grad}


def test_module_mode_every_term_reaches_exactly_the_transition_module(clips):
    anchor, adapter, _ = _anchor("module", clips)
    reach = anchor.measure_reach(0)
    n_b = len(list(adapter.transformer.latent_state_rollout.transition.parameters()))
    assert reach == {"fm": n_b, "trans": n_b, "ref": 0}  # B feeds the coupling (gate 0.5) and the predictor
    assert all(p.grad is None for p in adapter.transformer.parameters())  # the measurement leaves no gradients
    assert [n for n, p in adapter.transformer.named_parameters() if p.requires_grad] == list(anchor.groups)
    metrics = anchor.backward()
    assert float(metrics["anchor_trans_reach"]) == n_b and "anchor_trans" in metrics and "anchor_fm" in metrics
    grads = _grads(adapter)
    assert set(grads) == {f"latent_state_rollout.transition.{n}"
                          for n, _ in adapter.transformer.latent_state_rollout.transition.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert any(float(g.abs().sum()) > 0 for g in grads.values())
    frozen = [p for n, p in adapter.transformer.named_parameters() if not p.requires_grad]
    assert all(p.grad is None for p in frozen)  # initializer, out_proj, tokenizer, predictor, backbone: untouched


def test_coupling_lora_transition_ce_has_no_gradient_path_and_is_not_applied(clips, caplog):
    anchor, adapter, _ = _anchor("lora", clips)
    with caplog.at_level("WARNING"):
        metrics = anchor.backward()
    # a path to lora_A / lora_B of q, k, v, out in every block; a non-zero gradient on lora_B only (lora_A's is
    # exactly 0 while lora_B is at its init 0): the reach measured by size
    assert anchor.paths["trans"] == 0 and anchor.paths["fm"] == 2 * 4 * len(adapter.blocks())
    assert anchor.reach["trans"] == 0 and anchor.reach["fm"] == 4 * len(adapter.blocks())
    assert float(metrics["anchor_trans_reach"]) == 0.0
    assert "anchor_trans" not in metrics and "anchor_trans_accuracy" not in metrics  # not reported as training
    assert float(metrics["anchor_loss"]) == pytest.approx(0.1 * float(metrics["anchor_fm"]), rel=1e-6)
    assert "no gradient path" in caplog.text
    assert all(".lora_" in n for n in _grads(adapter))
    again = anchor.backward()  # the term stays off without being computed again
    assert "anchor_trans" not in again and float(again["anchor_trans_reach"]) == 0.0


def test_module_lora_terms_reach_both_kinds_of_trained_tensor(clips):
    anchor, adapter, _ = _anchor("module+lora", clips)
    n_b = len(list(adapter.transformer.latent_state_rollout.transition.parameters()))
    lora = 4 * len(adapter.blocks())  # lora_B of q, k, v, out of every block (lora_A's gradient is 0 at init)
    assert anchor.measure_reach(0) == {"fm": n_b + lora, "trans": n_b, "ref": 0}
    anchor.backward()
    grads = _grads(adapter)
    assert {n.split(".")[0] for n in grads} == {"latent_state_rollout", "blocks"}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())


def test_fm_term_excludes_the_condition_slot(clips):
    from flowforge.algorithms.losses import anchor_fm_loss, anchors as math
    from flowforge.rollout import with_condition

    anchor, adapter, _ = _anchor("module", clips, AnchorConfig(batch_size=2, trans_weight=0.0))
    x0, noise, sigma, cond = anchor.clip_batch(3)
    assert torch.equal(cond.image, x0[:, :, :1])  # the clean first frame of each real clip
    terms, _ = anchor.terms(3)
    assert terms["trans"] is None and terms["ref"] is None
    x = with_condition(adapter, math.noised(x0, noise, sigma), cond)
    assert torch.equal(x[:, :, :1], x0[:, :, :1])  # slot 0 pinned to the condition in the anchor's input
    v = adapter.velocity(x, sigma, cond, 1.0)
    gen = adapter.generated_index
    expected, _ = anchor_fm_loss(v[gen], x0[gen], noise[gen])
    assert torch.equal(terms["fm"], expected) and v[gen].shape[2] == x0.shape[2] - 1
    shifted = x0.clone()
    shifted[:, :, 0] += 0.5  # another target on slot 0 only never enters the loss
    assert torch.equal(anchor_fm_loss(v[gen], shifted[gen], noise[gen])[0], expected)


def test_fm_term_weighs_the_paddle_rows_as_the_sft(clips):
    from flowforge.algorithms.losses import anchor_fm_loss, anchors as math
    from flowforge.rollout import with_condition

    section = AnchorConfig(batch_size=2, trans_weight=0.0, paddle_rows=2, paddle_weight=10.0)
    anchor, adapter, _ = _anchor("module", clips, section)
    x0, noise, sigma, cond = anchor.clip_batch(3)
    terms, _ = anchor.terms(3)
    v = adapter.velocity(with_condition(adapter, math.noised(x0, noise, sigma), cond), sigma, cond, 1.0)
    gen = adapter.generated_index
    weight = math.row_weights(x0.shape[-1], 2, 10.0).view(1, 1, 1, -1, 1)
    assert torch.equal(terms["fm"], anchor_fm_loss(v[gen], x0[gen], noise[gen], weight)[0])
    assert not torch.equal(terms["fm"], anchor_fm_loss(v[gen], x0[gen], noise[gen])[0])
    from flowforge.settings.schema import ConfigError

    for bad in ({"paddle_weight": 0.0}, {"paddle_rows": -2}):
        with pytest.raises(ConfigError, match="paddle"):
            AnchorConfig(**bad)


def test_clip_stream_depends_only_on_seed_and_step(clips):
    a, _, _ = _anchor("module", clips)
    b, _, _ = _anchor("module", clips)
    xa, na, sa, _ = a.clip_batch(5)
    xb, nb, sb, _ = b.clip_batch(5)
    assert torch.equal(xa, xb) and torch.equal(na, nb) and torch.equal(sa, sb)
    assert not torch.equal(a.clip_batch(6)[1], na)
    assert bool(((sa > 0) & (sa < 1)).all())  # logit-normal, as the world SFT draws them (its own generator)


def test_sigmas_are_drawn_as_the_world_sft_drew_them(clips):
    """The FM anchor's sigma stream has the distribution the world SFT trained demo:world on (logit-normal, mean 0,
    std 1, no shift, every clip weight 1: sft.sigma_sampling of examples/worldmodel/sft.yaml, which keeps the default),
    from the anchor's own generator whatever the rollout's sampler shift; a uniform stream is told apart by the same
    test."""
    import yaml
    from scipy.stats import ks_2samp

    from flowforge.algorithms.schedules import sample_sigmas
    from flowforge.settings.sections import SFTConfig

    sft_yaml = Path(__file__).resolve().parents[2] / "examples" / "worldmodel" / "sft.yaml"
    assert "sigma_sampling" not in yaml.safe_load(sft_yaml.read_text())["sft"]  # demo:world: SFTConfig's default
    assert AnchorConfig().sigma_sampling == SFTConfig().sigma_sampling == "logit_normal"
    sft_sigmas = sample_sigmas(2000, torch.Generator().manual_seed(123), kind=SFTConfig().sigma_sampling)
    streams = {}
    for kind in ("logit_normal", "uniform"):
        anchor, _, _ = _anchor("module", clips, AnchorConfig(batch_size=8, sigma_sampling=kind))
        streams[kind] = torch.cat([anchor.clip_batch(step)[2] for step in range(150)])
    assert ks_2samp(streams["logit_normal"].numpy(), sft_sigmas.numpy()).pvalue > 0.05
    assert ks_2samp(streams["uniform"].numpy(), sft_sigmas.numpy()).pvalue < 1e-6


def test_reference_penalty_uses_the_immutable_reference(clips):
    section = AnchorConfig(batch_size=2, fm_weight=0.0, trans_weight=0.0, ref_weight=1.0)
    assert anchor_policy_bank(section, {"keep_old": True}) == {"keep_old": True, "keep_ref": True}
    with pytest.raises(ValueError, match="reference policy"):
        _anchor("module", clips, section)
    anchor, adapter, policy = _anchor("module", clips, section, keep_ref=True)
    first = anchor.backward()
    assert float(first["anchor_ref"]) == 0.0  # live == ref at the start
    with torch.no_grad():
        for p in policy.params:
            p.add_(0.05)
    assert float(anchor.backward()["anchor_ref"]) > 0.0


def test_optimizer_step_hook_trains_with_the_anchor_only_when_attached(clips):
    anchor, adapter, policy = _anchor("module", clips)
    ctx = ObjectiveContext(seed=0, micro_batch_size=2, num_updates_per_batch=1, advantage_clip=5.0,
                           sampler=SamplerConfig(), sections={})
    objective = Objective(ctx, adapter, policy)
    before = policy.named_weights("live")
    assert set(objective.optimizer_step()) == {"grad_norm"}  # no anchor: a plain step (no gradients: no change)
    assert all(torch.equal(before[k], v) for k, v in policy.named_weights("live").items())
    objective.anchor = anchor
    metrics = objective.optimizer_step()
    assert {"grad_norm", "anchor_loss", "anchor_fm", "anchor_trans"} <= set(metrics)
    assert any(not torch.equal(before[k], v) for k, v in policy.named_weights("live").items())


def test_build_anchor_is_inactive_for_other_families_and_zero_weights(clips):
    class NotAWorldModel:
        pass

    assert build_anchor(AnchorConfig(), NotAWorldModel(), None, seed=0, cache_dir="unused") is None
    adapter = make_adapter()
    policy = Policy(adapter, TrainableWeights.from_section(MODES["module"]),
                    OptimizerSettings.from_section(TrainConfig(lr=1e-2)), 10)
    quiet = build_anchor(AnchorConfig(fm_weight=0.0, trans_weight=0.0), adapter, policy, seed=0, cache_dir="unused")
    metrics = quiet.backward()  # no clips loaded, no anchor term: only the leverage of the step
    assert set(metrics) == {f"coupling_gate_{i}" for i in range(2)} | {"grad_norm_rl_transition"}
    assert all(p.grad is None for p in policy.params)


@pytest.fixture(scope="module")
def shipped():
    from flowforge.demo.paths import resolve_demo_path
    from flowforge.models import build_adapter

    return build_adapter("world_model", str(resolve_demo_path("demo:world")), task="i2v")


@pytest.mark.parametrize("mode", ["module", "lora"])
def test_reach_is_measured_by_size_with_the_shipped_gates(clips, shipped, mode, caplog):
    """With every coupling gate at 0 (the base made before, whose gates stayed ~0 in SFT), B-only and coupling-LoRA
    have a gradient path to their tensors (zero gradients) and the reach check reports the path as not reached,
    and warns; the same weights with the gates opened to 0.5 are reached, and so are demo:world's own gates (0.019
    and 0.013 in blocks 0 and 1, 1e-4 and 4e-4 in 2 and 3). The per-step rows carry the gates and the term's
    gradient."""
    import copy

    gates = [float(b.coupling.gate.detach()) for b in shipped.transformer.blocks]
    assert 1e-2 < max(abs(g) for g in gates) < 0.05  # the shipped base: the latent-state path is open a little
    group = "transition" if mode == "module" else "coupling_lora"
    reach, norms = {}, {}
    for gate in (0.0, None, 0.5):  # None: the shipped gates
        adapter = copy.deepcopy(shipped)
        if gate is not None:
            with torch.no_grad():
                for block in adapter.transformer.blocks:
                    block.coupling.gate.fill_(gate)
        policy = Policy(adapter, TrainableWeights.from_section(MODES[mode]),
                        OptimizerSettings.from_section(TrainConfig(lr=1e-2)), 10)
        anchor = AnchorLosses(AnchorConfig(batch_size=2), adapter, policy, *clips, seed=0)
        with caplog.at_level("WARNING"):
            caplog.clear()
            metrics = anchor.backward()
        trained = [n for n, p in adapter.transformer.named_parameters() if p.requires_grad]
        reach[gate], norms[gate] = anchor.reach["fm"], float(metrics[f"grad_norm_fm_{group}"])
        assert anchor.paths["fm"] == len(trained)  # a path whatever the gates (a zero gate passes zero gradients)
        assert float(metrics["anchor_fm_reach"]) == reach[gate]
        assert ("fm term reaches no trained group" in caplog.text) == (reach[gate] == 0)
        assert [float(metrics[f"coupling_gate_{i}"]) for i in range(len(gates))] == pytest.approx(
            gates if gate is None else [gate] * len(gates))
        assert f"grad_norm_rl_{group}" in metrics
        if mode == "module":  # the transition term reads B's state directly: reached whatever the gates
            assert anchor.reach["trans"] == len(trained) and anchor.shares["trans"]["transition"] >= REACH_FLOOR
        else:
            assert anchor.paths["trans"] == 0 and float(metrics["anchor_trans_reach"]) == 0.0
    assert reach[0.0] == 0  # not reached with closed gates ...
    # ... reached with open gates: every B tensor, or lora_B of q / k / v / out (lora_A's gradient is 0 at init)
    full = len(trained) if mode == "module" else len(trained) // 2
    assert reach[0.5] == full and reach[None] == full
    assert norms[0.0] < REACH_FLOOR * norms[0.5] < norms[None] < norms[0.5]  # the per-step size says the same
