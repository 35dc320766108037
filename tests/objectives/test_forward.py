"""Forward-process machinery: group-shared noise and sigma, visits seeded by the batch's own training step, the
old-policy decay schedules, the rollout samplers (DPM-Solver-2, stochastic kernels)."""

import json
from dataclasses import replace

import pytest
import torch

from flowforge.algorithms.solvers import dpm_solver_2_sample
from flowforge.config import ConfigError, load_config
from flowforge.rollout import candidate_noise
from tests.train.test_trainer import one_step, train_batch


def test_group_objectives_share_noise_within_groups(make):
    trainer = make("train.algorithm=dgpo")
    sb, traj, cond, adv, total = one_step(trainer)
    batch = train_batch(sb, traj, cond, adv, total)
    obj = trainer.objective
    keys = obj.noise_keys(batch)
    for g in batch.group_ids.unique():
        assert keys[batch.group_ids == g].unique().numel() == 1
    assert keys.unique().numel() == batch.group_ids.unique().numel()
    visit = obj.make_visit(batch, obj.visits(batch, 0)[0][0], obj.visits(batch, 0)[0][1])
    for g in batch.group_ids.unique():
        rows = batch.group_ids == g
        assert torch.equal(visit.noise[rows][0], visit.noise[rows][-1])
        assert visit.sigma[rows].unique().numel() == 1
    assert obj._micro_size(batch) % 4 == 0  # whole groups of K = 4


def test_visits_follow_the_batch_step_not_the_last_rollout(make):
    """The visit noise slots of a batch are a function of ``batch.step`` (and the inner epoch) only: rolling out
    another step in between changes nothing (no state kept between the sample and optimize stages)."""
    trainer = make("train.algorithm=nft", "forward.inner_epochs=2", "forward.sigma_mode=full_schedule")
    obj = trainer.objective
    batch = train_batch(*one_step(trainer, step=3))
    batch = replace(batch, step=3)
    num_steps, inner = trainer.cfg.sampler.num_steps, trainer.cfg.forward.inner_epochs
    first = obj.visits(batch, 1)
    obj.rollout_spec(7)
    again = obj.visits(batch, 1)
    assert [slot for _, slot in first] == [slot for _, slot in again]
    base = -2 - (3 * inner + 1) * num_steps
    assert [slot for _, slot in first] == [base - j for j in range(num_steps)]
    assert [slot for _, slot in obj.visits(replace(batch, step=4), 1)] != [slot for _, slot in first]
    assert batch.select(torch.arange(2)).step == 3  # a micro-batch keeps its step


def test_the_trainer_hands_each_batch_its_step(make, monkeypatch):
    trainer = make("train.algorithm=nft")
    seen = []
    optimize = trainer.objective.optimize
    monkeypatch.setattr(trainer.objective, "optimize", lambda batch: seen.append(batch.step) or optimize(batch))
    trainer.train()
    assert seen == [0, 1]


def test_old_policy_decay_schedules_through_a_run(make):
    """forward.decay_schedule: NVlabs' "flat_ramp" (decay type 2 shape) holds d = 0 for the first decay_flat_steps
    optimizer steps, then ramps to the cap; logged after each batch of 2 optimizer steps (n = 2, 4, 6, 8)."""
    run_dir = make("train.algorithm=nft", "train.steps=4", "forward.decay_schedule=flat_ramp",
                   "forward.decay_flat_steps=3", "forward.decay_rate=0.25", "forward.decay_max=0.6").train()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/old_decay"] for r in rows] == pytest.approx([0.0, 0.25, 0.6, 0.6])
    with pytest.raises(ConfigError, match="forward.decay_flat_steps=3 must be >= 0, and 0 unless"):
        load_config(None, ["forward.decay_flat_steps=3"])  # a flat start needs the flat_ramp schedule
    with pytest.raises(ConfigError, match="forward.decay_schedule='type2' is not one of"):
        load_config(None, ["forward.decay_schedule=type2"])


def test_dpm2_rollout_is_the_solver_applied_directly_and_differs_from_euler(make):
    """forward.sampler=dpm2 rolls out with DPM-Solver++(2M): the trainer's rollout equals dpm_solver_2_sample run on
    the same noise with the old policy's velocity (same chunks, bit for bit), and differs from the Euler rollout."""
    trainer = make("train.algorithm=nft", "forward.sampler=dpm2", name="dpm2")
    sb = trainer.next_prompts()
    traj, cond = trainer.sample(sb, 0)
    assert trainer.objective.rollout_spec(0).solver == "dpm2" and traj.trained_steps == ()
    ids = sb.candidate_ids.tolist()
    x_T = candidate_noise(ids, trainer.latent_shape, trainer.cfg.run.seed, -1)
    chunk, finals = trainer.cfg.train.micro_batch_size, []
    with torch.no_grad(), trainer.policy.using("old"):
        for start in range(0, len(ids), chunk):
            c = cond.index(torch.arange(start, min(start + chunk, len(ids))))
            fn = lambda x, s, c=c: trainer.adapter.velocity(x, s.expand(x.shape[0]), c, 1.0)  # noqa: E731
            finals.append(dpm_solver_2_sample(fn, x_T[start:start + chunk], trainer.sigmas))
    assert torch.equal(traj.final, torch.cat(finals))
    euler = make("train.algorithm=nft", name="euler")
    euler_final = euler.sample(euler.next_prompts(), 0)[0].final
    assert (euler_final - traj.final).abs().max() > 1e-3
    metrics = trainer.optimize(train_batch(sb, traj, cond, *trainer.advantages(trainer.score(traj, sb)[1], sb)[:2]))
    assert torch.isfinite(metrics["train/loss"])


def test_stochastic_forward_sampler_is_stochastic(make):
    """forward.sampler=sde samples every step but the last with the SDE kernel (before, it silently ran the ODE)."""
    trainer = make("train.algorithm=nft", "forward.sampler=sde", "sampler.noise_level=0.7", name="sde")
    traj = trainer.sample(trainer.next_prompts(), 0)[0]
    ode = make("train.algorithm=nft", name="ode")
    ode_final = ode.sample(ode.next_prompts(), 0)[0].final
    assert traj.trained_steps == (0, 1, 2) and traj.latents is None and traj.log_probs is None
    assert (ode_final - traj.final).abs().max() > 1e-2
