"""Flow-DPPO: FlowGRPO's replay with a divergence trust-region mask in place of the ratio clip (sections ``grpo`` +
``dppo``).

Ping et al. 2026, "Flow-DPPO: Divergence Proximal Policy Optimization for Flow Matching Models" (Eq. 14, 18);
reference implementation Tencent-Hunyuan/UniRL ``unirl/algorithms/flowdppo.py``. The loss is
:func:`~flowforge.algorithms.losses.dppo_loss`: per stored step, the unclipped surrogate ``-A * ratio`` whose gradient
is dropped only where the KL between the live and the rollout transition (from their means, equal std) is at least
``dppo.delta`` AND the update moves further out in the advantage's direction. The rollout stores each trained step's
transition mean (the old mean). ``grpo.kl_weight`` (KL to the reference policy) applies as in FlowGRPO; the ``grpo``
clip range is not used. The mask's std is the one the rollout sampled with, also at ``sigma = 1`` (Flow-Factory-Draft's
convention; UniRL's normaliser differs there only, see :mod:`flowforge.algorithms.losses.dppo`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from flowforge.algorithms import losses
from flowforge.objectives.base import TrainBatch
from flowforge.objectives.grpo import GRPO, GRPOConfig
from flowforge.settings import ALLOW_INF, Checks, Section


@dataclass(frozen=True)
class DPPOConfig(Section):
    """Flow-DPPO's trust region."""

    section_name = "dppo"

    # KL threshold of the mask, mean over latent elements (UniRL's default kl_mask_threshold); inf: no mask
    delta: float = field(default=1e-5, metadata=ALLOW_INF)
    adv_clip: float | None = None  # clamp advantages to [-adv_clip, adv_clip] first (Flow-Factory's DPPOTrainer)

    def problems(self) -> list[str]:
        c = Checks(self)
        # inf is allowed on purpose: it disables the mask (plain unclipped policy gradient)
        c.require(self.delta > 0 and not math.isnan(self.delta), f"dppo.delta={self.delta} must be > 0 (inf: no mask)")
        c.require(self.adv_clip is None or (self.adv_clip > 0 and math.isfinite(self.adv_clip)),
                  f"dppo.adv_clip={self.adv_clip} must be a finite number > 0 or null")
        return c.problems


class DPPO(GRPO):
    """Flow-DPPO (see the module docstring). Needs a Gaussian transition with a stored mean: ``sampler.sde_kind``
    "sde" or "dance" (preflight refuses others: :attr:`sde_kinds`). "cps" is refused because its default log-prob is
    flow_grpo's unnormalised score (``-mean((x_next - mean)^2)``, not a Gaussian density), so its ratio is not the
    density ratio the divergence mask is calibrated against. The first update's ratio is exactly 1 and nothing is
    masked there."""

    name = "dppo"
    sections = (GRPOConfig, DPPOConfig)
    store_means = True
    sde_kinds = ("sde", "dance")

    @classmethod
    def preflight_problems(cls, cfg, *, world_size: int) -> list[str]:
        """GRPO's rules, and ``sampler.sde_kind`` one of :attr:`sde_kinds` (one line naming the allowed values)."""
        problems = super().preflight_problems(cfg, world_size=world_size)
        if cfg.sampler.sde_kind not in cls.sde_kinds:
            problems.append(f"sampler.sde_kind={cfg.sampler.sde_kind!r} is not allowed with train.algorithm='dppo' "
                            f"(the divergence mask needs a Gaussian transition density); allowed: {list(cls.sde_kinds)}")
        return problems
    dppo: DPPOConfig

    def surrogate(self, tr, sub: TrainBatch, slot: int) -> tuple[torch.Tensor, dict]:
        d = self.dppo
        return losses.dppo_loss(tr.log_prob, sub.traj.log_probs[:, slot], sub.advantages, mean=tr.mean,
                                old_mean=sub.traj.means[:, slot], std=tr.std, delta=d.delta, adv_clip=d.adv_clip)
