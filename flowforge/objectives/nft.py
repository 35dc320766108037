"""DiffusionNFT: implicit positive / negative policies on the forward process (sections ``forward`` + ``nft``).

Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement with Forward Process"; NVlabs
``scripts/train_nft_sd3.py``. :func:`~flowforge.algorithms.losses.nft_loss` mixes the implicit positive and
negative policies built from the live and old velocities with the optimality reward ``r`` in [0, 1]:

* ``nft.reward_transform="reference"``: ``r = nft_optimality(A, adv_clip)`` of the clipped group advantages;
* ``"absolute"``: ``r = 0.5 + 0.5 clip((S - mean_g) / (adv_clip max(std, std_floor)), -1, 1)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowforge.algorithms import advantages as adv_lib
from flowforge.algorithms import losses
from flowforge.algorithms.ema import EMA_SCHEDULES
from flowforge.algorithms.losses import NFT_MODES
from flowforge.objectives.base import ObjectiveContext, TrainBatch, global_sum
from flowforge.objectives.forward import ForwardConfig, ForwardProcessObjective, Visit
from flowforge.settings import Checks, Section

NFT_REWARD_TRANSFORMS = ("reference", "absolute")
NFT_STD_SCOPES = ("group", "batch")


@dataclass(frozen=True)
class NFTConfig(Section):
    """DiffusionNFT beta, reward transform, guard, EMA."""

    section_name = "nft"

    beta: float = 1.0
    adv_clip: float = 5.0
    loss_mode: str = "reference"  # "reference" (adaptive x0 weighting) | "paper_velocity_mse"
    reward_transform: str = "reference"  # "reference" (clipped group advantages) | "absolute"
    std_floor: float = 0.0  # absolute transform: Z = adv_clip * max(std, std_floor)
    std_scope: str = "group"  # absolute transform: std per "group" or over the whole "batch"
    guard: bool = False  # skip groups that tie, spread < guard_min_spread, or best < guard_min_best
    guard_min_spread: float = 0.0
    guard_min_best: float | None = None
    ema_decay: float = 0.0  # > 0: keep an eval EMA of live with this decay (the warm-up's cap)
    ema_schedule: str = "constant"  # "constant" | "warmup": d = min((1 + n) / (10 + n), ema_decay) (NVlabs)
    ref_weight: float = 0.0  # velocity-MSE penalty to the reference policy

    def problems(self) -> list[str]:
        c = Checks(self)
        c.choice("loss_mode", NFT_MODES)
        c.choice("reward_transform", NFT_REWARD_TRANSFORMS)
        c.choice("std_scope", NFT_STD_SCOPES)
        c.choice("ema_schedule", EMA_SCHEDULES)
        c.require(0 <= self.ema_decay < 1, f"nft.ema_decay={self.ema_decay} must be in [0, 1) (0 = no EMA)")
        c.positive("beta", "adv_clip")
        c.positive("ref_weight", "std_floor", "guard_min_spread", allow_zero=True)
        return c.problems


class NFT(ForwardProcessObjective):
    """DiffusionNFT (see the module docstring).

    With ``nft.guard`` whole groups that tie / spread too little / score too low are skipped (kept in the data,
    never re-drawn, counted as ``train/guard_skipped_groups``; under data parallelism ranks that skipped more
    run zero-weight padding so all stay in lockstep). Optional velocity-MSE penalty to the reference
    (``nft.ref_weight``) and an eval EMA (``nft.ema_decay``; ``nft.ema_schedule="warmup"`` is NVlabs' warm-up
    ``min((1 + n) / (10 + n), ema_decay)`` after optimizer step ``n``, so early evaluations see the trained weights).
    """

    name = "nft"
    sections = (ForwardConfig, NFTConfig)
    nft: NFTConfig

    def __init__(self, ctx: ObjectiveContext, adapter, policy):
        super().__init__(ctx, adapter, policy)
        self.eval_policy = "ema" if self.nft.ema_decay > 0 else "live"

    @classmethod
    def needs_ref(cls, ctx: ObjectiveContext) -> bool:
        return ctx.sections["nft"].ref_weight > 0

    @classmethod
    def needs_whole_groups(cls, ctx: ObjectiveContext) -> bool:
        n = ctx.sections["nft"]
        return n.reward_transform == "absolute" or n.guard

    @classmethod
    def policy_bank(cls, ctx: ObjectiveContext) -> dict:
        n = ctx.sections["nft"]
        return {**super().policy_bank(ctx), "ema_decay": n.ema_decay, "ema_schedule": n.ema_schedule}

    def optimality(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``r [B]`` in [0, 1] and the ``[B]`` bool mask of samples kept by the guard."""
        n = self.nft
        if n.reward_transform == "absolute":
            r = adv_lib.nft_absolute_optimality(batch.rewards, batch.group_ids, adv_clip=n.adv_clip,
                                                std_floor=n.std_floor, std_scope=n.std_scope)
        else:
            r = adv_lib.nft_optimality(batch.advantages, n.adv_clip)
        if n.guard:
            keep = adv_lib.group_guard(batch.rewards, batch.group_ids, min_spread=n.guard_min_spread,
                                       min_best=n.guard_min_best)
        else:
            keep = torch.ones_like(r, dtype=torch.bool)
        return r, keep

    def prepare(self, batch: TrainBatch):
        r, keep = self.optimality(batch)
        kept = torch.nonzero(keep).squeeze(1)
        r_sum, n_kept = global_sum(r[keep].sum()), global_sum(kept.numel())  # over every rank's rows
        metrics = {"r_mean": r_sum / n_kept if n_kept > 0 else torch.tensor(float("nan")),
                   "guard_skipped_groups": global_sum(len(set(batch.group_ids[~keep].tolist())))}
        return batch.select(kept), {"r": r[kept]}, metrics

    def padding(self, batch: TrainBatch):
        rows = torch.arange(min(len(batch), self._micro_size(batch)))
        return batch.select(rows), {"r": torch.full((rows.numel(),), 0.5)}

    def micro_loss(self, sub: TrainBatch, extras: dict[str, torch.Tensor], visit: Visit):
        n = self.nft
        v_old = self.velocity(visit, sub.cond, "old")
        v_ref = self.velocity(visit, sub.cond, "ref") if n.ref_weight > 0 else None
        v_live = self.velocity(visit, sub.cond)
        loss, m = losses.nft_loss(v_live, v_old, visit.x_sigma, visit.x0, visit.sigma, extras["r"], beta=n.beta,
                                  adv_clip=n.adv_clip, mode=n.loss_mode)
        metrics = {"policy_loss": loss, "positive_loss": m["positive_loss"].mean(),
                   "negative_loss": m["negative_loss"].mean(),
                   "old_deviation": losses.velocity_mse_kl(v_live.detach(), v_old).mean()}
        if v_ref is not None:
            kl = losses.velocity_mse_kl(v_live, v_ref).mean()
            loss = loss + n.ref_weight * kl
            metrics["ref_kl"] = kl
        return loss, metrics
