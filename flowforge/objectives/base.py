"""What every objective shares: the batch record, the settings it reads, the metric accumulator, micro-batching.

An objective declares its rollout (:meth:`Objective.rollout_spec`; the one loop in :mod:`flowforge.rollout` does the
sampling) and turns a scored batch into optimizer steps (:meth:`Objective.optimize`), calling the pure math in
:mod:`flowforge.algorithms.losses`. It never sees the whole config: :meth:`Objective.context` picks out, once, what
it reads (:class:`ObjectiveContext`: a few ``run`` / ``train`` / ``advantage`` values, the ``sampler`` section and
the objective's own sections).

Class attributes read by :mod:`flowforge.train.preflight` and the trainer (one source of truth per algorithm):

====================  ==============================================================================
``name``              the ``train.algorithm`` value (the key in :data:`flowforge.objectives.OBJECTIVES`)
``sections``          the config section classes this objective owns (each becomes ``cfg.<section_name>``)
``uses_log_probs``    replays stored SDE steps and needs per-step log-probs (a stochastic kernel)
``clipped_ratio``     clips an importance ratio against the rollout policy (so 1 update per batch is moot)
``accepts_staleness`` its loss is an importance ratio against the recorded log-probs of the policy that sampled
                      the batch, so a batch sampled versions ago is weighed correctly (``train.max_staleness > 0``)
``uses_advantages``   learns from the group-relative advantages (the trainer skips a step where all are 0)
``needs_reward_fn``   differentiates the reward: the trainer sets :attr:`Objective.reward_fn` before training
====================  ==============================================================================

The one seam for reward-gradient objectives (``draft``): ``reward_fn(media, prompts, metadata) -> [B]`` float32,
the ``reward.weights``-weighted sum of differentiable scorers evaluated *with* gradient
(:class:`flowforge.rewards.differentiable.DifferentiableReward`), and the rows' prompt records (prompt, metadata)
in :class:`TrainBatch`; the objective decodes with ``adapter.decode`` itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from flowforge.algorithms.sde import TRANSITION_KINDS
from flowforge.models.base import Conditioning
from flowforge.rollout import RolloutSpec, Trajectory
from flowforge.runtime.distributed import all_reduce_processes, check_same_keys
from flowforge.settings import SamplerConfig


@dataclass(frozen=True)
class TrainBatch:
    """This rank's scored rollout of one training step, rows in training order."""

    traj: Trajectory  # rows [B]
    cond: Conditioning  # [B]
    advantages: torch.Tensor  # [B] fp32
    group_ids: torch.Tensor  # [B] int64
    rewards: torch.Tensor  # [B] fp32 weighted total reward (for objectives that transform scores themselves)
    candidate_ids: torch.Tensor  # [B] int64 stable per-candidate ids (seed training-time noise)
    step: int = 0  # the training step this rollout belongs to (seeds forward-process visit noise)
    # [b] int64 the rows trained on (None: every row); the others (failed groups, flowforge.train.seams) carry zero
    # weight: every objective trains on kept() only
    keep: torch.Tensor | None = None
    records: tuple | None = None  # [B] each row's PromptRecord (.prompt, .metadata): reward-gradient objectives score

    def __len__(self) -> int:
        return int(self.advantages.shape[0])

    def select(self, rows: torch.Tensor) -> "TrainBatch":
        """The rows ``rows`` ([b] int64) of every per-row field, all of them kept; ``step`` is kept."""
        return replace(self, traj=self.traj.select(rows), cond=self.cond.index(rows),
                       advantages=self.advantages[rows], group_ids=self.group_ids[rows],
                       rewards=self.rewards[rows], candidate_ids=self.candidate_ids[rows], keep=None,
                       records=None if self.records is None else tuple(self.records[i] for i in rows.tolist()))

    def kept(self) -> "TrainBatch":
        """The rows :attr:`keep` (the batch itself when every row is kept)."""
        return self if self.keep is None else self.select(self.keep)


@dataclass(frozen=True)
class ObjectiveContext:
    """Everything an objective reads from the config, picked out once by :meth:`Objective.context`."""

    seed: int  # run.seed: seeds trained-step resampling and training-time noise
    micro_batch_size: int  # train.micro_batch_size: rows per forward / backward
    num_updates_per_batch: int  # train.num_updates_per_batch: optimizer steps per batch (per inner epoch)
    advantage_clip: float  # advantage.clip: the bound the advantages were clipped to
    sampler: SamplerConfig  # the rollout sampler: kernel, noise level, guidance, trained steps, schedule length
    sections: Mapping[str, Any]  # the objective's own sections by section name (Objective.sections)


