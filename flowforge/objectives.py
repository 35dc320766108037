"""One class per algorithm: what it needs from the rollout, and how it turns a scored batch into updates.

An objective declares its rollout (:meth:`Objective.rollout_spec`) — the one loop in :mod:`flowforge.rollout` does
the sampling — and implements :meth:`Objective.optimize`, which calls the pure math in
:mod:`flowforge.algorithms.losses`. The loop picks the class from :data:`OBJECTIVES` by ``train.algorithm``.

Class attributes read by :mod:`flowforge.preflight` (one source of truth for algorithm properties):

====================  ==============================================================================
``uses_log_probs``    replays stored SDE steps and needs per-step log-probs (so guidance must be 1)
``clipped_ratio``     clips an importance ratio against the rollout policy (so 1 update per batch is moot)
====================  ==============================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from flowforge.algorithms import losses, schedules
from flowforge.config import Config
from flowforge.models.base import Conditioning
from flowforge.rollout import RolloutSpec, Trajectory, replay_log_prob


@dataclass(frozen=True)
class TrainBatch:
    """This rank's scored rollout, rows in training order."""

    traj: Trajectory  # rows [B]
    cond: Conditioning  # [B]
    advantages: torch.Tensor  # [B] fp32
    group_ids: torch.Tensor  # [B] int64

    def __len__(self) -> int:
        return int(self.advantages.shape[0])

    def select(self, rows: torch.Tensor) -> "TrainBatch":
        return replace(self, traj=self.traj.select(rows), cond=self.cond.index(rows),
                       advantages=self.advantages[rows], group_ids=self.group_ids[rows])


def trained_steps_for(cfg: Config, step: int) -> tuple[int, ...]:
    """The trained step indices of the rollout at training ``step`` (resampled from ``sampler.sde_pool`` with a
    seed of (run seed, step) when a pool is set: identical on every rank without communication)."""
    s = cfg.sampler
    return tuple(schedules.resolve_trained_steps(
        s.num_steps, indices=s.trained_indices, num_sde_steps=s.num_sde_steps, fraction=tuple(s.sde_window),
        pool=s.sde_pool, resample_seed=None if s.sde_pool is None else cfg.run.seed * 1_000_003 + step))


def _mean_metrics(acc: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack(v).mean() for k, v in acc.items()}


class Objective:
    """Base class. Subclasses set ``name``, the class attributes above, and implement the two methods."""

    name: ClassVar[str]
    uses_log_probs: ClassVar[bool] = False
    clipped_ratio: ClassVar[bool] = False

    def __init__(self, cfg: Config, adapter, policy):
        self.cfg = cfg
        self.adapter = adapter
        self.policy = policy

    def rollout_spec(self, step: int) -> RolloutSpec:
        raise NotImplementedError

    @classmethod
    def optimizer_steps_per_batch(cls, cfg: Config) -> int:
        """Optimizer steps one batch produces (sets the length of the LR schedule)."""
        return cfg.train.num_updates_per_batch

    def optimize(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _micro_batches(self, rows: torch.Tensor):
        mb = self.cfg.train.micro_batch_size
        return [rows[i:i + mb] for i in range(0, rows.numel(), mb)]


class GRPO(Objective):
    """FlowGRPO (Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via Online RL"; flow_grpo
    ``scripts/train_sd3.py``): PPO-clip over replayed SDE steps with group-relative advantages.

    The batch is split into ``num_updates_per_batch`` disjoint updates (one optimizer step each); each update's
    loss is the mean over its samples and trained steps of :func:`~flowforge.algorithms.losses.grpo_clip_loss`
    (backward per trained step and micro-batch, scaled so the gradient equals that mean's). The old log-probs are the
    rollout's, so the first update's ratio is exactly 1. Optional KL to the reference policy (``grpo.kl_weight``):
    the transition-mean KL ``|mean - mean_ref|^2 / (2 std^2)`` (flow_grpo's ``kl_loss``), mean over elements.
    """

    name = "grpo"
    uses_log_probs = True
    clipped_ratio = True

    def rollout_spec(self, step: int) -> RolloutSpec:
        s = self.cfg.sampler
        return RolloutSpec(kind=s.sde_kind, noise_level=s.noise_level, trained_steps=trained_steps_for(self.cfg, step),
                           guidance_scale=s.guidance_scale, store_steps=True, log_probs=True)

    def step_loss(self, sub: TrainBatch, slot: int, spec: RolloutSpec) -> tuple[torch.Tensor, dict]:
        """Loss of one trained step on a micro-batch (mean over its samples) and its metrics."""
        g = self.cfg.grpo
        tr = replay_log_prob(self.adapter, sub.traj, slot, sub.cond, spec)
        loss, metrics = losses.grpo_clip_loss(tr.log_prob, sub.traj.log_probs[:, slot], sub.advantages,
                                              g.clip_low, g.clip_high)
        if g.kl_weight > 0:
            with self.policy.reference():
                ref = replay_log_prob(self.adapter, sub.traj, slot, sub.cond, spec)
            kl = losses.transition_mean_kl(tr.mean, ref.mean, tr.std).mean()
            loss = loss + g.kl_weight * kl
            metrics = {**metrics, "kl": kl.detach()}
        return loss, metrics

    def optimize(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        spec = self._spec_of(batch)
        n_updates = self.cfg.train.num_updates_per_batch
        per_update = len(batch) // n_updates
        num_slots = len(batch.traj.trained_steps)
        acc: dict[str, list[torch.Tensor]] = {}
        first_dev = torch.zeros(())
        for u in range(n_updates):
            rows_u = torch.arange(u * per_update, (u + 1) * per_update)
            for rows in self._micro_batches(rows_u):
                sub = batch.select(rows)
                for slot in range(num_slots):
                    loss, m = self.step_loss(sub, slot, spec)
                    (loss * (rows.numel() / per_update) / num_slots).backward()
                    for k, v in m.items():
                        acc.setdefault(k, []).append(v)
                    acc.setdefault("loss", []).append(loss.detach())
                    if u == 0:
                        first_dev = torch.maximum(first_dev, torch.maximum(m["ratio_max"] - 1, 1 - m["ratio_min"]))
            acc.setdefault("grad_norm", []).append(self.policy.step())
        out = _mean_metrics(acc)
        out["ratio_min"] = torch.stack(acc["ratio_min"]).min()
        out["ratio_max"] = torch.stack(acc["ratio_max"]).max()
        out["first_update_ratio_dev"] = first_dev
        return out

    def _spec_of(self, batch: TrainBatch) -> RolloutSpec:
        s = self.cfg.sampler
        return RolloutSpec(kind=s.sde_kind, noise_level=s.noise_level, trained_steps=batch.traj.trained_steps,
                           guidance_scale=s.guidance_scale)


OBJECTIVES: dict[str, type[Objective]] = {
    GRPO.name: GRPO,
}
