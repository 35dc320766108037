"""Online Diffusion-DPO: best vs worst candidate of each group against the frozen reference (sections ``forward``
+ ``dpo``).

Wallace et al. 2023, "Diffusion Model Alignment Using Direct Preference Optimization";
``SalesforceAIResearch/DiffusionDPO``. After advantages exist, each group's best and worst candidates form a chosen
/ rejected pair (:func:`~flowforge.algorithms.losses.best_worst_pairs`; tied groups form none), noised with the same
noise and sigma, and :func:`~flowforge.algorithms.losses.diffusion_dpo_loss` is taken against the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowforge.algorithms import losses
from flowforge.objectives.base import ObjectiveContext, TrainBatch, global_sum
from flowforge.objectives.forward import ForwardConfig, ForwardProcessObjective, Visit
from flowforge.settings import Checks, Section


@dataclass(frozen=True)
class DPOConfig(Section):
    """Diffusion-DPO beta."""

    section_name = "dpo"

    beta: float = 2000.0

    def problems(self) -> list[str]:
        c = Checks(self)
        c.positive("beta")
        return c.problems


class DPO(ForwardProcessObjective):
    """Online Diffusion-DPO (see the module docstring). On-policy (samples with live). Under data parallelism a
    rank with fewer pairs runs zero-weight padding pairs so all ranks stay in lockstep."""

    name = "dpo"
    sections = (ForwardConfig, DPOConfig)
    group_shared = True
    keeps_old = False
    dpo: DPOConfig

    @classmethod
    def needs_ref(cls, ctx: ObjectiveContext) -> bool:
        return True

    def prepare(self, batch: TrainBatch):
        chosen, rejected = losses.best_worst_pairs(batch.rewards, batch.group_ids)
        rows = torch.cat([chosen, rejected])
        role = torch.cat([torch.ones_like(chosen), torch.zeros_like(rejected)]).float()
        return batch.select(rows), {"chosen": role}, {"pairs": global_sum(chosen.numel())}

    def padding(self, batch: TrainBatch):
        """The first two rows of the first group as a (chosen, rejected) pair (tied or not: its loss counts 0)."""
        members = torch.nonzero(batch.group_ids == batch.group_ids[0]).squeeze(1).repeat(2)[:2]
        return batch.select(members), {"chosen": torch.tensor([1.0, 0.0])}

    def micro_loss(self, sub: TrainBatch, extras: dict[str, torch.Tensor], visit: Visit):
        chosen = extras["chosen"].bool()
        order_w = torch.argsort(sub.group_ids[chosen], stable=True)
        order_l = torch.argsort(sub.group_ids[~chosen], stable=True)
        v_ref = self.velocity(visit, sub.cond, "ref")
        v_live = self.velocity(visit, sub.cond)
        err_live = losses.velocity_mse_kl(v_live, visit.target)
        err_ref = losses.velocity_mse_kl(v_ref, visit.target)
        return losses.diffusion_dpo_loss(err_live[chosen][order_w], err_live[~chosen][order_l],
                                         err_ref[chosen][order_w], err_ref[~chosen][order_l], beta=self.dpo.beta)