def _extreme(key: str) -> str | None:
    return "min" if key.endswith("_min") else "max" if key.endswith("_max") else None


class MetricAccumulator:
    """0-d metrics reduced over micro-batches *and data-parallel ranks*: the mean weighted by the rows each value
    was measured on (min / max for keys ending in ``_min`` / ``_max``), identical on every rank.

    :meth:`reduce` is a collective: every rank must call it with the same keys; :meth:`declare` gives a rank that
    trained only zero-weight padding the keys with neutral entries (weight 0, or +-inf for extremes)."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.weights: dict[str, float] = {}

    def add(self, metrics: dict[str, torch.Tensor], weight: float = 1.0) -> None:
        """Add the 0-d entries of ``metrics`` (others are ignored) measured on ``weight`` rows."""
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
        """Make the 0-d keys of ``metrics`` known without contributing a value."""
        for k, v in metrics.items():
            if v.ndim or k in self.sums:
                continue
            kind = _extreme(k)
            self.sums[k] = torch.tensor(math.inf if kind == "min" else -math.inf if kind else 0.0,
                                        dtype=torch.float64)
            if kind is None:
                self.weights[k] = 0.0

    def reduce(self) -> dict[str, torch.Tensor]:
        """Every key's float32 0-d value over all micro-batches and ranks (NaN for a mean with weight 0)."""
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


def global_sum(value: float) -> torch.Tensor:
    """``value`` summed over data-parallel ranks, a float32 0-d tensor (a collective; ``value`` on one process)."""
    return all_reduce_processes(torch.tensor(float(value), dtype=torch.float64), "sum").float()


