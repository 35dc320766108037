"""DGPO: group-level preference optimization against the frozen reference (sections ``forward`` + ``dgpo``).

Luo, Hu, Tang 2025, "Reinforcing Diffusion Models by Direct Group Preference Optimization", arXiv 2510.08425;
``Luo-Yihong/DGPO``. The loss is :func:`~flowforge.algorithms.losses.dgpo_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowforge.algorithms import losses
from flowforge.algorithms.losses import DGPO_MODES
from flowforge.objectives.base import ObjectiveContext, TrainBatch
from flowforge.objectives.forward import ForwardConfig, ForwardProcessObjective, Visit
from flowforge.settings import Checks, Section


@dataclass(frozen=True)
class DGPOConfig(Section):
    """DGPO beta and mode."""

    section_name = "dgpo"

    beta: float = 100.0
    mode: str = "reference"  # "reference" (official surrogate) | "paper"
    kl_weight: float = 0.0

    def problems(self) -> list[str]:
        c = Checks(self)
        c.choice("mode", DGPO_MODES)
        c.positive("beta")
        c.positive("kl_weight", allow_zero=True)
        return c.problems


class DGPO(ForwardProcessObjective):
    """DGPO (see the module docstring). Every member of a group shares noise and sigma; micro-batches hold whole
    groups. Samples with the live policy (on-policy); optional velocity-MSE KL (``dgpo.kl_weight``)."""

    name = "dgpo"
    sections = (ForwardConfig, DGPOConfig)
    group_shared = True
    keeps_old = False
    dgpo: DGPOConfig

    @classmethod
    def needs_ref(cls, ctx: ObjectiveContext) -> bool:
        return True

    def micro_loss(self, sub: TrainBatch, extras: dict[str, torch.Tensor], visit: Visit):
        d = self.dgpo
        v_ref = self.velocity(visit, sub.cond, "ref")
        v_live = self.velocity(visit, sub.cond)
        loss, m = losses.dgpo_loss(v_live, v_ref, visit.target, sub.group_ids, sub.advantages, beta=d.beta,
                                   mode=d.mode)
        if d.kl_weight > 0:
            kl = losses.velocity_mse_kl(v_live, v_ref).mean()
            loss = loss + d.kl_weight * kl
            m = {**m, "kl": kl}
        return loss, m
