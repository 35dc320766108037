"""Advantage Weighted Matching: a PPO-clipped surrogate on the flow-matching likelihood proxy (sections ``forward``
+ ``awm``).

Xue et al. 2025, arXiv 2509.25050; ``scxue/advantage_weighted_matching`` ``train_sd3_awm.py``. The loss is
:func:`~flowforge.algorithms.losses.awm_loss`. The old policy is the batch's sampling policy: it is synced to live
after every batch (decay 0), so the first update's ratio is exactly 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowforge.algorithms import losses
from flowforge.algorithms.losses import AWM_WEIGHTINGS
from flowforge.objectives.base import ObjectiveContext, TrainBatch
from flowforge.objectives.forward import ForwardConfig, ForwardProcessObjective, Visit
from flowforge.settings import Checks, Section


@dataclass(frozen=True)
class AWMConfig(Section):
    """Advantage Weighted Matching clip and weighting."""

    section_name = "awm"

    clip_low: float = 1e-4
    clip_high: float | None = None
    weighting: str = "ghuber"  # "uniform" | "t" | "t**2" | "huber" | "ghuber"
    ghuber_power: float = 0.25
    adv_max: float | None = None  # set: the advantages (clipped to advantage.clip) are rescaled by adv_max / clip
    kl_weight: float = 0.0  # velocity-MSE KL to the reference policy

    def problems(self) -> list[str]:
        c = Checks(self)
        c.choice("weighting", AWM_WEIGHTINGS)
        c.positive("clip_low", "clip_high", "ghuber_power", "adv_max")
        c.positive("kl_weight", allow_zero=True)
        return c.problems


class AWM(ForwardProcessObjective):
    """Advantage Weighted Matching (see the module docstring); optional velocity-MSE KL to the reference
    (``awm.kl_weight``)."""

    name = "awm"
    sections = (ForwardConfig, AWMConfig)
    clipped_ratio = True
    awm: AWMConfig

    @classmethod
    def needs_ref(cls, ctx: ObjectiveContext) -> bool:
        return ctx.sections["awm"].kl_weight > 0

    def __init__(self, ctx: ObjectiveContext, adapter, policy):
        super().__init__(ctx, adapter, policy)
        self.sampling_policy = "old"

    def old_decay(self) -> float:
        return 0.0

    def micro_loss(self, sub: TrainBatch, extras: dict[str, torch.Tensor], visit: Visit):
        a = self.awm
        v_old = self.velocity(visit, sub.cond, "old")
        v_ref = self.velocity(visit, sub.cond, "ref") if a.kl_weight > 0 else None
        v_live = self.velocity(visit, sub.cond)
        loss, m = losses.awm_loss(v_live, v_old, visit.x0, visit.noise, visit.sigma, sub.advantages,
                                  clip_low=a.clip_low, clip_high=a.clip_high, weighting=a.weighting,
                                  ghuber_power=a.ghuber_power, adv_max=a.adv_max,
                                  adv_clip=self.ctx.advantage_clip if a.adv_max is not None else None)
        if v_ref is not None:
            kl = losses.velocity_mse_kl(v_live, v_ref).mean()
            loss = loss + a.kl_weight * kl
            m = {**m, "kl": kl}
        return loss, m
