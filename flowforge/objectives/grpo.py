"""FlowGRPO: PPO-clip over replayed SDE steps with group-relative advantages (section ``grpo``).

Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via Online RL"; flow_grpo ``scripts/train_sd3.py``.
Per trained step the clipped surrogate :func:`~flowforge.algorithms.losses.grpo_clip_loss` with
``ratio = exp(log p_live - log p_rollout)``; optional KL to the reference policy (``grpo.kl_weight`` = flow_grpo's
``beta``), flow_grpo's ``kl_loss`` ``mean_el(|mean - mean_ref|^2) / (2 std_dev_t^2)`` with ``std_dev_t`` the SDE
coefficient (not the transition std), :func:`~flowforge.algorithms.losses.flow_grpo_kl`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowforge.algorithms import losses
from flowforge.algorithms.ema import EMA_SCHEDULES
from flowforge.objectives.base import ObjectiveContext, TrainBatch
from flowforge.objectives.replay import ReplayObjective
from flowforge.rollout import RolloutSpec, replay_log_prob
from flowforge.settings import Checks, Section


@dataclass(frozen=True)
class GRPOConfig(Section):
    """FlowGRPO clip range and KL weight (also read by ``grpo_guard``)."""

    section_name = "grpo"

    clip_low: float = 1e-4
    clip_high: float | None = None  # None: equal to clip_low
    kl_weight: float = 0.0  # flow_grpo's beta: weight of its kl_loss to the reference policy
    ema_decay: float = 0.0  # > 0: keep an eval EMA of live with this decay (flow_grpo's train.ema; 0 = none)
    ema_schedule: str = "constant"  # "constant" | "warmup": d = min((1 + n) / (10 + n), ema_decay) (flow_grpo)

    def problems(self) -> list[str]:
        c = Checks(self)
        c.choice("ema_schedule", EMA_SCHEDULES)
        c.require(0 <= self.ema_decay < 1, f"grpo.ema_decay={self.ema_decay} must be in [0, 1) (0 = no EMA)")
        c.require(self.clip_low > 0 and (self.clip_high is None or self.clip_high > 0),
                  f"grpo.clip_low={self.clip_low} / grpo.clip_high={self.clip_high} must be > 0")
        c.positive("kl_weight", allow_zero=True)
        return c.problems


class GRPO(ReplayObjective):
    """FlowGRPO (see the module docstring). The old log-probs are the rollout's, so the first update's ratio is
    exactly 1."""

    name = "grpo"
    sections = (GRPOConfig,)
    clipped_ratio = True
    accepts_staleness = True  # the ratio is against the rollout's recorded log-probs (also grpo_guard, dppo)
    grpo: GRPOConfig

    def __init__(self, ctx: ObjectiveContext, adapter, policy):
        super().__init__(ctx, adapter, policy)
        # as flow_grpo's train.ema (flow_grpo/ema.py, copy_ema_to around eval): held-out evals see the EMA, the
        # rollouts and updates use live
        self.eval_policy = "ema" if self.grpo.ema_decay > 0 else "live"

    @classmethod
    def policy_bank(cls, ctx: ObjectiveContext) -> dict:
        g = ctx.sections["grpo"]
        return {"keep_ref": g.kl_weight > 0, "ema_decay": g.ema_decay, "ema_schedule": g.ema_schedule}

    def surrogate(self, tr, sub: TrainBatch, slot: int) -> tuple[torch.Tensor, dict]:
        """The clipped surrogate of one replayed step (``tr`` the live transition)."""
        g = self.grpo
        return losses.grpo_clip_loss(tr.log_prob, sub.traj.log_probs[:, slot], sub.advantages, g.clip_low,
                                     g.clip_high)

    def step_loss(self, sub: TrainBatch, slot: int, spec: RolloutSpec) -> tuple[torch.Tensor, dict]:
        g = self.grpo
        ref = None
        if g.kl_weight > 0:
            with self.policy.reference():
                ref = replay_log_prob(self.adapter, sub.traj, slot, sub.cond, spec)
        tr = replay_log_prob(self.adapter, sub.traj, slot, sub.cond, spec)
        loss, metrics = self.surrogate(tr, sub, slot)
        if ref is not None:
            # flow_grpo's kl_loss: the squared mean difference over 2 std_dev_t^2 (the SDE coefficient, without the
            # sqrt(-dt) of the transition std), so grpo.kl_weight is exactly flow_grpo's beta
            i = sub.traj.trained_steps[slot]
            sig = sub.traj.sigmas.to(tr.mean.device)
            kl = losses.flow_grpo_kl(tr.mean, ref.mean, sig[i], sig[i + 1], spec.noise_level, kind=spec.kind,
                                     sigma_max=sig[1]).mean()
            loss = loss + g.kl_weight * kl
            metrics = {**metrics, "kl": kl.detach()}
        return loss, metrics
