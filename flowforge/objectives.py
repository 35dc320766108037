"""One class per algorithm: what it needs from the rollout, and how it turns a scored batch into updates.

An objective declares its rollout (:meth:`Objective.rollout_spec`) — the one loop in :mod:`flowforge.rollout` does
the sampling — and implements :meth:`Objective.optimize`, which calls the pure math in
:mod:`flowforge.algorithms.losses`. The loop picks the class from :data:`OBJECTIVES` by ``train.algorithm``.

Two families share their machinery:

* **replay** (``grpo``, ``grpo_guard``): SDE rollouts store the trained steps' ``x``, ``x_next`` and log-probs; the
  update re-scores those steps under the live weights (:func:`flowforge.rollout.replay_log_prob`).
* **forward process** (``nft``, ``awm``, ``dgpo``, ``dpo``, ``crd``): any sampler, only the final clean sample is
  kept; the update noises it, ``x_sigma = (1 - sigma) x0 + sigma noise``, and compares policies' velocities there
  (:class:`ForwardProcessObjective`). Noise and sigma of a visit are functions of (seed, candidate or group id,
  step, visit) only; group objectives share them within a prompt group and train on whole groups.

Guidance (``sampler.guidance_scale``): replay objectives roll out *and* replay with the same guided velocity
``adapter.velocity(x, sigma, cond, guidance_scale)`` -- two forwards for classifier-free guidance, one for FLUX-dev's
distilled guidance embedding -- so the first update's ratio is exactly 1 and the gradient flows through both CFG
branches (as flow_grpo trains SD3 at CFG 4.5). Forward-process objectives use guidance only to sample; their losses
compare conditional velocities (guidance 1), as DiffusionNFT trains.

Class attributes read by :mod:`flowforge.train.preflight` (one source of truth for algorithm properties):

====================  ==============================================================================
``uses_log_probs``    replays stored SDE steps and needs per-step log-probs (a stochastic kernel)
``clipped_ratio``     clips an importance ratio against the rollout policy (so 1 update per batch is moot)
====================  ==============================================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from flowforge.algorithms import advantages as adv_lib
from flowforge.algorithms import losses, schedules
from flowforge.runtime.distributed import all_reduce_processes, check_same_keys
from flowforge.config import Config
from flowforge.models.base import Conditioning
from flowforge.policy import old_decay
from flowforge.rollout import (RolloutSpec, Trajectory, candidate_noise, candidate_randint, generated_index,
                               replay_log_prob, with_condition)


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


def _extreme(key: str) -> str | None:
    return "min" if key.endswith("_min") else "max" if key.endswith("_max") else None


class _Accumulator:
    """0-d metrics reduced over micro-batches *and data-parallel ranks*: the mean weighted by the rows each value
    was measured on (min / max for keys ending in ``_min`` / ``_max``), identical on every rank.

    :meth:`reduce` is a collective: every rank must call it with the same keys; :meth:`declare` gives a rank that
    trained only zero-weight padding the keys with neutral entries (weight 0, or +-inf for extremes)."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.weights: dict[str, float] = {}

    def add(self, metrics: dict[str, torch.Tensor], weight: float = 1.0) -> None:
        for k, v in metrics.items():
            if v.ndim:
                continue
            v = v.detach().double()  # stays on its device until reduce (no sync per micro-batch)
            kind = _extreme(k)
            if kind is None:
                self.sums[k] = self.sums.get(k, torch.zeros((), dtype=torch.float64)) + v * weight
                self.weights[k] = self.weights.get(k, 0.0) + weight
            else:
                self.sums[k] = v if k not in self.sums else getattr(torch, kind)(self.sums[k], v)

    def declare(self, metrics: dict[str, torch.Tensor]) -> None:
        for k, v in metrics.items():
            if v.ndim or k in self.sums:
                continue
            kind = _extreme(k)
            self.sums[k] = torch.tensor(math.inf if kind == "min" else -math.inf if kind else 0.0,
                                        dtype=torch.float64)
            if kind is None:
                self.weights[k] = 0.0

    def reduce(self) -> dict[str, torch.Tensor]:
        keys = sorted(self.sums)
        check_same_keys(keys)
        self.sums = {k: v.cpu() for k, v in self.sums.items()}
        means = [k for k in keys if _extreme(k) is None]
        out = {}
        if means:
            t = torch.stack([torch.stack([self.sums[k] for k in means]),
                             torch.tensor([self.weights[k] for k in means], dtype=torch.float64)])
            t = all_reduce_processes(t, "sum")
            out.update({k: (s / w if w > 0 else torch.tensor(math.nan)).float() for k, s, w in zip(means, *t)})
        for kind in ("min", "max"):
            ks = [k for k in keys if _extreme(k) == kind]
            if ks:
                t = all_reduce_processes(torch.stack([self.sums[k] for k in ks]), kind)
                out.update({k: v.float() for k, v in zip(ks, t)})
        return out


