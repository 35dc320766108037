"""The trainer's seams: where a caller plugs into the loop of :class:`~flowforge.train.trainer.Trainer` without
overriding any of its methods (the three-stage pipeline, :mod:`flowforge.orchestrate.stage_trainer`, is such a caller).

Two kinds, both passed to the trainer's constructor:

* a **prompt source** (:class:`PromptSource`, one object): asked for the prompts of each step's groups, and told what
  became of them -- rolled out, scored, trained on. The default, :class:`SamplerPrompts`, keeps the K-repeat sampler's
  prompts (``flowforge train``); the pipeline's condition ledger is another;
* **step hooks** (:class:`StepHook`, a list): called at fixed points of every step, in list order, after the prompt
  source; every method is a no-op unless a hook overrides it.

One step, with the calls in order (``trainer.step`` is the number of completed steps, equal to ``step`` until
``finish_step`` counts it; ``trainer.policy.optimizer_steps`` is the policy version)::

    hooks.before_step(trainer, step)                          # e.g. bind the judges to (train, step, version)
    batch = trainer.next_prompts()                            #   -> source.groups(trainer, step, sampled)
    traj, cond = trainer.sample(batch, step)
    source.rolled_out(trainer, step, batch); hooks.on_rolled_out(trainer, step, batch)
    media, components, metrics = trainer.score(traj, batch)
    source.scored(trainer, step, batch, components)           # may raise: the step stops before it is trained
    hooks.on_scored(trainer, step, batch, media, components, metrics)   # may add metrics, may raise
    adv, total, adv_metrics = trainer.advantages(components, batch)     # failed groups dropped (below)
    train_metrics = trainer.optimize(TrainBatch(..., keep=rows not dropped))
    if the step trained: source.trained_on(trainer, step, batch); hooks.on_trained(trainer, step, batch, metrics)
    trainer.finish_step(...)                                  # log, evaluate, checkpoint
    # inside trainer.evaluate(step): hooks.before_eval(trainer, step) first, hooks.on_evaluated(trainer, step, scalars)
    # last (rank 0: the eval scalars; other ranks: {})

Failed groups (:func:`drop_failed_groups`): a group in which a weighted reward component scored NaN or inf (a judge
that gave no marks after its bounded attempts, an answer lost in a crash; ``reward.required`` components raise
instead, in the reward processor) is dropped: advantage 0, total reward NaN, its rows left out of the update (zero
weight), counted as ``reward/judge_failed_groups``; ``reward/total_mean`` is over the kept rows. A step with no usable
group is skipped (its advantages are all 0). Whether a run may go on when a step's groups all failed is the prompt
source's decision (:meth:`PromptSource.scored`): :class:`SamplerPrompts` stops it when no group has been scored since
the run (this process) started, naming why.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from flowforge.runtime.distributed import all_reduce_processes

from flowforge.train.step_batch import StepBatch

RunningTrainer = Any
"""What the seams are handed: the running :class:`flowforge.train.trainer.Trainer` (named, not imported: the trainer
imports the seams)."""


class PromptSource(Protocol):
    """Where a step's prompts come from, and what it is told about them (module docstring). Every method gets the
    trainer (its ``cfg``, ``train_prompts``, ``policy``, ``rewards``, ``dist``) and the trainer step ``step``."""

    def groups(self, trainer: RunningTrainer, step: int, sampled: torch.Tensor) -> torch.Tensor:
        """The prompts of the step's ``M`` groups: ``[M]`` int64 row indices into ``trainer.train_prompts``.
        ``sampled`` (``[M]`` int64) is the K-repeat sampler's choice; the sampler still fixes everything else of the
        step (candidate ids, which seed each candidate's noise; group ids; the training order). Called on every
        rank; the answer must be the same on every rank."""

    def rolled_out(self, trainer: RunningTrainer, step: int, batch: StepBatch) -> None:
        """The step's candidates were rolled out (``batch``: this rank's rows). Called on every rank."""

    def scored(self, trainer: RunningTrainer, step: int, batch: StepBatch, components: dict[str, torch.Tensor]) -> None:
        """The step was scored: ``components`` ``[B]`` per reward component, this rank's rows (NaN: no score; a group
        whose weighted components are not all finite, :func:`scored_rows`, is dropped). Called on every rank.
        Raising stops the run before the step is trained or saved."""

    def trained_on(self, trainer: RunningTrainer, step: int, batch: StepBatch) -> None:
        """The policy was updated on the step (not called for a skipped step); ``trainer.policy.optimizer_steps`` is
        the version after the update. Called on every rank, before the step is counted and checkpointed."""


class SamplerPrompts:
    """The prompt source of ``flowforge train``: the K-repeat sampler's prompts, nothing recorded. A step whose groups
    all failed stops the run while no group was ever scored in it (a judge down from the start: its error names why,
    :meth:`~flowforge.rewards.processor.RewardProcessor.check_finite`); later such a step is skipped."""

    def __init__(self) -> None:
        self.any_scored = False  # a group of this run (since this process started) had finite rewards

    def groups(self, trainer: RunningTrainer, step: int, sampled: torch.Tensor) -> torch.Tensor:
        return sampled

    def rolled_out(self, trainer: RunningTrainer, step: int, batch: StepBatch) -> None:
        pass

    def scored(self, trainer: RunningTrainer, step: int, batch: StepBatch, components: dict[str, torch.Tensor]) -> None:
        weights = trainer.cfg.reward.weights
        here = float(bool(scored_rows(components, weights).any()))
        self.any_scored = self.any_scored or bool(all_reduce_processes(torch.tensor([here]), "max")[0])
        if not self.any_scored:
            trainer.rewards.check_finite(components, weighted(weights))

    def trained_on(self, trainer: RunningTrainer, step: int, batch: StepBatch) -> None:
        pass


class StepHook:
    """Called at fixed points of every step (module docstring); subclass and override what you need. Each method
    gets the trainer and the trainer step ``step``; ``batch`` is this rank's :class:`~flowforge.train.trainer.StepBatch`
    (rows in training order). Hooks run on every rank, in list order, after the prompt source. ``needs``: what the
    hook reads of a step beyond what the scorers read (``"pixels"``, ``"audio"``: :meth:`Trainer.media_needs
    <flowforge.train.trainer.Trainer.media_needs>` decodes them for it)."""

    needs: frozenset[str] = frozenset()

    def before_step(self, trainer: RunningTrainer, step: int) -> None:
        """Before the step's prompts are drawn (e.g. bind the scorers to the step)."""

    def on_rolled_out(self, trainer: RunningTrainer, step: int, batch: StepBatch) -> None:
        """After the rollout (with ``reward.overlap`` the group scorers already have the groups)."""

    def on_scored(self, trainer: RunningTrainer, step: int, batch: StepBatch, media: torch.Tensor,
                  components: dict[str, torch.Tensor], metrics: dict[str, float]) -> None:
        """After scoring: ``media`` ``[B, 3, H, W]`` (video ``[B, 3, F, H, W]``) in [0, 1], ``components`` ``[B]``
        per reward component (NaN: no score), ``metrics`` the step's reward metrics, which the hook may extend (they
        are logged with the step). Raising stops the run before the step is trained or saved."""

    def on_trained(self, trainer: RunningTrainer, step: int, batch: StepBatch, metrics: dict[str, float]) -> None:
        """After the update (not called for a skipped step), before the step is counted, logged and checkpointed;
        ``metrics`` the step's local metrics so far."""

    def before_eval(self, trainer: RunningTrainer, step: int) -> None:
        """At the start of the evaluation of ``step`` (completed steps; 0: before the first)."""

    def on_evaluated(self, trainer: RunningTrainer, step: int, scalars: dict[str, float]) -> None:
        """After the evaluation of ``step``: ``scalars`` the logged ``eval/*`` values (rank 0; ``{}`` elsewhere)."""