class Objective:
    """Base class of every algorithm.

    Subclasses set ``name`` and ``sections`` (their own config section classes), the class attributes above, and
    implement :meth:`rollout_spec` and :meth:`optimize`. Each declared section is available as
    ``self.<section_name>``; everything else the objective reads is in ``self.ctx``.

    Args:
        ctx: the settings this objective reads (:meth:`context` builds it from a config).
        adapter: the :class:`~flowforge.models.base.FlowModel` being trained.
        policy: the :class:`~flowforge.policy.Policy` bank holding its weights and optimizer.

    Raises:
        ValueError: ``ctx.sections`` lacks one of this class's sections.
    """

    name: ClassVar[str]
    sections: ClassVar[tuple[type, ...]] = ()
    uses_log_probs: ClassVar[bool] = False
    clipped_ratio: ClassVar[bool] = False
    accepts_staleness: ClassVar[bool] = False
    uses_advantages: ClassVar[bool] = True
    needs_reward_fn: ClassVar[bool] = False
    reward_fn = None  # needs_reward_fn: (media, prompts, metadata) -> [B] float32 with gradient, set by the trainer
    sampling_policy: str = "live"  # the bank policy that rolls out (see flowforge.policy)
    eval_policy: str = "live"
    anchor = None  # extra supervised terms added before every optimizer step (flowforge.objectives.anchors)

    def __init__(self, ctx: ObjectiveContext, adapter, policy):
        missing = [s.section_name for s in self.sections if s.section_name not in ctx.sections]
        if missing:
            raise ValueError(f"{type(self).__name__} needs the config sections {missing}; got {sorted(ctx.sections)}")
        self.ctx = ctx
        self.adapter = adapter
        self.policy = policy
        for section in self.sections:
            setattr(self, section.section_name, ctx.sections[section.section_name])

    # -------------------------------------------------------------------------------- from a config
    @classmethod
    def context(cls, cfg) -> ObjectiveContext:
        """The settings this objective reads, picked out of a root ``Config`` (the only place that reads it)."""
        return ObjectiveContext(seed=cfg.run.seed, micro_batch_size=cfg.train.micro_batch_size,
                                num_updates_per_batch=cfg.train.num_updates_per_batch,
                                advantage_clip=cfg.advantage.clip, sampler=cfg.sampler,
                                sections={s.section_name: getattr(cfg, s.section_name) for s in cls.sections})

    @classmethod
    def from_config(cls, cfg, adapter, policy) -> "Objective":
        """``cls(cls.context(cfg), adapter, policy)``."""
        return cls(cls.context(cfg), adapter, policy)

    @classmethod
    def preflight_problems(cls, cfg, *, world_size: int) -> list[str]:
        """This algorithm's rules across sections of a root ``Config`` (called by
        :func:`flowforge.train.preflight.preflight`, which has checked the batch arithmetic); subclasses extend."""
        t, d = cfg.train, cfg.data
        problems = []
        if cls.clipped_ratio and t.num_updates_per_batch == 1 and cfg.advantage.std_mode != "none" \
                and not t.allow_unit_ratio:
            problems.append(
                f"train.num_updates_per_batch=1 with train.algorithm={t.algorithm!r} and group-centred advantages: "
                "every update sees the rollout policy, so the importance ratio is identically 1, clipping never "
                "engages and the logged loss is identically 0 (a plain policy gradient). Use num_updates_per_batch "
                ">= 2, or set train.allow_unit_ratio=true if that is what you want")
        per_rank = d.prompts_per_step * d.group_size // world_size
        if world_size > 1 and cls.needs_whole_groups(cls.context(cfg)) and per_rank % d.group_size:
            problems.append(f"train.algorithm={t.algorithm!r} computes group statistics per rank: the per-rank batch "
                            f"{per_rank} must hold whole groups of data.group_size={d.group_size}")
        if cls.uses_log_probs and cfg.sampler.sde_kind == "ode":
            problems.append(f"sampler.sde_kind='ode' with train.algorithm={t.algorithm!r}: a log-prob objective needs "
                            f"a stochastic kernel; allowed: {[k for k in TRANSITION_KINDS if k != 'ode']}")
        return problems

    # -------------------------------------------------------------------------------- declarations
    @classmethod
    def policy_bank(cls, ctx: ObjectiveContext) -> dict:
        """Keyword arguments for :class:`flowforge.policy.Policy`: which extra policies this objective needs."""
        return {}

    @classmethod
    def needs_whole_groups(cls, ctx: ObjectiveContext) -> bool:
        """Whether each rank must hold whole prompt groups (group statistics computed inside the objective)."""
        return False

    @classmethod
    def optimizer_steps_per_batch(cls, ctx: ObjectiveContext) -> int:
        """Optimizer steps one batch produces (sets the length of the LR schedule)."""
        return ctx.num_updates_per_batch

    # -------------------------------------------------------------------------------- the two stages
    def rollout_spec(self, step: int) -> RolloutSpec:
        """What the rollout of training step ``step`` must record."""
        raise NotImplementedError

    def optimize(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        """Every update of one scored batch, on its rows :meth:`TrainBatch.kept` (the others carry zero weight);
        returns 0-d metrics, identical on every rank."""
        raise NotImplementedError

    def optimizer_step(self) -> dict[str, torch.Tensor]:
        """One optimizer step of the policy bank after the RL gradients of an update: the :attr:`anchor`'s gradients
        (when a run has one) are added first. Returns ``grad_norm`` and the anchor's metrics."""
        metrics = self.anchor.backward() if self.anchor is not None else {}
        return {**metrics, "grad_norm": self.policy.step()}

    # -------------------------------------------------------------------------------- its own state
    def checkpoint_state(self) -> dict:
        """State the objective owns outside the policy bank, saved in every checkpoint: ``{"tensors": {group:
        {name: Tensor}}, "optimizer": a state dict or None}`` (``{}``: none, the default). The checkpoint stores the
        groups as ``objective.<group>`` weight files and the optimizer under ``optimizer.pt["objective"]``; the
        group names follow :func:`flowforge.train.checkpoint.save.save_checkpoint`'s rule."""
        return {}

    def load_checkpoint_state(self, state: dict) -> None:
        """Restore what :meth:`checkpoint_state` returned (``{}`` from a checkpoint that holds none)."""

    def micro_batches(self, rows: torch.Tensor, size: int | None = None) -> list[torch.Tensor]:
        """``rows`` ([n] int64) in consecutive chunks of ``size`` (default ``ctx.micro_batch_size``)."""
        mb = size or self.ctx.micro_batch_size
        return [rows[i:i + mb] for i in range(0, rows.numel(), mb)]