def _global_sum(value: float) -> torch.Tensor:
    """``value`` summed over data-parallel ranks (a collective; ``value`` itself on one process)."""
    return all_reduce_processes(torch.tensor(float(value), dtype=torch.float64), "sum").float()


class Objective:
    """Base class. Subclasses set ``name``, the class attributes above, and implement the two methods."""

    name: ClassVar[str]
    uses_log_probs: ClassVar[bool] = False
    clipped_ratio: ClassVar[bool] = False
    sampling_policy: str = "live"  # the bank policy that rolls out (see flowforge.policy)
    eval_policy: str = "live"

    def __init__(self, cfg: Config, adapter, policy):
        self.cfg = cfg
        self.adapter = adapter
        self.policy = policy

    @classmethod
    def policy_bank(cls, cfg: Config) -> dict:
        """Keyword arguments for :class:`flowforge.policy.Policy`: which extra policies this objective needs."""
        return {}

    @classmethod
    def needs_whole_groups(cls, cfg: Config) -> bool:
        """Whether each rank must hold whole prompt groups (group statistics computed inside the objective)."""
        return False

    @classmethod
    def optimizer_steps_per_batch(cls, cfg: Config) -> int:
        """Optimizer steps one batch produces (sets the length of the LR schedule)."""
        return cfg.train.num_updates_per_batch

    def rollout_spec(self, step: int) -> RolloutSpec:
        raise NotImplementedError

    def optimize(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _micro_batches(self, rows: torch.Tensor, size: int | None = None):
        mb = size or self.cfg.train.micro_batch_size
        return [rows[i:i + mb] for i in range(0, rows.numel(), mb)]


# ---------------------------------------------------------------------------------------------------- replay


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
    store_means = False

    @classmethod
    def policy_bank(cls, cfg: Config) -> dict:
        return {"keep_ref": cfg.grpo.kl_weight > 0}

    def rollout_spec(self, step: int) -> RolloutSpec:
        s = self.cfg.sampler
        return RolloutSpec(kind=s.sde_kind, noise_level=s.noise_level, trained_steps=trained_steps_for(self.cfg, step),
                           guidance_scale=s.guidance_scale, store_steps=True, log_probs=True,
                           store_means=self.store_means)

    def surrogate(self, tr, sub: TrainBatch, slot: int) -> tuple[torch.Tensor, dict]:
        """The clipped surrogate of one replayed step (``tr`` the live transition)."""
        g = self.cfg.grpo
        return losses.grpo_clip_loss(tr.log_prob, sub.traj.log_probs[:, slot], sub.advantages, g.clip_low,
                                     g.clip_high)

    def step_loss(self, sub: TrainBatch, slot: int, spec: RolloutSpec) -> tuple[torch.Tensor, dict]:
        """Loss of one trained step on a micro-batch (mean over its samples) and its metrics."""
        g = self.cfg.grpo
        ref = None
        if g.kl_weight > 0:
            with self.policy.reference():
                ref = replay_log_prob(self.adapter, sub.traj, slot, sub.cond, spec)
        tr = replay_log_prob(self.adapter, sub.traj, slot, sub.cond, spec)
        loss, metrics = self.surrogate(tr, sub, slot)
        if ref is not None:
            kl = losses.transition_mean_kl(tr.mean, ref.mean, tr.std).mean()
            loss = loss + g.kl_weight * kl
            metrics = {**metrics, "kl": kl.detach()}
        return loss, metrics

    def optimize(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        spec = self.rollout_spec_of(batch)
        n_updates = self.cfg.train.num_updates_per_batch
        per_update = len(batch) // n_updates
        num_slots = len(batch.traj.trained_steps)
        acc = _Accumulator()
        first_dev = torch.zeros(())
        for u in range(n_updates):
            rows_u = torch.arange(u * per_update, (u + 1) * per_update)
            for rows in self._micro_batches(rows_u):
                sub = batch.select(rows)
                for slot in range(num_slots):
                    loss, m = self.step_loss(sub, slot, spec)
                    (loss * (rows.numel() / per_update) / num_slots).backward()
                    acc.add({**m, "loss": loss}, weight=rows.numel())
                    if u == 0:
                        first_dev = torch.maximum(first_dev, torch.maximum(m["ratio_max"] - 1, 1 - m["ratio_min"]))
            acc.add({"grad_norm": self.policy.step()})
        out = acc.reduce()
        out["first_update_ratio_dev"] = all_reduce_processes(first_dev.detach().cpu(), "max")
        return out

    def rollout_spec_of(self, batch: TrainBatch) -> RolloutSpec:
        """The spec the batch was rolled out with (its stored trained steps)."""
        s = self.cfg.sampler
        return RolloutSpec(kind=s.sde_kind, noise_level=s.noise_level, trained_steps=batch.traj.trained_steps,
                           guidance_scale=s.guidance_scale)


class GRPOGuard(GRPO):
    """GRPO-Guard (Wang et al. 2025, "GRPO-Guard: Mitigating Implicit Over-Optimization in Flow Matching via
    Regulated Clipping"): FlowGRPO with the per-step ratio normalization (RatioNorm) and the ``1 / -dt`` gradient
    reweighting, :func:`~flowforge.algorithms.losses.grpo_guard_loss`. The rollout also stores each trained
    step's transition mean (the old mean the normalization needs). Needs a Gaussian log-prob: kinds "sde" / "dance".
    """

    name = "grpo_guard"
    store_means = True

    def surrogate(self, tr, sub: TrainBatch, slot: int) -> tuple[torch.Tensor, dict]:
        g = self.cfg.grpo
        i = sub.traj.trained_steps[slot]
        dt = sub.traj.sigmas[i + 1] - sub.traj.sigmas[i]
        return losses.grpo_guard_loss(tr.log_prob, sub.traj.log_probs[:, slot], sub.advantages, g.clip_low,
                                      g.clip_high, mean=tr.mean, old_mean=sub.traj.means[:, slot], std=tr.std,
                                      dt=dt, step_weight=self.cfg.grpo_guard.step_weight)


# ---------------------------------------------------------------------------------------------------- forward


@dataclass(frozen=True)
class Visit:
    """One forward-process visit of a micro-batch: the noised input all policies see.

    ``x0`` / ``noise`` / ``x_sigma`` (and every velocity :meth:`ForwardProcessObjective.velocity` returns) hold the
    generated elements ``x[adapter.generated_index]`` -- the whole latent except an i2v condition slot, which is
    kept clean in ``model_input`` and never enters a loss."""

    x0: torch.Tensor  # [b, *generated] clean rollout samples
    noise: torch.Tensor  # [b, *generated]
    sigma: torch.Tensor  # [b] in [0, 1]
    x_sigma: torch.Tensor  # [b, *generated] = (1 - sigma) x0 + sigma noise
    model_input: torch.Tensor  # [b, *latent] x_sigma with the condition slot (if any) holding cond.image

    @property
    def target(self) -> torch.Tensor:
        """The flow-matching velocity target ``noise - x0``."""
        return self.noise - self.x0


class ForwardProcessObjective(Objective):
    """Shared machinery of the objectives that train on noised final samples (section ``forward``).

    Rollout with ``forward.sampler`` under ``forward.sample_with`` keeping only x0; for each inner epoch, each update
    (one optimizer step) and micro-batch, each visit draws sigma from the sampling schedule (one uniform index per
    sample, or every step with ``sigma_mode="full_schedule"``) and fresh noise; :meth:`micro_loss` returns the loss.
    After the batch, ``old <- d old + (1 - d) live`` with ``d = min(decay_rate n, decay_max)``.

    ``group_shared`` objectives get the same noise and sigma for every member of a prompt group and micro-batches
    made of whole groups (``train.micro_batch_size`` rounded down to whole groups, at least one group).
    """

    group_shared: ClassVar[bool] = False
    keeps_old: ClassVar[bool] = True

    @classmethod
    def needs_whole_groups(cls, cfg: Config) -> bool:
        return cls.group_shared

    def __init__(self, cfg: Config, adapter, policy):
        super().__init__(cfg, adapter, policy)
        self.sampling_policy = cfg.forward.sample_with if self.keeps_old else "live"
        self._step = 0

    @classmethod
    def needs_ref(cls, cfg: Config) -> bool:
        """Whether this objective evaluates the reference policy under ``cfg``."""
        return False

    @classmethod
    def policy_bank(cls, cfg: Config) -> dict:
        return {"keep_old": cls.keeps_old or cfg.forward.sample_with == "old", "keep_ref": cls.needs_ref(cfg)}

    @classmethod
    def optimizer_steps_per_batch(cls, cfg: Config) -> int:
        return cfg.train.num_updates_per_batch * cfg.forward.inner_epochs

    def rollout_spec(self, step: int) -> RolloutSpec:
        s = self.cfg.sampler
        self._step = step
        return RolloutSpec(kind=self.cfg.forward.sampler, noise_level=s.noise_level, trained_steps=(),
                           guidance_scale=s.guidance_scale, store_steps=False, log_probs=False)

    def noise_keys(self, batch: TrainBatch) -> torch.Tensor:
        """``[B]`` ids seeding each row's visit noise: the candidate id, or the group's smallest candidate id."""
        if not self.group_shared:
            return batch.candidate_ids
        inv = torch.unique(batch.group_ids, return_inverse=True)[1]
        first = torch.full((int(inv.max()) + 1,), torch.iinfo(torch.long).max, dtype=torch.long)
        first = first.scatter_reduce(0, inv, batch.candidate_ids, "amin")
        return first[inv]

    def visits(self, batch: TrainBatch, epoch: int) -> list[tuple[torch.Tensor, int]]:
        """``(sigma_index [B], slot)`` per visit of this inner epoch; ``slot`` seeds the visit's noise."""
        num_steps = self.cfg.sampler.num_steps
        base = -2 - (self._step * self.cfg.forward.inner_epochs + epoch) * num_steps
        if self.cfg.forward.sigma_mode == "full_schedule":
            return [(torch.full((len(batch),), j, dtype=torch.long), base - j) for j in range(num_steps)]
        return [(candidate_randint(self.noise_keys(batch).tolist(), num_steps, self.cfg.run.seed, base), base)]

    def make_visit(self, sub: TrainBatch, sigma_index: torch.Tensor, slot: int) -> Visit:
        x0 = sub.traj.final
        sigma = sub.traj.sigmas.to(x0.device)[sigma_index]
        noise = candidate_noise(self.noise_keys(sub).tolist(), x0.shape[1:], self.cfg.run.seed, slot).to(x0.device)
        s = sigma.reshape(-1, *([1] * (x0.ndim - 1)))
        x_sigma = with_condition(self.adapter, (1 - s) * x0 + s * noise, sub.cond)
        gen = generated_index(self.adapter)
        return Visit(x0=x0[gen], noise=noise[gen], sigma=sigma, x_sigma=x_sigma[gen], model_input=x_sigma)

    def velocity(self, visit: Visit, cond: Conditioning, policy: str = "live", guidance_scale: float = 1.0):
        """A policy's velocity ``[b, *generated]`` at the visit's ``model_input``; other policies without gradients,
        live registered as pending (the bank refuses switching until its backward)."""
        gen = generated_index(self.adapter)
        if policy == "live":
            return self.policy.pending(self.adapter.velocity(visit.model_input, visit.sigma, cond,
                                                             guidance_scale)[gen])
        with torch.no_grad(), self.policy.using(policy):
            return self.adapter.velocity(visit.model_input, visit.sigma, cond, guidance_scale)[gen]

    def prepare(self, batch: TrainBatch) -> tuple[TrainBatch, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Hook before training: may drop rows and add per-row tensors (``extras``) and metrics. An objective that
        drops rows also implements :meth:`padding`."""
        return batch, {}, {}

    def padding(self, batch: TrainBatch) -> tuple[TrainBatch, dict[str, torch.Tensor]]:
        """A valid micro-batch (rows and ``extras``) of the *unprepared* ``batch``, whose loss is backpropagated
        times 0 by a data-parallel rank that kept fewer rows than another (so every rank runs the same forwards and
        backwards). Only objectives whose :meth:`prepare` drops rows need it."""
        raise NotImplementedError(f"{type(self).__name__}.prepare dropped rows but it has no padding()")

    def micro_loss(self, sub: TrainBatch, extras: dict[str, torch.Tensor], visit: Visit):
        raise NotImplementedError

    def _row_order(self, batch: TrainBatch) -> torch.Tensor:
        return torch.argsort(batch.group_ids, stable=True) if self.group_shared else torch.arange(len(batch))

    def _micro_size(self, batch: TrainBatch) -> int:
        mb = self.cfg.train.micro_batch_size
        if not self.group_shared:
            return mb
        k = int(torch.bincount(torch.unique(batch.group_ids, return_inverse=True)[1]).max())
        return max(k, (mb // k) * k)

    def _plan(self, num_rows: int, size: int) -> tuple[list[list[torch.Tensor | None]], list[int]]:
        """Updates as lists of micro-batch row indices (``None``: a padding micro-batch), the same number of
        updates and micro-batches on every data-parallel rank, and each update's trained rows summed over ranks.

        Single process: consecutive chunks of ``ceil(micro-batches / num_updates_per_batch)`` micro-batches (so at
        most ``num_updates_per_batch`` updates), no padding. Several ranks that kept different numbers of rows:
        every rank pads to the largest micro-batch count, and the chunks are taken of that count."""
        micro: list[torch.Tensor | None] = list(self._micro_batches(torch.arange(num_rows), size))
        count = int(all_reduce_processes(torch.tensor([len(micro)]), "max")[0])
        micro += [None] * (count - len(micro))
        per_update = max(1, -(-count // self.cfg.train.num_updates_per_batch))
        updates = [micro[u:u + per_update] for u in range(0, count, per_update)]
        local = torch.tensor([sum(r.numel() for r in upd if r is not None) for upd in updates], dtype=torch.long)
        return updates, all_reduce_processes(local, "sum").tolist()

    def optimize(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        """Every inner epoch and update of the batch (see the class docstring). Each micro-batch's loss is scaled by
        ``rows * world / rows of the update over all ranks``, so the data-parallel mean gradient is the mean over
        every rank's trained rows; a rank that dropped more rows backpropagates :meth:`padding` times 0."""
        f = self.cfg.forward
        source = batch
        batch, extras, out = self.prepare(batch)
        order = self._row_order(batch)
        batch = batch.select(order)
        extras = {k: v[order] for k, v in extras.items()}
        world = int(all_reduce_processes(torch.ones(1, dtype=torch.long), "sum")[0])
        updates, global_rows = self._plan(len(batch), self._micro_size(batch) if len(batch) else 1)
        acc = _Accumulator()
        for epoch in range(f.inner_epochs):
            visits = self.visits(batch, epoch) if len(batch) else []
            for chunk, total in zip(updates, global_rows):
                for rows in chunk:
                    if rows is None:  # as many forwards and backwards as a real micro-batch, zero gradient
                        sub, sub_extras = self.padding(source)
                        for sigma_index, slot in self.visits(sub, epoch):
                            loss, m = self.micro_loss(sub, sub_extras, self.make_visit(sub, sigma_index, slot))
                            self.policy.backward(loss * 0.0)
                            acc.declare({**m, "loss": loss})
                        continue
                    sub = batch.select(rows)
                    sub_extras = {k: v[rows] for k, v in extras.items()}
                    for sigma_index, slot in visits:
                        loss, m = self.micro_loss(sub, sub_extras, self.make_visit(sub, sigma_index[rows], slot))
                        self.policy.backward(loss * (rows.numel() * world / total) / len(visits))
                        acc.add({**m, "loss": loss}, weight=rows.numel())
                acc.add({"grad_norm": self.policy.step()})
        if not updates:
            return out
        if self.keeps_old:
            decay = self.old_decay()
            self.policy.blend("old", decay)
            out["old_decay"] = torch.tensor(decay)
        out.update(acc.reduce())
        return out

    def old_decay(self) -> float:
        f = self.cfg.forward
        return old_decay(self.policy.optimizer_steps, f.decay_rate, f.decay_max)


class NFT(ForwardProcessObjective):
    """DiffusionNFT (Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement with Forward Process";
    NVlabs ``scripts/train_nft_sd3.py``): :func:`~flowforge.algorithms.losses.nft_loss` mixes the implicit positive
    and negative policies built from the live and old velocities with the optimality reward ``r`` in [0, 1]:

    * ``nft.reward_transform="reference"``: ``r = nft_optimality(A, adv_clip)`` of the clipped group advantages;
    * ``"absolute"``: ``r = 0.5 + 0.5 clip((S - mean_g) / (adv_clip max(std, std_floor)), -1, 1)``.

    With ``nft.guard`` whole groups that tie / spread too little / score too low are skipped (kept in the data,
    never re-drawn, counted as ``train/guard_skipped_groups``; under data parallelism ranks that skipped more
    run zero-weight padding so all stay in lockstep). Optional velocity-MSE penalty to the reference
    (``nft.ref_weight``) and an eval EMA (``nft.ema_decay``).
    """

    name = "nft"

    def __init__(self, cfg: Config, adapter, policy):
        super().__init__(cfg, adapter, policy)
        self.eval_policy = "ema" if cfg.nft.ema_decay > 0 else "live"

    @classmethod
    def needs_ref(cls, cfg: Config) -> bool:
        return cfg.nft.ref_weight > 0

    @classmethod
    def needs_whole_groups(cls, cfg: Config) -> bool:
        return cfg.nft.reward_transform == "absolute" or cfg.nft.guard

    @classmethod
    def policy_bank(cls, cfg: Config) -> dict:
        return {**super().policy_bank(cfg), "ema_decay": cfg.nft.ema_decay}

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

    def prepare(self, batch: TrainBatch):
        r, keep = self.optimality(batch)
        kept = torch.nonzero(keep).squeeze(1)
        r_sum, n_kept = _global_sum(r[keep].sum()), _global_sum(kept.numel())  # over every rank's rows
        metrics = {"r_mean": r_sum / n_kept if n_kept > 0 else torch.tensor(float("nan")),
                   "guard_skipped_groups": _global_sum(len(set(batch.group_ids[~keep].tolist())))}
        return batch.select(kept), {"r": r[kept]}, metrics

    def padding(self, batch: TrainBatch):
        rows = torch.arange(min(len(batch), self._micro_size(batch)))
        return batch.select(rows), {"r": torch.full((rows.numel(),), 0.5)}

    def micro_loss(self, sub: TrainBatch, extras: dict[str, torch.Tensor], visit: Visit):
        n = self.cfg.nft
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


class AWM(ForwardProcessObjective):
    """Advantage Weighted Matching (Xue et al. 2025, arXiv 2509.25050; ``scxue/advantage_weighted_matching``
    ``train_sd3_awm.py``): PPO-clipped surrogate on the flow-matching likelihood proxy,
    :func:`~flowforge.algorithms.losses.awm_loss`. The old policy is the batch's sampling policy: it is synced to
    live after every batch (decay 0), so the first update's ratio is exactly 1. Optional velocity-MSE KL to the
    reference (``awm.kl_weight``).
    """

    name = "awm"
    clipped_ratio = True

    @classmethod
    def needs_ref(cls, cfg: Config) -> bool:
        return cfg.awm.kl_weight > 0

    def __init__(self, cfg: Config, adapter, policy):
        super().__init__(cfg, adapter, policy)
        self.sampling_policy = "old"

    def old_decay(self) -> float:
        return 0.0

    def micro_loss(self, sub: TrainBatch, extras: dict[str, torch.Tensor], visit: Visit):
        a = self.cfg.awm
        v_old = self.velocity(visit, sub.cond, "old")
        v_ref = self.velocity(visit, sub.cond, "ref") if a.kl_weight > 0 else None
        v_live = self.velocity(visit, sub.cond)
        loss, m = losses.awm_loss(v_live, v_old, visit.x0, visit.noise, visit.sigma, sub.advantages,
                                  clip_low=a.clip_low, clip_high=a.clip_high, weighting=a.weighting,
                                  ghuber_power=a.ghuber_power, adv_max=a.adv_max,
                                  adv_clip=self.cfg.advantage.clip if a.adv_max is not None else None)
        if v_ref is not None:
            kl = losses.velocity_mse_kl(v_live, v_ref).mean()
            loss = loss + a.kl_weight * kl
            m = {**m, "kl": kl}
        return loss, m


class DGPO(ForwardProcessObjective):
    """DGPO (Luo, Hu, Tang 2025, "Reinforcing Diffusion Models by Direct Group Preference Optimization", arXiv
    2510.08425; ``Luo-Yihong/DGPO``): a group-level DPO objective against the frozen reference policy,
    :func:`~flowforge.algorithms.losses.dgpo_loss`. Every member of a group shares noise and sigma; micro-batches
    hold whole groups. Samples with the live policy (on-policy); optional velocity-MSE KL (``dgpo.kl_weight``).
    """

    name = "dgpo"
    group_shared = True
    keeps_old = False

    @classmethod
    def needs_ref(cls, cfg: Config) -> bool:
        return True

    def micro_loss(self, sub: TrainBatch, extras: dict[str, torch.Tensor], visit: Visit):
        d = self.cfg.dgpo
        v_ref = self.velocity(visit, sub.cond, "ref")
        v_live = self.velocity(visit, sub.cond)
        loss, m = losses.dgpo_loss(v_live, v_ref, visit.target, sub.group_ids, sub.advantages, beta=d.beta,
                                   mode=d.mode)
        if d.kl_weight > 0:
            kl = losses.velocity_mse_kl(v_live, v_ref).mean()
            loss = loss + d.kl_weight * kl
            m = {**m, "kl": kl}
        return loss, m


class DPO(ForwardProcessObjective):
    """Online Diffusion-DPO (Wallace et al. 2023, "Diffusion Model Alignment Using Direct Preference Optimization";
    ``SalesforceAIResearch/DiffusionDPO``): after advantages exist, each group's best and worst candidates form a
    chosen / rejected pair (:func:`~flowforge.algorithms.losses.best_worst_pairs`; tied groups form none), noised
    with the same noise and sigma, and :func:`~flowforge.algorithms.losses.diffusion_dpo_loss` is taken against the
    frozen reference. On-policy (samples with live). Under data parallelism a rank with fewer pairs runs
    zero-weight padding pairs so all ranks stay in lockstep.
    """

    name = "dpo"
    group_shared = True
    keeps_old = False

    @classmethod
    def needs_ref(cls, cfg: Config) -> bool:
        return True

    def prepare(self, batch: TrainBatch):
        chosen, rejected = losses.best_worst_pairs(batch.rewards, batch.group_ids)
        rows = torch.cat([chosen, rejected])
        role = torch.cat([torch.ones_like(chosen), torch.zeros_like(rejected)]).float()
        return batch.select(rows), {"chosen": role}, {"pairs": _global_sum(chosen.numel())}

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
                                         err_ref[chosen][order_w], err_ref[~chosen][order_l], beta=self.cfg.dpo.beta)


class CRD(ForwardProcessObjective):
    """Centered Reward Distillation (arXiv 2603.14128; implementation as X-GenGroup/Flow-Factory
    ``trainers/rl/crd.py``): regress the live-vs-old implicit reward, centred within each group, onto the centred
    external reward; optional reward-adaptive anchor (``crd.kl_beta``) to the reference teacher guided with
    ``crd.teacher_guidance`` (CFG; needs negative conditioning when != 1). Whole groups per micro-batch.
    """

    name = "crd"
    group_shared = True

    @classmethod
    def needs_ref(cls, cfg: Config) -> bool:
        return cfg.crd.kl_beta > 0

    def micro_loss(self, sub: TrainBatch, extras: dict[str, torch.Tensor], visit: Visit):
        c = self.cfg.crd
        v_old = self.velocity(visit, sub.cond, "old")
        v_teacher = self.velocity(visit, sub.cond, "ref", c.teacher_guidance) if c.kl_beta > 0 else None
        v_live = self.velocity(visit, sub.cond)
        return losses.crd_loss(v_live, v_old, visit.target, sub.group_ids, sub.advantages, beta=c.beta,
                               adv_clip=c.adv_clip, loss_type=c.loss_type, v_teacher=v_teacher, kl_beta=c.kl_beta)


OBJECTIVES: dict[str, type[Objective]] = {
    cls.name: cls for cls in (GRPO, GRPOGuard, NFT, AWM, DGPO, DPO, CRD)
}
"""Every algorithm, by its ``train.algorithm`` name."""