def bind_scorers(scorers: Any, *, stage: str, purpose: str, step: int, policy_version: int) -> None:
    """Bind every scorer of ``scorers`` (an iterable) that can be bound to a step -- it has ``bind(stage=, purpose=,
    step=, policy_version=)``, as :class:`~flowforge.rewards.judge.client.VLMJudge` (its request ledger's slot
    columns) -- to ``(stage, purpose, step, policy_version)``; the others are left alone."""
    for scorer in scorers:
        bind = getattr(scorer, "bind", None)
        if callable(bind):
            bind(stage=stage, purpose=purpose, step=step, policy_version=policy_version)


class BindScorers(StepHook):
    """Binds the run's scorers to each training step (``train``) and each evaluation (``eval``) as ``stage``: a
    judge's requests then carry the stage, purpose, step and policy version in its ledger (a resumed step re-uses
    its recorded answers even when its re-generated media differ)."""

    def __init__(self, stage: str) -> None:
        self.stage = stage

    def before_step(self, trainer: RunningTrainer, step: int) -> None:
        bind_scorers(trainer.rewards.scorers.values(), stage=self.stage, purpose="train", step=step,
                     policy_version=trainer.policy.optimizer_steps)

    def before_eval(self, trainer: RunningTrainer, step: int) -> None:
        bind_scorers(trainer.rewards.scorers.values(), stage=self.stage, purpose="eval", step=step,
                     policy_version=trainer.policy.optimizer_steps)


