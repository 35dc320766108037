"""Centered Reward Distillation (sections ``forward`` + ``crd``).

arXiv 2603.14128; implementation as X-GenGroup/Flow-Factory ``trainers/rl/crd.py``: regress the live-vs-old
implicit reward, centred within each group, onto the centred external reward
(:func:`~flowforge.algorithms.losses.crd_loss`); optional reward-adaptive anchor (``crd.kl_beta``) to the reference
teacher guided with ``crd.teacher_guidance`` (CFG; needs negative conditioning when != 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowforge.algorithms import losses
from flowforge.algorithms.losses import CRD_LOSS_TYPES
from flowforge.objectives.base import ObjectiveContext, TrainBatch
from flowforge.objectives.forward import ForwardConfig, ForwardProcessObjective, Visit
from flowforge.settings import Checks, Section


@dataclass(frozen=True)
class CRDConfig(Section):
    """Centered Reward Distillation beta, loss type, teacher."""

    section_name = "crd"

    beta: float = 1.0
    adv_clip: float = 5.0
    loss_type: str = "mse"  # "mse" | "bce"
    kl_beta: float = 0.0  # anchor to the CFG-guided reference teacher
    teacher_guidance: float = 1.0

    def problems(self) -> list[str]:
        c = Checks(self)
        c.choice("loss_type", CRD_LOSS_TYPES)
        c.positive("beta", "adv_clip")
        c.positive("kl_beta", allow_zero=True)
        return c.problems


class CRD(ForwardProcessObjective):
    """Centered Reward Distillation (see the module docstring). Whole groups per micro-batch."""

    name = "crd"
    sections = (ForwardConfig, CRDConfig)
    group_shared = True
    crd: CRDConfig

    @classmethod
    def needs_ref(cls, ctx: ObjectiveContext) -> bool:
        return ctx.sections["crd"].kl_beta > 0

    def micro_loss(self, sub: TrainBatch, extras: dict[str, torch.Tensor], visit: Visit):
        c = self.crd
        v_old = self.velocity(visit, sub.cond, "old")
        v_teacher = self.velocity(visit, sub.cond, "ref", c.teacher_guidance) if c.kl_beta > 0 else None
        v_live = self.velocity(visit, sub.cond)
        return losses.crd_loss(v_live, v_old, visit.target, sub.group_ids, sub.advantages, beta=c.beta,
                               adv_clip=c.adv_clip, loss_type=c.loss_type, v_teacher=v_teacher, kl_beta=c.kl_beta)
