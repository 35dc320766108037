"""Reward-gradient training (DRaFT-K / DRaFT-LV / ReFL) on the real loop with the tiny SD3 model and the real
differentiable digit reward: the gradient path computes the rollout's sample, gradients reach only trained weights,
the gradient is the loss's (finite differences), refusals, and a two-step run."""

import json

import pytest
import torch

from flowforge.config import ConfigError, load_config
from flowforge.train.preflight import PreflightError, preflight
from tests.train.test_trainer import one_step, tiny_cfg, train_batch

DRAFT = ("train.algorithm=draft", "sampler.sde_kind=ode")


def draft_batch(trainer, step=0):
    sb, traj, cond, adv, total = one_step(trainer, step)
    from dataclasses import replace

    return replace(train_batch(sb, traj, cond, adv, total), records=tuple(sb.records), step=step)


@pytest.mark.parametrize("extra", [("draft.k=1",), ("draft.k=3",), ("draft.k=4",),
                                   ("draft.variant=refl", "draft.refl_range=[1,1]")])
def test_gradient_path_computes_the_rollout_sample_bitwise(make, extra):
    """The K differentiated steps (checkpointed, with grad) from the stored x_{T-K} give the no-grad sampler's x_0
    exactly; ReFL's one-step prediction from the last step is that step itself."""
    trainer = make(*DRAFT, *extra)
    batch = draft_batch(trainer)
    k = trainer.cfg.draft.k if trainer.cfg.draft.variant == "draft" else 1
    assert batch.traj.trained_steps == (trainer.cfg.sampler.num_steps - k,)
    sub = batch.select(torch.arange(2))
    (x0,) = trainer.objective.predictions(sub)
    assert x0.requires_grad
    assert torch.equal(x0.detach(), sub.traj.final)


def test_gradients_reach_only_trained_weights_and_are_finite(make):
    trainer = make(*DRAFT, "draft.k=2")
    obj = trainer.objective
    batch = draft_batch(trainer)
    loss, m = obj.micro_loss(batch.select(torch.arange(4)))
    obj.policy.backward(loss)
    trained = {id(p) for p in obj.policy.params}
    with_grad = [(n, p) for n, p in trainer.adapter.transformer.named_parameters() if p.grad is not None]
    assert with_grad and all(id(p) in trained for _, p in with_grad)
    assert all(torch.isfinite(p.grad).all() for _, p in with_grad)
    assert any(p.grad.abs().sum() > 0 for _, p in with_grad)
    frozen = [p for p in trainer.adapter.transformer.parameters() if id(p) not in trained]
    assert frozen and all(p.grad is None for p in frozen)  # LoRA: the base weights get nothing
    classifier = trainer.objective.reward_fn.parts[0][1]._per_device[torch.device("cpu")]
    assert all(p.grad is None for p in classifier.parameters())  # the reward model is never trained
    assert float(m["loss"]) == pytest.approx(-float(m["reward_grad_mean"]))


@pytest.mark.parametrize("extra", [("draft.k=2",), ("draft.variant=refl", "draft.refl_range=[2,2]"),
                                   ("draft.lv_samples=2",)])
def test_loss_gradient_matches_finite_differences(make, extra):
    """Directional derivative of the loss along its own gradient, by central differences of the whole pipeline
    (velocity -> Euler tail / one-step prediction -> decode -> reward CNN), equals |g|^2 from the backward."""
    trainer = make(*DRAFT, "lora.trainable=full", *extra)
    obj = trainer.objective
    sub = draft_batch(trainer).select(torch.arange(4))
    loss, _ = obj.micro_loss(sub)
    loss.backward()
    grads = [p.grad.clone() for p in obj.policy.params]
    obj.policy.optimizer.zero_grad(set_to_none=True)
    g2 = sum(float((g.double() ** 2).sum()) for g in grads)
    assert g2 > 0
    eps = 1e-2 / g2 ** 0.5  # a step of length 1e-2 along the gradient direction

    def loss_at(scale):
        with torch.no_grad():
            for p, g in zip(obj.policy.params, grads):
                p.add_(scale * eps * g)
            value = float(obj.micro_loss(sub)[0])
            for p, g in zip(obj.policy.params, grads):
                p.sub_(scale * eps * g)
        return value

    fd = (loss_at(1.0) - loss_at(-1.0)) / (2 * eps)
    assert fd == pytest.approx(g2, rel=0.05)


def test_refl_stop_step_is_seeded_per_step_and_in_range(make):
    trainer = make(*DRAFT, "draft.variant=refl", "draft.refl_range=[1,3]")
    steps = [trainer.objective.stop_step(s) for s in range(40)]
    assert set(steps) == {1, 2, 3}  # T=4: t in [1, 3] counted from the end
    assert steps == [trainer.objective.stop_step(s) for s in range(40)]


def test_two_step_run_trains_and_logs(make):
    trainer = make(*DRAFT, "draft.k=2", "data.group_size=1", "data.prompts_per_step=4",
                   "advantage.std_mode=none")
    before = [p.detach().clone() for p in trainer.policy.params]
    run_dir = trainer.train()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("train/loss", "train/reward_grad_mean", "train/grad_norm", "train/start_step", "reward/digit_mean"):
        assert key in rows[0], key
    assert rows[0]["train/skipped"] == 0.0  # group size 1: every advantage is 0, the reward gradient still trains
    assert rows[0]["train/start_step"] == 2.0
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.params))


@pytest.mark.parametrize("extra, names", [
    (("draft.k=5",), ["draft.k=5", "sampler.num_steps=4"]),
    (("draft.variant=refl", "draft.refl_range=[2,6]"), ["draft.refl_range", "sampler.num_steps=4"]),
    (("reward.weights={digit_eval: 1.0}",), ["reward.weights", "['digit_eval']", "differentiable scorers: ['digit']"]),
    (("sampler.sde_kind=sde",), ["sampler.sde_kind='sde'", "allowed: 'ode'"]),
    (("model.adapter=flux",), ["model.adapter='flux'", "decode is not differentiable", "allowed: ['sd3']"]),
])
def test_preflight_refuses(tiny_model_dir, tmp_path, encode_cache_dir, extra, names):
    cfg = tiny_cfg(tiny_model_dir, tmp_path, encode_cache_dir, *DRAFT, *extra)
    with pytest.raises(PreflightError) as err:
        preflight(cfg, this_machine=False)
    line = next(p for p in err.value.problems if names[0] in p)
    assert all(n in line for n in names), line


@pytest.mark.parametrize("extra, key", [("draft.k=0", "draft.k"), ("draft.lv_samples=2", "draft.lv_samples"),
                                        ("draft.variant=nope", "draft.variant")])
def test_section_refuses_bad_values(extra, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, [*DRAFT, extra, *(["draft.k=2"] if "lv" in extra else [])])