def weighted(weights: dict[str, float]) -> list[str]:
    """The components with a non-zero weight: those whose failure drops a group."""
    return [k for k, w in weights.items() if w]


def scored_rows(components: dict[str, torch.Tensor], weights: dict[str, float]) -> torch.Tensor:
    """``[B]`` bool (CPU): the rows whose weighted components (:func:`weighted`) are all finite."""
    names = weighted(weights)
    ok = torch.ones(len(components[names[0]]) if names else 0, dtype=torch.bool)
    for name in names:
        ok &= torch.isfinite(components[name].detach().cpu())
    return ok


def drop_failed_groups(components: dict[str, torch.Tensor], weights: dict[str, float], group_ids: torch.Tensor):
    """The failed groups of one step (module docstring) on this rank.

    Args:
        components: ``[B]`` per component, this rank's rows. weights: ``reward.weights``.
        group_ids: ``[B]`` int64 the rows' group ids.

    Returns:
        ``(clean, drop, failed)``: ``components`` with NaN of the weighted ones set to 0 (so the group statistics
        stay finite), ``[B]`` bool the rows of failed groups, and the sorted ids of those groups.
    """
    bad = ~scored_rows(components, weights)
    failed = sorted(set(group_ids[bad].tolist()))
    drop = torch.isin(group_ids.cpu(), torch.tensor(failed, dtype=group_ids.dtype))
    clean = {k: torch.nan_to_num(v, nan=0.0) if k in weights else v for k, v in components.items()}
    return clean, drop, failed


def dropped_metrics(total: torch.Tensor, drop: torch.Tensor, failed: list[int], num_groups: int
                    ) -> dict[str, torch.Tensor]:
    """``reward/judge_failed_groups`` (every rank's failed groups, a group straddling ranks once) and
    ``reward/total_mean`` over the kept rows of every rank (NaN when none is kept). A collective.

    Args:
        total: ``[B]`` this rank's weighted total reward. drop: ``[B]`` bool. failed: this rank's failed group ids.
        num_groups: the step's number of groups (``M``).
    """
    flags = torch.zeros(num_groups)
    flags[failed] = 1.0
    flags = all_reduce_processes(flags, "max")
    kept = torch.stack([total[~drop.to(total.device)].double().sum().cpu(),
                        torch.tensor(float((~drop).sum()), dtype=torch.float64)])
    kept = all_reduce_processes(kept, "sum")
    return {"reward/judge_failed_groups": flags.sum(),
            "reward/total_mean": (kept[0] / kept[1]).float() if kept[1] > 0 else torch.tensor(math.nan)}
