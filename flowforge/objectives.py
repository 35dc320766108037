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

from flowforge.algorithms import advantages as adv_lib
from flowforge.algorithms import losses, schedules
from flowforge.config import Config
from flowforge.models.base import Conditioning
from flowforge.policy import old_decay
from flowforge.rollout import RolloutSpec, Trajectory, candidate_noise, candidate_randint, replay_log_prob


@dataclass(frozen=True)
class TrainBatch:
    """This rank's scored rollout, rows in training order."""

    traj: Trajectory  # rows [B]
    cond: Conditioning  # [B]
    advantages: torch.Tensor  # [B] fp32
    group_ids: torch.Tensor  # [B] int64
    rewards: torch.Tensor  # [B] fp32 weighted total reward (for objectives that transform scores themselves)
    candidate_ids: torch.Tensor  # [B] int64 stable per-candidate ids (seed training-time noise)

    def __len__(self) -> int:
        return int(self.advantages.shape[0])

    def select(self, rows: torch.Tensor) -> "TrainBatch":
        return replace(self, traj=self.traj.select(rows), cond=self.cond.index(rows),
                       advantages=self.advantages[rows], group_ids=self.group_ids[rows],
                       rewards=self.rewards[rows], candidate_ids=self.candidate_ids[rows])


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
    sampling_policy: str = "live"  # the bank policy that rolls out (see flowforge.policy)
    eval_policy: str = "live"

    @classmethod
    def policy_bank(cls, cfg: Config) -> dict:
        """Keyword arguments for :class:`flowforge.policy.Policy`: which extra policies this objective needs."""
        return {}

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


