"""Stages 1-2 of the loop, on-policy or ahead of time: ``train.max_staleness`` (bounded-staleness asynchronous RL).

With ``max_staleness: s = 0`` (the default) each step draws its prompts and rolls them out itself, as it always did
(:meth:`Lookahead.rollout` calls the trainer's ``next_prompts`` and ``sample``, nothing else).

With ``s > 0`` (rollout workers and a GRPO-family objective; preflight refuses anything else), once step ``k`` has
its trajectory and *before* it updates, the prompts of steps ``k+1 .. k+s`` are drawn and their rollouts submitted to
the workers (:meth:`~flowforge.train.rollout_workers.WorkerRollout.submit`) with the weights of version ``k`` (the
trainer's weights after ``k`` steps); they run in the workers while step ``k`` scores and updates. Step ``j`` then
trains on a trajectory ``j - k <= s`` versions old, tagged with its version (``Trajectory.policy_version``, logged as
``train/policy_version`` and ``train/staleness``); the GRPO-family loss weighs it by the clipped importance ratio
against the recorded log-probs of the version that sampled it (:mod:`flowforge.algorithms.staleness`).

Synchronisation points, where nothing is submitted ahead and the step rolls out on-policy:

* the first step of every :meth:`~flowforge.train.trainer.Trainer.train` call (nothing is queued yet);
* the step after each scheduled checkpoint (``checkpoint.every``): a rollout is never submitted across a scheduled
  save, so a checkpoint holds no queued rollout and a run resumed from it (after a crash or ``kill -9``) rolls out
  step for step what the uninterrupted run did -- the same steps on-policy, the same steps from the same versions;
  noise is decided by the candidates' sample ids, so nothing else is needed. The queued rollout is *recomputed*,
  never checkpointed.

A run that stops elsewhere (a signal, the reward-hacking guard, ``stop_at``) waits for its queued rollouts, discards
them and rewinds the prompt sampler to before they were drawn, so its final checkpoint is complete; a run resumed
from such a checkpoint rolls its first step out on-policy where the uninterrupted run would have used a stale one
(the only case in which a resume is not bit-exact).

Step hooks and a prompt source other than the sampler's are refused with ``s > 0``: they are told of step ``k+1``
(``before_step``, ``groups``) before step ``k`` is scored, which the stage pipeline's ledger and judges do not allow.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

from flowforge.train.metrics import StageTimer
from flowforge.train.seams import RunningTrainer, SamplerPrompts
from flowforge.train.step_batch import StepBatch

log = logging.getLogger("flowforge")


class Lookahead:
    """The rollouts submitted ahead of their step (module docstring), for one :class:`~flowforge.train.trainer.Trainer`.

    Raises:
        ValueError: ``train.max_staleness > 0`` with step hooks or a prompt source other than the sampler's.
    """

    def __init__(self, trainer: RunningTrainer):
        self.trainer = trainer
        self.max_staleness = trainer.cfg.train.max_staleness
        self.pending: dict[int, tuple[StepBatch, object, Future]] = {}  # step -> (batch, cond, submitted rollout)
        self._sampler_before: dict | None = None  # the sampler's state before the first queued draw
        if self.max_staleness and (trainer.hooks or not isinstance(trainer.prompts, SamplerPrompts)):
            raise ValueError(f"train.max_staleness={self.max_staleness} runs with flowforge train's own prompt "
                             "sampler and no step hooks (the stage pipeline's ledger and judges see each step in "
                             "order); allowed here: train.max_staleness=0")

    def rollout(self, step: int, end: int, timer: StageTimer):
        """Stages 1-2 of step ``step`` (``end``: the step this :meth:`train` call stops before): ``(batch, traj,
        cond)``, the submitted rollout when there is one (timed as ``sample``: the wait), else drawn and rolled out
        now; then, with ``s > 0``, the rollouts of the next steps are submitted (timed as ``prompts``)."""
        tr = self.trainer
        queued = self.pending.pop(step, None)
        if queued is None:
            with timer("prompts"):
                for hook in tr.hooks:
                    hook.before_step(tr, step)
                batch = tr.next_prompts()
            with timer("sample"):
                traj, cond = tr.sample(batch, step)
        else:
            batch, cond, pending = queued
            with timer("sample"):
                traj = tr.engine.take(pending)
            if not self.pending:
                self._sampler_before = None
        if self.max_staleness:
            with timer("prompts"):
                self._submit_ahead(step, end)
        return batch, traj, cond

    def _submit_ahead(self, step: int, end: int) -> None:
        """Submit the rollouts of steps ``step+1 .. step+s`` (before ``end``) not yet submitted, as version ``step``,
        up to the first scheduled checkpoint (module docstring)."""
        tr = self.trainer
        every = tr.cfg.checkpoint.every
        for j in range(step + 1, min(step + self.max_staleness, end - 1) + 1):
            if every and j % every == 0:
                break  # a checkpoint is saved after step j - 1: step j rolls out on-policy after it
            if j in self.pending:
                continue
            if not self.pending:
                self._sampler_before = tr.sampler.state_dict()
            batch = tr.next_prompts()
            cond, request = tr.rollout_request(batch, j)
            self.pending[j] = (batch, cond, tr.engine.submit(cond, **request, step=j, version=step))

    def drain(self) -> None:
        """Wait for the queued rollouts, discard them and rewind the sampler to before their prompts were drawn (the
        run stops with them unused; its checkpoint then draws them again on resume)."""
        for _, _, pending in self.pending.values():
            error = pending.exception()
            if error is not None:
                log.warning("a rollout queued ahead failed after the run stopped (discarded): %s", error)
        if self._sampler_before is not None:
            self.trainer.sampler.load_state_dict(self._sampler_before)
        self.pending.clear()
        self._sampler_before = None
