"""The replay family: objectives that re-score the rollout's stored SDE steps under the live weights.

An SDE rollout stores, for each trained step ``i`` of each sample, ``x_i``, ``x_{i+1}`` and the transition's
log-prob (mean over elements, fp32) under the sampling policy. The update replays those steps
(:func:`flowforge.rollout.replay_log_prob`) with the same guided velocity the rollout used
(``adapter.velocity(x, sigma, cond, guidance_scale)``: two forwards for classifier-free guidance, one for FLUX-dev's
distilled guidance embedding), so the first update's importance ratio is exactly 1 and the gradient flows through
both CFG branches (as flow_grpo trains SD3 at CFG 4.5).

Trained steps are ``sampler.trained_indices``, or ``sampler.num_sde_steps`` steps in ``sampler.sde_window``, or a
fresh draw from ``sampler.sde_pool`` every rollout (:func:`trained_steps_for`); every other step is ODE.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from flowforge.algorithms import schedules
from flowforge.objectives.base import MetricAccumulator, Objective, TrainBatch
from flowforge.rollout import RolloutSpec
from flowforge.runtime.distributed import all_reduce_processes
from flowforge.settings import SamplerConfig


def trained_steps_for(sampler: SamplerConfig, seed: int, step: int) -> tuple[int, ...]:
    """The trained step indices of the rollout at training ``step`` (resampled from ``sampler.sde_pool`` with a
    seed of (run seed, step) when a pool is set: identical on every rank without communication)."""
    s = sampler
    return tuple(schedules.resolve_trained_steps(
        s.num_steps, indices=s.trained_indices, num_sde_steps=s.num_sde_steps, fraction=tuple(s.sde_window),
        pool=s.sde_pool, resample_seed=None if s.sde_pool is None else seed * 1_000_003 + step))


class ReplayObjective(Objective):
    """Shared machinery of the replay objectives: the SDE rollout and the update loop.

    The batch is split into ``num_updates_per_batch`` disjoint updates (one optimizer step each); each update's
    loss is the mean over its samples and trained steps of :meth:`step_loss` (backward per trained step and
    micro-batch, scaled so the gradient equals that mean's). ``train/first_update_ratio_dev`` is the largest
    ``|ratio - 1|`` of the first update over every rank (0 when replay is exact).
    """

    uses_log_probs = True
    store_means: ClassVar[bool] = False  # also store each trained step's transition mean

    def rollout_spec(self, step: int) -> RolloutSpec:
        s = self.ctx.sampler
        return RolloutSpec(kind=s.sde_kind, noise_level=s.noise_level,
                           trained_steps=trained_steps_for(s, self.ctx.seed, step),
                           guidance_scale=s.guidance_scale, store_steps=True, log_probs=True,
                           store_means=self.store_means)

    def rollout_spec_of(self, batch: TrainBatch) -> RolloutSpec:
        """The spec the batch was rolled out with (its stored trained steps)."""
        s = self.ctx.sampler
        return RolloutSpec(kind=s.sde_kind, noise_level=s.noise_level, trained_steps=batch.traj.trained_steps,
                           guidance_scale=s.guidance_scale)

    def step_loss(self, sub: TrainBatch, slot: int, spec: RolloutSpec) -> tuple[torch.Tensor, dict]:
        """Loss of trained step ``slot`` on a micro-batch (mean over its samples) and its metrics, which include
        ``ratio_min`` / ``ratio_max``."""
        raise NotImplementedError

    def optimize(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        batch = batch.kept()
        spec = self.rollout_spec_of(batch)
        n_updates = self.ctx.num_updates_per_batch
        per_update = len(batch) // n_updates
        num_slots = len(batch.traj.trained_steps)
        acc = MetricAccumulator()
        first_dev = torch.zeros(())
        for u in range(n_updates):
            rows_u = torch.arange(u * per_update, (u + 1) * per_update)
            for rows in self.micro_batches(rows_u):
                sub = batch.select(rows)
                for slot in range(num_slots):
                    loss, m = self.step_loss(sub, slot, spec)
                    (loss * (rows.numel() / per_update) / num_slots).backward()
                    acc.add({**m, "loss": loss}, weight=rows.numel())
                    if u == 0:
                        first_dev = torch.maximum(first_dev, torch.maximum(m["ratio_max"] - 1, 1 - m["ratio_min"]))
            acc.add(self.optimizer_step())
        out = acc.reduce()
        out["first_update_ratio_dev"] = all_reduce_processes(first_dev.detach().cpu(), "max")
        return out
