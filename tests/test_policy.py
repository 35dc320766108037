"""Policy bank: decay schedule, old never trained, ref immutable, distinct LoRA adapters, guarded switching."""

import copy

import pytest
import torch

from flowforge.config import LoraConfig, TrainConfig
from flowforge.models import build_adapter
from flowforge.algorithms.ema import ema_decay
from flowforge.policy import OptimizerSettings, Policy, TrainableWeights, lr_lambda


@pytest.fixture
def adapter(tiny_model_dir):
    return build_adapter("sd3", str(tiny_model_dir))


def _inputs(adapter, b=2):
    g = torch.Generator().manual_seed(0)
    c = adapter.encode(["a handwritten seven"] * b)
    return torch.randn(b, 1, 32, 32, generator=g), torch.full((b,), 0.6), c


def _train_steps(policy, adapter, n):
    x, s, c = _inputs(adapter)
    for _ in range(n):
        v = policy.pending(adapter.velocity(x, s, c, 1.0))
        policy.backward(((v - 1.0) ** 2).mean())
        policy.step()


@pytest.mark.parametrize("schedule", ["constant", "warmup"])
def test_ema_decay_schedule_through_the_policy(adapter, schedule):
    """The EMA after each optimizer step is exactly ``d(n) ema + (1 - d(n)) live`` with NVlabs' warm-up
    ``d(n) = min((1 + n) / (10 + n), 0.9)`` (2/11, 3/12, 4/13 for n = 1, 2, 3), or the constant 0.9."""
    lora = TrainableWeights.from_section(LoraConfig(trainable="lora", rank=4))
    policy = Policy(adapter, lora, OptimizerSettings.from_section(TrainConfig(lr=1e-2)), 10, ema_decay=0.9,
                    ema_schedule=schedule)
    expected = {"constant": [0.9, 0.9, 0.9], "warmup": [2 / 11, 3 / 12, 4 / 13]}[schedule]
    ema = policy.named_weights("ema")
    for n, d in enumerate(expected, start=1):
        _train_steps(policy, adapter, 1)
        assert policy.optimizer_steps == n and policy.current_ema_decay() == d
        live = policy.named_weights("live")
        want = {k: d * ema[k] + (1 - d) * live[k] for k in ema}  # the same two fp32 ops as Policy.blend
        ema = policy.named_weights("ema")
        for k in ema:
            torch.testing.assert_close(ema[k], want[k], rtol=1e-6, atol=1e-7)
    assert policy.current_ema_decay() == ema_decay(3, schedule=schedule, decay=0.9)
    # after 3 warm-up updates the base weights keep 2/11 * 3/12 * 4/13 = 1.4% of the EMA (constant: 0.9^3 = 73%)
    with pytest.raises(ValueError, match="ema_schedule='cosine' is not one of"):
        Policy(adapter, lora, OptimizerSettings.from_section(TrainConfig()), 10, ema_decay=0.9, ema_schedule="cosine")


@pytest.mark.parametrize("trainable", ["lora", "full"])
def test_bank_old_ref_ema(adapter, trainable):
    lora = TrainableWeights.from_section(LoraConfig(trainable=trainable, rank=4 if trainable == "lora" else None))
    policy = Policy(adapter, lora, OptimizerSettings.from_section(TrainConfig(lr=1e-2)), 10, keep_old=True,
                    keep_ref=True, ema_decay=0.9)
    x, s, c = _inputs(adapter)
    with policy.reference():
        ref_before = adapter.velocity(x, s, c, 1.0)
    old_before = policy.named_weights("old")
    live_before = policy.named_weights("live")
    for k in live_before:  # old starts as a copy of live, in distinct storage
        assert torch.equal(old_before[k], live_before[k])
    for _ in range(2):
        with torch.no_grad(), policy.using("old"):
            v_old = adapter.velocity(x, s, c, 1.0)
        v = policy.pending(adapter.velocity(x, s, c, 1.0))
        policy.backward(((v - v_old - 1.0) ** 2).mean())
        policy.step()
    live = policy.named_weights("live")
    old = policy.named_weights("old")
    assert any(not torch.equal(live[k], live_before[k]) for k in live), "live did not train"
    assert all(torch.equal(old[k], old_before[k]) for k in old), "old moved without a blend"
    # old never receives gradients
    if trainable == "lora":
        from flowforge.models.lora import lora_parameters

        old_params = list(lora_parameters(adapter.transformer, "old").values())
        live_params = list(lora_parameters(adapter.transformer, "default").values())
        assert not any(p.data_ptr() == q.data_ptr() for p in old_params for q in live_params)
    else:
        old_params = list(policy._copies["old"].parameters())
    assert all(p.grad is None and not p.requires_grad for p in old_params)
    # soft update: old <- d old + (1 - d) live
    policy.blend("old", 0.25)
    blended = policy.named_weights("old")
    for k in blended:
        torch.testing.assert_close(blended[k], 0.25 * old_before[k] + 0.75 * live[k], rtol=0, atol=1e-6)
    # the reference is bit-identical after training
    with policy.reference():
        assert torch.equal(adapter.velocity(x, s, c, 1.0), ref_before)
    # the EMA moved (one blend per optimizer step) but is neither live nor the start
    ema = policy.named_weights("ema")
    assert any(not torch.equal(ema[k], live[k]) for k in ema)
    assert any(not torch.equal(ema[k], live_before[k]) for k in ema)


