"""GRPO-Guard: FlowGRPO with RatioNorm and per-step ``1 / -dt`` reweighting (sections ``grpo`` + ``grpo_guard``).

Wang et al. 2025, "GRPO-Guard: Mitigating Implicit Over-Optimization in Flow Matching via Regulated Clipping".
The loss is :func:`~flowforge.algorithms.losses.grpo_guard_loss`; the clip range and KL weight are the ``grpo``
section's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowforge.algorithms import losses
from flowforge.algorithms.losses import GUARD_STEP_WEIGHTS
from flowforge.objectives.base import TrainBatch
from flowforge.objectives.grpo import GRPO, GRPOConfig
from flowforge.settings import Checks, Section


@dataclass(frozen=True)
class GuardConfig(Section):
    section_name = "grpo_guard"

    step_weight: str = "inv_dt"  # GRPO-Guard per-step reweighting: "inv_dt" | "none"

    def problems(self) -> list[str]:
        c = Checks(self)
        c.choice("step_weight", GUARD_STEP_WEIGHTS)
        return c.problems


class GRPOGuard(GRPO):
    """GRPO-Guard (see the module docstring). The rollout also stores each trained step's transition mean (the
    old mean the normalization needs). Needs a Gaussian log-prob: ``sampler.sde_kind`` "sde" or "dance"."""

    name = "grpo_guard"
    sections = (GRPOConfig, GuardConfig)
    store_means = True
    grpo_guard: GuardConfig

    def surrogate(self, tr, sub: TrainBatch, slot: int) -> tuple[torch.Tensor, dict]:
        g = self.grpo
        i = sub.traj.trained_steps[slot]
        dt = sub.traj.sigmas[i + 1] - sub.traj.sigmas[i]
        return losses.grpo_guard_loss(tr.log_prob, sub.traj.log_probs[:, slot], sub.advantages, g.clip_low,
                                      g.clip_high, mean=tr.mean, old_mean=sub.traj.means[:, slot], std=tr.std,
                                      dt=dt, step_weight=self.grpo_guard.step_weight)
