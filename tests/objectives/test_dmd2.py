"""DMD2 distillation on the real loop (tiny random SD3): the teacher / fake score wiring (identical at the start, so
the distribution-matching gradient is exactly 0), the fake score learns without touching the policy, a two-step run
trains and logs, refusals, and RL (GRPO, SDE rollouts) accepts the exported few-step student."""

import copy
import json

import pytest
import torch

from flowforge.config import ConfigError, load_config
from flowforge.algorithms import losses
from flowforge.objectives.dmd2 import renoise_rows
from flowforge.train.preflight import PreflightError, preflight
from flowforge.train.trainer import Trainer
from tests.train.test_trainer import one_step, tiny_cfg, train_batch

DMD2 = ("train.algorithm=dmd2", "sampler.sde_kind=ode", "lora.trainable=full", "advantage.std_mode=none",
        "train.num_updates_per_batch=1", "dmd2.fake_updates=2")


def test_rollout_stores_every_step_and_the_last_prediction_is_the_sample(make):
    trainer = make(*DMD2)
    sb, traj, cond, adv, total = one_step(trainer)
    n = trainer.cfg.sampler.num_steps
    assert traj.trained_steps == tuple(range(n)) and traj.latents.shape[1] == n
    batch = train_batch(sb, traj, cond, adv, total)
    last = traj.sigmas[n - 1].expand(len(batch))
    with torch.no_grad():  # the generator's prediction at its last input is the Euler step to 0: the sample
        x = trainer.objective._predict(batch, traj.latents[:, n - 1], last)
    torch.testing.assert_close(x, traj.final, atol=1e-5, rtol=0)


def test_teacher_and_fake_score_agree_at_the_start_then_only_the_fake_score_learns(make):
    trainer = make(*DMD2)
    obj = trainer.objective
    sb, traj, cond, adv, total = one_step(trainer)
    batch = train_batch(sb, traj, cond, adv, total)
    x = traj.final
    s = torch.full((len(batch),), 0.5)
    x_s = renoise_rows(x, torch.randn_like(x), s)
    with obj.policy.using("ref"):
        real = obj._x0(batch, x_s, s, 1.0)
    with obj._fake_score():
        fake = obj._x0(batch, x_s, s, 1.0)
    assert torch.equal(losses.dmd_gradient(x, real, fake), torch.zeros_like(x))  # the fake starts as the teacher
    live = [p.detach().clone() for p in obj.policy.params]
    ref = {k: v.clone() for k, v in obj.policy.named_weights("ref").items()}
    m = obj.fake_step(batch, x, torch.Generator().manual_seed(0))
    assert torch.isfinite(m["loss_fake"]) and m["fake_grad_norm"] > 0
    assert all(torch.equal(a, b) for a, b in zip(live, obj.policy.params))  # the generator did not move
    assert all(torch.equal(v, obj.policy.named_weights("ref")[k]) for k, v in ref.items())  # nor the teacher
    assert obj.adapter.transformer is obj.policy.live_module  # the swap is undone
    with obj._fake_score():
        moved = obj._x0(batch, x_s, s, 1.0)
    assert not torch.equal(moved, fake)