def test_switching_while_live_graph_pending_is_refused(adapter):
    policy = Policy(adapter, TrainableWeights.from_section(LoraConfig(rank=4)),
                    OptimizerSettings.from_section(TrainConfig()), 10, keep_old=True)
    x, s, c = _inputs(adapter)
    v = policy.pending(adapter.velocity(x, s, c, 1.0))
    with pytest.raises(RuntimeError, match="pending"):
        with policy.using("old"):
            pass
    policy.backward(v.square().mean())
    with policy.using("old"):  # fine after backward
        pass
    with pytest.raises(ValueError, match="keeps no 'ema'"):
        with policy.using("ema"):
            pass
    with pytest.raises(ValueError, match="unknown policy"):
        with policy.using("target"):
            pass


def test_policy_takes_plain_records_not_config_sections(adapter):
    """The bank is built from two plain records; the config sections map onto them one to one."""
    assert TrainableWeights.from_section(LoraConfig()) == TrainableWeights(mode="lora", rank=8, alpha=8.0)
    assert TrainableWeights.from_section(LoraConfig(rank=4, alpha=2.0, targets=("attn.to_q",))) == \
        TrainableWeights(mode="lora", rank=4, alpha=2.0, targets=("attn.to_q",))
    t = TrainConfig(lr=1e-3, lr_schedule="cosine", warmup_steps=3, weight_decay=0.0, adam_betas=(0.8, 0.9),
                    adam_eps=1e-6, grad_clip=0.5)
    optim = OptimizerSettings.from_section(t)
    assert optim == OptimizerSettings(lr=1e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.0, schedule="cosine",
                                      warmup_steps=3, grad_clip=0.5)
    policy = Policy(adapter, TrainableWeights(mode="lora", rank=2, alpha=4.0, targets=("attn.to_q",)), optim, 10)
    assert (policy.rank, policy.alpha, policy.targets, policy.grad_clip) == (2, 4.0, ["attn.to_q"], 0.5)
    group = policy.optimizer.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.8, 0.9), 1e-6, 0.0)
    assert policy.lr == pytest.approx(1e-3 * lr_lambda("cosine", 3, 10)(0))
    with pytest.raises(ValueError, match="'lora', 'full'"):
        Policy(adapter, TrainableWeights(mode="frozen", rank=2, alpha=2.0), optim, 10)


def test_a_restored_state_trains_on_with_the_settings_it_is_given(tiny_model_dir):
    """The optimizer's state dict carries the checkpoint's lr / eps / weight decay and the schedule its base LR: a
    policy restored under other settings (stage C's ``stages.c_overrides=[train.lr=...]``) must train with its own,
    from the schedule's restored position; under the same settings the restore changes nothing, bit for bit."""
    lora = TrainableWeights.from_section(LoraConfig(trainable="lora", rank=4))

    def policy(**train):
        adapter = build_adapter("sd3", str(tiny_model_dir))
        settings = OptimizerSettings.from_section(TrainConfig(**{"lr": 1e-2, "warmup_steps": 10, **train}))
        return adapter, Policy(adapter, lora, settings, 20)

    adapter, first = policy()
    _train_steps(first, adapter, 3)
    state = copy.deepcopy(first.state_dict())  # as a checkpoint holds it: the live policy's tensors are not shared
    same_adapter, same = policy()
    same.load_state_dict(state)
    assert same.optimizer.param_groups[0]["lr"] == first.lr == 1e-2 * lr_lambda("constant", 10, 20)(3)
    _train_steps(first, adapter, 2)
    _train_steps(same, same_adapter, 2)
    assert all(torch.equal(v, first.named_weights("live")[k]) for k, v in same.named_weights("live").items())

    other_adapter, other = policy(lr=2e-3, adam_eps=1e-4, weight_decay=0.1)
    other.load_state_dict(state)
    group = other.optimizer.param_groups[0]
    assert (group["lr"], group["eps"], group["weight_decay"]) == (2e-3 * 0.4, 1e-4, 0.1)  # 0.4: warmup at step 3
    assert other.optimizer_steps == 3 and other.optimizer.state  # the schedule's position and Adam's moments kept
    _train_steps(other, other_adapter, 1)
    assert other.lr == 2e-3 * 0.5
