"""The forward-process family: objectives that train on noised final samples (section ``forward``).

Any sampler rolls out (``forward.sampler`` under ``forward.sample_with``) and only the final clean sample ``x0`` is
kept: ``ode`` (Euler, the default), ``dpm2`` (the deterministic 2nd-order DPM-Solver++(2M) of
:mod:`flowforge.algorithms.solvers`, NVlabs DiffusionNFT's rollout sampler), or a stochastic kernel (``sde``,
``dance``, ``cps``: every step but the degenerate last one stochastic, at ``sampler.noise_level``). The update noises
it, ``x_sigma = (1 - sigma) x0 + sigma noise``, and compares policies' velocities there. Noise and sigma of a visit
are functions of (run seed, candidate or group id, training step, inner epoch, visit) only, so a resumed run draws
the same ones; group objectives share them within a prompt group and train on whole groups. The losses compare
conditional velocities (guidance 1), as DiffusionNFT trains; guidance
only shapes the samples.

After each batch the old policy follows DiffusionNFT's soft update (NVlabs ``train_nft_sd3.py`` ``return_decay``),
``n`` = optimizer steps so far (:func:`flowforge.algorithms.ema.old_policy_decay`)::

    old <- d old + (1 - d) live,   forward.decay_schedule "linear":    d = min(decay_rate * n, decay_max)
                                   "flat_ramp":  d = 0 for n < decay_flat_steps, then
                                                 d = min((n - decay_flat_steps) * decay_rate, decay_max)

NVlabs' presets ("decay types"): 0 = ``decay_rate 0, decay_max 0``; 1 = ``0.001, 0.5`` (the default); 2 (its OCR
configuration) = ``flat_ramp`` with ``decay_flat_steps 75, decay_rate 0.0075, decay_max 0.999``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from flowforge.algorithms.ema import OLD_DECAY_SCHEDULES, old_policy_decay
from flowforge.algorithms.sde import TRANSITION_KINDS
from flowforge.models.base import Conditioning
from flowforge.objectives.base import MetricAccumulator, Objective, ObjectiveContext, TrainBatch
from flowforge.rollout import RolloutSpec, candidate_noise, candidate_randint, generated_index, with_condition
from flowforge.runtime.distributed import all_reduce_processes
from flowforge.settings import Checks, Section

FORWARD_SIGMA_MODES = ("uniform_schedule", "full_schedule")
FORWARD_SAMPLERS = (*TRANSITION_KINDS, "dpm2")
SAMPLE_WITH = ("old", "live")


@dataclass(frozen=True)
class ForwardConfig(Section):
    """Shared by the forward-process objectives (nft, awm, dgpo, dpo, crd): they train on noised final samples."""

    section_name = "forward"

    sampler: str = "ode"  # rollout: "ode" (Euler) | "dpm2" (DPM-Solver++(2M)) | "sde" | "dance" | "cps" (final x0 kept)
    sample_with: str = "old"  # policy that samples: "old" (off-policy, DiffusionNFT's default) | "live"
    sigma_mode: str = "uniform_schedule"  # "uniform_schedule" (one schedule sigma per visit) | "full_schedule"
    inner_epochs: int = 1
    decay_rate: float = 0.001  # old <- decay * old + (1 - decay) * live, decay = min(decay_rate * n, decay_max)
    decay_max: float = 0.5
    decay_schedule: str = "linear"  # "linear" | "flat_ramp" (d = 0 for the first decay_flat_steps optimizer steps)
    decay_flat_steps: int = 0  # flat start of "flat_ramp" (NVlabs' decay type 2: 75)

    def problems(self) -> list[str]:
        c = Checks(self)
        c.choice("sampler", FORWARD_SAMPLERS)
        c.choice("decay_schedule", OLD_DECAY_SCHEDULES)
        c.require(self.decay_flat_steps >= 0 and (self.decay_flat_steps == 0 or self.decay_schedule == "flat_ramp"),
                  f"forward.decay_flat_steps={self.decay_flat_steps} must be >= 0, and 0 unless "
                  "forward.decay_schedule='flat_ramp'")
        c.choice("sample_with", SAMPLE_WITH)
        c.choice("sigma_mode", FORWARD_SIGMA_MODES)
        c.require(0 <= self.decay_max < 1 and self.decay_rate >= 0,
                  f"forward.decay_rate={self.decay_rate} must be >= 0 and forward.decay_max={self.decay_max} "
                  "in [0, 1)")
        c.require(self.inner_epochs >= 1, f"forward.inner_epochs={self.inner_epochs} must be >= 1")
        return c.problems


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
    """Shared machinery of the forward-process objectives (see the module docstring).

    For each inner epoch, each update (one optimizer step) and micro-batch, each visit draws sigma from the sampling
    schedule (one uniform index per sample, or every step with ``sigma_mode="full_schedule"``) and fresh noise;
    :meth:`micro_loss` returns the loss. ``group_shared`` objectives get the same noise and sigma for every member
    of a prompt group and micro-batches made of whole groups (``train.micro_batch_size`` rounded down to whole
    groups, at least one group). Subclasses list :class:`ForwardConfig` in their ``sections``.
    """

    group_shared: ClassVar[bool] = False
    keeps_old: ClassVar[bool] = True
    forward: ForwardConfig

    def __init__(self, ctx: ObjectiveContext, adapter, policy):
        super().__init__(ctx, adapter, policy)
        self.sampling_policy = self.forward.sample_with if self.keeps_old else "live"

    @classmethod
    def needs_whole_groups(cls, ctx: ObjectiveContext) -> bool:
        return cls.group_shared

    @classmethod
    def needs_ref(cls, ctx: ObjectiveContext) -> bool:
        """Whether this objective evaluates the reference policy with these settings."""
        return False

    @classmethod
    def policy_bank(cls, ctx: ObjectiveContext) -> dict:
        return {"keep_old": cls.keeps_old or ctx.sections["forward"].sample_with == "old",
                "keep_ref": cls.needs_ref(ctx)}

    @classmethod
    def optimizer_steps_per_batch(cls, ctx: ObjectiveContext) -> int:
        return ctx.num_updates_per_batch * ctx.sections["forward"].inner_epochs

    def rollout_spec(self, step: int) -> RolloutSpec:
        """Only the final sample is kept: a deterministic solver (``ode`` Euler, ``dpm2``) on every step, or a
        stochastic kernel on every step but the last (whose transition is degenerate), nothing stored."""
        s, kind = self.ctx.sampler, self.forward.sampler
        deterministic = kind in ("ode", "dpm2")
        return RolloutSpec(kind="ode" if deterministic else kind, noise_level=s.noise_level,
                           trained_steps=() if deterministic else tuple(range(s.num_steps - 1)),
                           guidance_scale=s.guidance_scale, store_steps=False, log_probs=False,
                           solver="dpm2" if kind == "dpm2" else "euler")

    def noise_keys(self, batch: TrainBatch) -> torch.Tensor:
        """``[B]`` ids seeding each row's visit noise: the candidate id, or the group's smallest candidate id."""
        if not self.group_shared:
            return batch.candidate_ids
        inv = torch.unique(batch.group_ids, return_inverse=True)[1]
        first = torch.full((int(inv.max()) + 1,), torch.iinfo(torch.long).max, dtype=torch.long)
        first = first.scatter_reduce(0, inv, batch.candidate_ids, "amin")
        return first[inv]

    def visits(self, batch: TrainBatch, epoch: int) -> list[tuple[torch.Tensor, int]]:
        """``(sigma_index [B], slot)`` per visit of inner epoch ``epoch`` of the batch's training step; ``slot``
        seeds the visit's noise (slots below -1, disjoint from the rollout's: see :mod:`flowforge.rollout.noise`)."""
        num_steps = self.ctx.sampler.num_steps
        base = -2 - (batch.step * self.forward.inner_epochs + epoch) * num_steps
        if self.forward.sigma_mode == "full_schedule":
            return [(torch.full((len(batch),), j, dtype=torch.long), base - j) for j in range(num_steps)]
        return [(candidate_randint(self.noise_keys(batch).tolist(), num_steps, self.ctx.seed, base), base)]

    def make_visit(self, sub: TrainBatch, sigma_index: torch.Tensor, slot: int) -> Visit:
        """The visit of micro-batch ``sub`` at schedule indices ``sigma_index`` ([b] int64) with noise ``slot``."""
        x0 = sub.traj.final
        sigma = sub.traj.sigmas.to(x0.device)[sigma_index]
        noise = candidate_noise(self.noise_keys(sub).tolist(), x0.shape[1:], self.ctx.seed, slot).to(x0.device)
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
        """``(loss, metrics)`` of one visit of micro-batch ``sub`` (``extras``: its rows of :meth:`prepare`'s)."""
        raise NotImplementedError

    def _row_order(self, batch: TrainBatch) -> torch.Tensor:
        return torch.argsort(batch.group_ids, stable=True) if self.group_shared else torch.arange(len(batch))

    def _micro_size(self, batch: TrainBatch) -> int:
        mb = self.ctx.micro_batch_size
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
        micro: list[torch.Tensor | None] = list(self.micro_batches(torch.arange(num_rows), size))
        count = int(all_reduce_processes(torch.tensor([len(micro)]), "max")[0])
        micro += [None] * (count - len(micro))
        per_update = max(1, -(-count // self.ctx.num_updates_per_batch))
        updates = [micro[u:u + per_update] for u in range(0, count, per_update)]
        local = torch.tensor([sum(r.numel() for r in upd if r is not None) for upd in updates], dtype=torch.long)
        return updates, all_reduce_processes(local, "sum").tolist()

    def _padding_pass(self, source: TrainBatch, epoch: int, acc: MetricAccumulator) -> None:
        """As many forwards and backwards as a real micro-batch, with zero gradient."""
        sub, sub_extras = self.padding(source)
        for sigma_index, slot in self.visits(sub, epoch):
            loss, m = self.micro_loss(sub, sub_extras, self.make_visit(sub, sigma_index, slot))
            self.policy.backward(loss * 0.0)
            acc.declare({**m, "loss": loss})

    def optimize(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        """Every inner epoch and update of the batch (see the class docstring). Each micro-batch's loss is scaled by
        ``rows * world / rows of the update over all ranks``, so the data-parallel mean gradient is the mean over
        every rank's trained rows; a rank that dropped more rows backpropagates :meth:`padding` times 0. Rows outside
        ``batch.keep`` leave before :meth:`prepare`; the padding is drawn from the whole batch (a rank can lose every
        row of its share while another trains)."""
        source = batch
        batch, extras, out = self.prepare(batch.kept())
        order = self._row_order(batch)
        batch = batch.select(order)
        extras = {k: v[order] for k, v in extras.items()}
        world = int(all_reduce_processes(torch.ones(1, dtype=torch.long), "sum")[0])
        updates, global_rows = self._plan(len(batch), self._micro_size(batch) if len(batch) else 1)
        acc = MetricAccumulator()
        for epoch in range(self.forward.inner_epochs):
            visits = self.visits(batch, epoch) if len(batch) else []
            for chunk, total in zip(updates, global_rows):
                for rows in chunk:
                    if rows is None:
                        self._padding_pass(source, epoch, acc)
                        continue
                    sub = batch.select(rows)
                    sub_extras = {k: v[rows] for k, v in extras.items()}
                    for sigma_index, slot in visits:
                        loss, m = self.micro_loss(sub, sub_extras, self.make_visit(sub, sigma_index[rows], slot))
                        self.policy.backward(loss * (rows.numel() * world / total) / len(visits))
                        acc.add({**m, "loss": loss}, weight=rows.numel())
                acc.add(self.optimizer_step())
        if not updates:
            return out
        if self.keeps_old:
            decay = self.old_decay()
            self.policy.blend("old", decay)
            out["old_decay"] = torch.tensor(decay)
        out.update(acc.reduce())
        return out

    def old_decay(self) -> float:
        """The decay of this batch's old-policy soft update (after the batch's optimizer steps)."""
        f = self.forward
        return old_policy_decay(self.policy.optimizer_steps, schedule=f.decay_schedule, decay_rate=f.decay_rate,
                                decay_max=f.decay_max, flat_steps=f.decay_flat_steps)