def test_two_step_run_trains_the_generator_and_logs(make):
    trainer = make(*DMD2)
    before = [p.detach().clone() for p in trainer.policy.params]
    run_dir = trainer.train()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("train/loss_dm", "train/dm_grad_abs", "train/loss_fake", "train/fake_grad_norm", "train/grad_norm",
                "reward/digit_mean"):
        assert key in rows[0] and rows[0][key] == rows[0][key], key  # present and not NaN
    assert rows[0]["train/skipped"] == 0.0 and rows[1]["train/loss_dm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.params))


def test_rl_accepts_the_exported_few_step_student(make, tiny_model_dir, tmp_path, encode_cache_dir):
    """Issue 45: the distilled generator is an ordinary model: exported, GRPO trains it with SDE rollouts at the
    student's step count (per-step log-probs, first ratio exactly 1)."""
    from flowforge.tools.export import export_run

    run_dir = make(*DMD2, "sampler.num_steps=2", "sampler.num_sde_steps=1", "train.steps=1").train()
    out = export_run(run_dir, tmp_path / "student", form="merged")
    cfg = tiny_cfg(out / "transformer", tmp_path, encode_cache_dir, "run.name=rl", "sampler.num_steps=2",
                   "sampler.num_sde_steps=1", "sampler.sde_window=[0.0, 0.5]", "train.steps=1")
    rl = Trainer(cfg, progress=False).train()
    row = json.loads((rl / "metrics.jsonl").read_text().splitlines()[0])
    assert row["train/skipped"] == 0.0 and row["train/ratio_mean"] == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("extra, names", [
    (("lora.trainable=lora",), ["lora.trainable='lora'", "allowed: 'full'"]),
])
def test_preflight_refuses(tiny_model_dir, tmp_path, encode_cache_dir, extra, names):
    cfg = tiny_cfg(tiny_model_dir, tmp_path, encode_cache_dir, *DMD2, *extra)
    with pytest.raises(PreflightError) as err:
        preflight(cfg, this_machine=False)
    line = next(p for p in err.value.problems if names[0] in p)
    assert all(n in line for n in names), line


@pytest.mark.parametrize("extra, key", [("dmd2.sigma_range=[0.5, 0.2]", "dmd2.sigma_range"),
                                        ("dmd2.fake_updates=0", "dmd2.fake_updates")])
def test_section_refuses_bad_values(extra, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, [*DMD2, extra])


@pytest.mark.slow  # three short dmd2 runs (~50 s on 2 cores): CI runs it in the slow set
def test_a_resumed_run_continues_the_fake_score_bit_for_bit(tiny_model_dir, tmp_path, encode_cache_dir):
    """Issue 45 (DMD2 resume): the checkpoint holds the fake score and its AdamW state (weight group
    ``objective.fake``, ``optimizer.pt["objective"]``), so a run stopped after step 1's checkpoint and resumed ends
    with the uninterrupted run's generator, fake score and both optimizers; a checkpoint without a fake score is
    refused rather than resumed with the fake score restarted from the teacher."""
    from flowforge.train.checkpoint import load_checkpoint

    extra = (*DMD2, "sampler.num_steps=2", "sampler.num_sde_steps=1", "train.steps=2", "checkpoint.every=1")
    whole = Trainer(tiny_cfg(tiny_model_dir, tmp_path / "whole", encode_cache_dir, *extra), progress=False)
    whole.train()
    part = Trainer(tiny_cfg(tiny_model_dir, tmp_path / "part", encode_cache_dir, *extra), progress=False)
    part.train(stop_at=1)
    ckpt = load_checkpoint(part.run_dir / "checkpoints" / "step_000001")
    assert "objective.fake" in ckpt.tensors and "objective" in ckpt.optimizer_state
    resumed = Trainer(tiny_cfg(tiny_model_dir, tmp_path / "part", encode_cache_dir, *extra, "train.resume=auto"),
                      progress=False)
    assert resumed.step == 1
    resumed.train()
    for a, b in ((whole.objective.fake.state_dict(), resumed.objective.fake.state_dict()),
                 (whole.policy.named_weights("live"), resumed.policy.named_weights("live"))):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for fa, fb in ((t.objective.fake_optimizer.state_dict()["state"] for t in (whole, resumed)),
                   (t.policy.optimizer.state_dict()["state"] for t in (whole, resumed))):
        assert fa.keys() == fb.keys() and all(torch.equal(fa[i]["exp_avg"], fb[i]["exp_avg"]) for i in fa)

    def rows(trainer):  # the logged values, timings left out
        lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items()
                 if not (k.startswith(("time/", "perf/")) or k.endswith("_time"))} for line in lines]

    assert rows(whole) == rows(resumed)
    # a checkpoint written under another dmd2.fake_lr resumes at this run's (its saved param groups carry theirs)
    state = copy.deepcopy(resumed.objective.checkpoint_state())
    state["optimizer"]["param_groups"][0]["lr"] = 0.5
    resumed.objective.load_checkpoint_state(state)
    assert resumed.objective.fake_optimizer.param_groups[0]["lr"] == resumed.objective.dmd2.fake_lr != 0.5
    # a checkpoint without the fake score (written before dmd2 saved it) is refused
    with pytest.raises(ValueError, match="holds no DMD2 fake score"):
        resumed.objective.load_checkpoint_state({})