class NFT(Objective):
    """DiffusionNFT (Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement with Forward Process";
    NVlabs ``scripts/train_nft_sd3.py``): forward-process training on the clean samples of any sampler.

    Rollout: ``nft.sampler`` (ODE by default) under the **old** policy (``nft.sample_with``), keeping only x0.
    Per visit: ``sigma`` from the sampling schedule (one uniform draw per sample, or every schedule step with
    ``nft.sigma_mode="full_schedule"``), fresh noise, ``x_sigma = (1 - sigma) x0 + sigma * noise``; the old policy
    (no grad) and the live policy see the same ``x_sigma``; :func:`~flowforge.algorithms.losses.nft_loss` mixes the
    implicit positive / negative policies with the optimality reward ``r`` in [0, 1]:

    * ``nft.reward_transform="reference"``: ``r = nft_optimality(A, adv_clip)`` of the clipped group advantages;
    * ``"absolute"``: ``r = 0.5 + 0.5 clip((S - mean_g) / (adv_clip max(std, std_floor)), -1, 1)``.

    With ``nft.guard`` whole groups that tie / spread too little / score too low are skipped (kept in the data,
    never re-drawn, counted as ``train/guard_skipped_groups``). After the batch the old policy moves toward live:
    ``old <- d old + (1 - d) live``, ``d = min(decay_rate n, decay_max)`` (the reference's ``return_decay``).
    Training noise and sigma indices are functions of (seed, candidate id, step, visit): rank- and order-free.
    """

    name = "nft"
    sampling_policy = "old"

    def __init__(self, cfg: Config, adapter, policy):
        super().__init__(cfg, adapter, policy)
        self.sampling_policy = cfg.nft.sample_with
        self.eval_policy = "ema" if cfg.nft.ema_decay > 0 else "live"
        self._step = 0

    @classmethod
    def policy_bank(cls, cfg: Config) -> dict:
        return {"keep_old": True, "ema_decay": cfg.nft.ema_decay}

    @classmethod
    def optimizer_steps_per_batch(cls, cfg: Config) -> int:
        return cfg.train.num_updates_per_batch * cfg.nft.inner_epochs

    def rollout_spec(self, step: int) -> RolloutSpec:
        s, n = self.cfg.sampler, self.cfg.nft
        self._step = step
        return RolloutSpec(kind=n.sampler, noise_level=s.noise_level, trained_steps=(),
                           guidance_scale=s.guidance_scale, store_steps=False, log_probs=False)

    def optimality(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``r [B]`` in [0, 1] and the ``[B]`` bool mask of samples kept by the guard."""
        n = self.cfg.nft
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

    def visits(self, batch: TrainBatch, epoch: int) -> list[tuple[torch.Tensor, int]]:
        """``(sigma_index [B], slot)`` per visit of this inner epoch; ``slot`` seeds the visit's noise."""
        num_steps = self.cfg.sampler.num_steps
        base = -2 - (self._step * self.cfg.nft.inner_epochs + epoch) * num_steps
        ids = batch.candidate_ids.tolist()
        if self.cfg.nft.sigma_mode == "full_schedule":
            return [(torch.full((len(ids),), j, dtype=torch.long), base - j) for j in range(num_steps)]
        return [(candidate_randint(ids, num_steps, self.cfg.run.seed, base), base)]

    def micro_loss(self, sub: TrainBatch, r: torch.Tensor, sigma_index: torch.Tensor, slot: int):
        """NFT loss of one micro-batch and visit (mean over its samples) and its metrics."""
        n = self.cfg.nft
        x0 = sub.traj.final
        sigma = sub.traj.sigmas.to(x0.device)[sigma_index]
        noise = candidate_noise(sub.candidate_ids.tolist(), x0.shape[1:], self.cfg.run.seed, slot).to(x0.device)
        s = sigma.reshape(-1, *([1] * (x0.ndim - 1)))
        x_sigma = (1 - s) * x0 + s * noise
        with torch.no_grad(), self.policy.using("old"):
            v_old = self.adapter.velocity(x_sigma, sigma, sub.cond, 1.0)
        v_ref = None
        if n.ref_weight > 0:
            with self.policy.reference():
                v_ref = self.adapter.velocity(x_sigma, sigma, sub.cond, 1.0)
        v_live = self.policy.pending(self.adapter.velocity(x_sigma, sigma, sub.cond, 1.0))
        loss, m = losses.nft_loss(v_live, v_old, x_sigma, x0, sigma, r, beta=n.beta, adv_clip=n.adv_clip,
                                  mode=n.loss_mode)
        metrics = {"policy_loss": loss.detach(), "positive_loss": m["positive_loss"].mean(),
                   "negative_loss": m["negative_loss"].mean(),
                   "old_deviation": losses.velocity_mse_kl(v_live.detach(), v_old).mean()}
        if v_ref is not None:
            kl = losses.velocity_mse_kl(v_live, v_ref).mean()
            loss = loss + n.ref_weight * kl
            metrics["ref_kl"] = kl.detach()
        return loss, metrics

    def optimize(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        n = self.cfg.nft
        r_all, keep = self.optimality(batch)
        kept = torch.nonzero(keep).squeeze(1)
        out: dict[str, torch.Tensor] = {
            "r_mean": r_all[keep].mean() if kept.numel() else torch.tensor(float("nan")),
            "guard_skipped_groups": torch.tensor(float(len(set(batch.group_ids[~keep].tolist())))),
        }
        if kept.numel() == 0:
            return out
        batch, r_all = batch.select(kept), r_all[kept]
        n_updates = self.cfg.train.num_updates_per_batch
        bounds = torch.linspace(0, len(batch), n_updates + 1).round().long().tolist()
        acc: dict[str, list[torch.Tensor]] = {}
        for epoch in range(n.inner_epochs):
            visits = self.visits(batch, epoch)
            for u in range(n_updates):
                rows_u = torch.arange(bounds[u], bounds[u + 1])
                if rows_u.numel() == 0:
                    continue
                for rows in self._micro_batches(rows_u):
                    sub = batch.select(rows)
                    for sigma_index, slot in visits:
                        loss, m = self.micro_loss(sub, r_all[rows], sigma_index[rows], slot)
                        self.policy.backward(loss * (rows.numel() / rows_u.numel()) / len(visits))
                        for k, v in {**m, "loss": loss.detach()}.items():
                            acc.setdefault(k, []).append(v)
                acc.setdefault("grad_norm", []).append(self.policy.step())
        decay = old_decay(self.policy.optimizer_steps, n.decay_rate, n.decay_max)
        self.policy.blend("old", decay)
        out.update(_mean_metrics(acc))
        out["old_decay"] = torch.tensor(decay)
        return out


OBJECTIVES: dict[str, type[Objective]] = {
    GRPO.name: GRPO,
    NFT.name: NFT,
}
