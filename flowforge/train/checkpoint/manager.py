"""Checkpoint manager: saves and restores the run's Stateful objects in the checkpoint format.

What and why
------------
Everything a run needs to continue bit-exactly lives in a few objects that follow the
``torch.distributed.checkpoint.stateful.Stateful`` protocol (``state_dict()`` / ``load_state_dict(state)``):

=================  ========================================  ===============================================
object             its state                                 where it goes in ``checkpoints/step_<n>/``
=================  ========================================  ===============================================
policy bank        weights of live / old / EMA, optimizer,   ``weights/<name>.safetensors``, ``optimizer.pt``
(``Policy``)       LR schedule, optimizer-step counter       (``scheduler`` + ``optimizer``), or ``dcp/``
                                                             under FSDP; counters in ``trainer_state.json``
trainer record     step, config fingerprint, training        ``trainer_state.json`` (top level)
(:class:`TrainerState`)  contract (LoRA + base model sha256)
prompt sampler     epoch, cursor, steps drawn, identity      ``trainer_state.json["sampler"]``
(``KRepeatSampler``)
per-rank RNG       python / numpy / torch / CUDA generators  ``rng/rank_<r>.*`` (captured at write time)
the objective's    what it owns outside the bank, e.g.       ``weights/objective.<group>.safetensors``,
own state          DMD2's fake score and its optimizer       ``optimizer.pt["objective"]`` (not under FSDP)
=================  ========================================  ===============================================

:class:`CheckpointManager` is the one place that maps these state dicts onto the files of
:mod:`flowforge.train.checkpoint` (the durable file layer: write order, ``COMMITTED``, ``latest``, rotation of the
newest ``checkpoint.keep``) and back. Under FSDP the policy bank hands its trainable weights and optimizer over as
sharded (DTensor) state dicts, which the manager writes and reads with ``torch.distributed.checkpoint`` (every rank
its shard, top-level keys ``model`` / ``optim``).

Resume refuses a checkpoint trained under another contract before any weight is touched
(:func:`check_contract`): a different LoRA rank / alpha / targets / dropout or trainable mode, or another base model.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowforge.runtime import distributed as dist_lib
from flowforge.settings import LORA_MODES, MODULE_MODES, config_diff, resume_neutral_keys
from flowforge.runtime.durable import step_of
from flowforge.runtime.errors import UserError
from flowforge.runtime.rng import restore_rng
from flowforge.train.checkpoint import (SHARDED_DIR, load_checkpoint, no_checkpoints_note, resolve_resume,
                                        save_checkpoint)

if TYPE_CHECKING:  # torch.distributed.checkpoint is imported only when a sharded checkpoint is written or read
    from torch.distributed.checkpoint.stateful import Stateful

log = logging.getLogger("flowforge")

CONTRACT_KEYS = ("lora", "base_model_sha256")
SAMPLER_KEY = "sampler"
OBJECTIVE_PREFIX = "objective."  # weight groups of the objective's own state (Objective.checkpoint_state)


# ------------------------------------------------------------------------------------------------ contract
def training_contract(lora_cfg: Any, policy: Any, base_model_sha256: str | None) -> dict:
    """What a checkpoint must agree with to be resumed: ``{"lora": {trainable, dropout[, rank, alpha, targets]
    [, modules]}, "base_model_sha256": str | None}`` (rank / alpha / targets as the policy bank resolved them, under
    ``lora`` and ``module+lora``; the trained submodules under ``module`` and ``module+lora``)."""
    lora = {"trainable": lora_cfg.trainable, "dropout": lora_cfg.dropout}
    if lora_cfg.trainable in LORA_MODES:
        lora.update(rank=policy.rank, alpha=policy.alpha, targets=sorted(policy.targets))
    if lora_cfg.trainable in MODULE_MODES:
        lora["modules"] = sorted(policy.modules)
    return {"lora": lora, "base_model_sha256": base_model_sha256}


def _normalise(value: Any, key: str) -> Any:
    if isinstance(value, (list, tuple)):
        items = [_normalise(v, key) for v in value]
        # module-name patterns: the order in which they were listed does not change which modules get LoRA
        return sorted(items) if key == "targets" and all(isinstance(v, str) for v in items) else items
    if isinstance(value, Mapping):
        return {k: _normalise(v, k) for k, v in value.items()}
    return value


_MISSING = "(missing)"


def _diff(prefix: str, saved: Any, current: Any, out: list[str]) -> None:
    if isinstance(saved, Mapping) and isinstance(current, Mapping):
        for k in sorted(set(saved) | set(current), key=str):
            _diff(f"{prefix}.{k}", saved.get(k, _MISSING), current.get(k, _MISSING), out)
        return
    if saved != current:
        out.append(f"{prefix}: checkpoint {saved}, this run {current}")


def check_contract(saved: Mapping[str, Any], current: Mapping[str, Any], *,
                   keys: Sequence[str] = CONTRACT_KEYS) -> None:
    """Refuse to resume when the training contract differs: the LoRA contract (``lora`` = {trainable, rank, alpha,
    targets, modules, dropout} as the mode has them) and the base model's sha256, as stored in ``trainer_state`` vs
    this run's.

    Numbers compare by value (8 == 8.0), sequences ignore tuple/list, ``targets`` ignore order; a key present on one
    side only is a mismatch.

    Raises:
        ValueError: one error listing every mismatch, e.g. ``lora.alpha: checkpoint 8.0, this run 16.0``.
    """
    mismatches: list[str] = []
    for key in keys:
        _diff(key, _normalise(saved.get(key, _MISSING), key), _normalise(current.get(key, _MISSING), key),
              mismatches)
    if mismatches:
        raise ValueError("resume refused: the checkpoint was trained under a different contract than this run "
                         "(start a new run directory, or restore the original settings):\n  "
                         + "\n  ".join(mismatches))


# ------------------------------------------------------------------------------------------------ trainer record
@dataclass
class TrainerState:
    """The trainer's own record (Stateful): completed steps, the config fingerprint and the training contract.

    ``state_dict()`` → ``{"step": int, "config_fingerprint": str, "lora": {...}, "base_model_sha256": str | None}``
    (JSON-able). ``load_state_dict`` checks the contract first (:func:`check_contract`, raises ``ValueError``), warns
    when the config fingerprint differs (a changed config is allowed, it is the user's call), then takes the step.
    """

    step: int
    contract: dict  # training_contract(...): "lora" and "base_model_sha256"
    config_fingerprint: str  # flowforge.settings.resume_fingerprint of the run's config
    config: dict | None = None  # the run's config as a nested dict (to_dict), stored to say what changed on resume
    expected_changes: tuple[str, ...] = ()  # keys / sections this run changes on purpose (stage C's reward): no warning

    def state_dict(self) -> dict:
        extra = {} if self.config is None else {"config": self.config}
        return {"step": self.step, "config_fingerprint": self.config_fingerprint, **self.contract, **extra}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_contract(state, self.contract)
        if state.get("config_fingerprint") != self.config_fingerprint:
            changes = resume_changes(state.get("config"), self.config, self.expected_changes)
            if changes:
                log.warning("resuming with a config that differs from the checkpoint's in what it computes: %s",
                            changes)
        self.step = int(state["step"])


def resume_changes(saved: Mapping[str, Any] | None, current: Mapping[str, Any] | None,
                   expected: Sequence[str] = ()) -> str:
    """The changed keys as ``"key: old -> new; ..."`` (:func:`flowforge.settings.config_diff` without the
    resume-neutral keys and the ``expected`` ones), or a note that the checkpoint does not record its config;
    ``""`` when every change is an ``expected`` one (nothing to warn about)."""
    if saved is None or current is None:
        return "the checkpoint does not record its config (written by an older flowforge)"
    neutral = resume_neutral_keys(current)
    changed = config_diff(saved, current, (*neutral, *expected))
    if not changed and expected and config_diff(saved, current, neutral):
        return ""
    return "; ".join(changed) or "no key differs (the fingerprint was computed by an older flowforge)"


# ------------------------------------------------------------------------------------------------ manager
class CheckpointManager:
    """Save / resume of a run's Stateful objects (see the module docstring for the mapping onto files).

    Args:
        run_dir: the run directory (checkpoints go to ``<run_dir>/checkpoints/``).
        policy: the policy bank (``flowforge.policy.Policy``): ``state_dict()`` with ``weights`` / ``scheduler`` /
            ``optimizer_steps`` and either ``optimizer`` or (FSDP) ``sharded``.
        record: the trainer's :class:`TrainerState`; its ``step`` names the checkpoint.
        sampler: the prompt sampler (``KRepeatSampler``), stored under ``trainer_state.json["sampler"]``.
        objective: the objective, whose :meth:`~flowforge.objectives.base.Objective.checkpoint_state` (state it
            owns outside the bank, e.g. DMD2's fake score) is saved as weight groups ``objective.<group>`` and
            ``optimizer.pt["objective"]``, and restored through ``load_checkpoint_state``; None: nothing.
        keep: committed checkpoints kept (``checkpoint.keep``).
        dist: this process's rank / world size (every rank calls :meth:`save` and :meth:`restore`).
    """

    def __init__(self, run_dir: Path, *, policy: Stateful, record: TrainerState, sampler: Stateful, keep: int,
                 dist: dist_lib.DistInfo, objective: Any = None):
        self.run_dir = Path(run_dir)
        self.objective = objective
        self.policy, self.record, self.sampler = policy, record, sampler
        self.keep = keep
        self.dist = dist
        self.resumed_from: Path | None = None  # never rotated away or overwritten
        self.pinned: Path | None = None  # kept through rotation too (:meth:`pin`)
        self.saved_step: int | None = None  # the step of the last checkpoint saved or restored (None: none yet)

    def pin(self, checkpoint: Path | None) -> None:
        """Keep ``checkpoint`` (a committed step directory of this run) through rotation from the next save on, in
        place of the one pinned before (None: none): what a caller may still have to go back to, e.g. stage C's last
        good checkpoint (:class:`~flowforge.orchestrate.stage_trainer.AuditHook`), which ``checkpoint.keep`` alone
        would rotate away once more than ``keep`` checkpoints follow it. Rank 0's pin is the one used."""
        self.pinned = None if checkpoint is None else Path(checkpoint)

    def save(self) -> Path:
        """Commit a checkpoint of ``record.step``: every bank policy's weights, the optimizer and LR schedule, the
        trainer record, the sampler position and every rank's RNG. A collective: every rank calls it.

        Returns:
            The committed step directory.
        """
        bank = self.policy.state_dict()  # a collective under FSDP (gathers old / EMA shards)
        optim = {"scheduler": bank["scheduler"]}
        writer = None
        if "sharded" in bank:
            import torch.distributed.checkpoint as dcp

            writer = lambda directory: dcp.save(bank["sharded"], checkpoint_id=str(directory))  # noqa: E731
        else:
            optim["optimizer"] = bank["optimizer"]
        steps = bank["optimizer_steps"]
        weights = dict(bank["weights"])
        own = self.objective.checkpoint_state() if self.objective is not None else {}
        for group, tensors in (own.get("tensors") or {}).items():
            weights[OBJECTIVE_PREFIX + group] = tensors
        if own.get("optimizer") is not None:
            if "optimizer" not in optim:
                raise ValueError("an objective with its own optimizer state is not supported with sharded (FSDP) "
                                 "checkpoints")
            optim["objective"] = own["optimizer"]
        trainer_state = {**self.record.state_dict(), "optimizer_steps": steps, "policy_version": steps,
                         "lr_schedule_step": bank["scheduler"]["last_epoch"], SAMPLER_KEY: self.sampler.state_dict()}
        d = self.dist
        path = save_checkpoint(self.run_dir, self.record.step, tensors=weights, optimizer_state=optim,
                               trainer_state=trainer_state, keep=self.keep, protect=self.resumed_from,
                               keep_also=[self.pinned] if self.pinned is not None else (), rank=d.rank,
                               world_size=d.world_size,
                               barrier=(lambda: dist_lib.barrier(d)) if d.enabled else None, sharded_writer=writer)
        self.saved_step = self.record.step
        return path

    def restore(self, resume: str, max_step: int | None = None) -> Path | None:
        """Restore what :meth:`save` wrote from ``resume`` (``"auto"``: the newest committed checkpoint; else a
        checkpoint directory); training continues at ``record.step``.

        Returns:
            The checkpoint restored from, or None when ``"auto"`` finds none (the run starts from scratch).

        Args:
            max_step: ``train.steps``; a checkpoint past it is refused (before anything is restored or written).

        Raises:
            UserError: (a ``ValueError``) an explicit checkpoint whose file differs from its manifest (size or
                sha256); under ``"auto"`` such a checkpoint is skipped for the previous committed one instead; a
                checkpoint past ``max_step``.
            ValueError: an explicit checkpoint without ``COMMITTED``; a LoRA-contract or base-model mismatch (raised
                before anything is restored); sharded (FSDP) state in a run that is not sharded.
        """
        path, notes = resolve_resume(self.run_dir, resume)
        if notes == [no_checkpoints_note(self.run_dir)]:
            notes = []  # a fresh run directory: the one INFO line below says it (was also logged as a WARNING)
        for note in notes:
            log.warning(note)
        if path is not None and max_step is not None and (step := step_of(path)) is not None and step > max_step:
            raise UserError(f"train.steps={max_step}", f"is below the step {step} of the checkpoint {path.name} "
                            "it would resume from (nothing would train, and config.yaml would say otherwise)",
                            f"give train.steps > {step} to continue, or leave the finished run as it is")
        if path is None:
            log.info("train.resume=%s: no committed checkpoint in %s, starting from scratch", resume, self.run_dir)
            return None
        ckpt = load_checkpoint(path, rank=self.dist.rank)
        ts = ckpt.trainer_state
        weights = {g: t for g, t in ckpt.tensors.items() if not g.startswith(OBJECTIVE_PREFIX)}
        optim = dict(ckpt.optimizer_state or {})
        own = {"tensors": {g.removeprefix(OBJECTIVE_PREFIX): t for g, t in ckpt.tensors.items()
                           if g.startswith(OBJECTIVE_PREFIX)}, "optimizer": optim.pop("objective", None)}
        if self.objective is not None:  # first: an objective that refuses the checkpoint does so before any restore
            self.objective.load_checkpoint_state(own if own["tensors"] or own["optimizer"] is not None else {})
        self.record.load_state_dict(ts)
        bank = {"weights": weights, **optim, "optimizer_steps": ts["optimizer_steps"]}
        if "optimizer" not in bank:
            bank["sharded"] = self._load_sharded(path / SHARDED_DIR)
        self.policy.load_state_dict(bank)
        self.sampler.load_state_dict(ts[SAMPLER_KEY])
        if ckpt.rng is not None:
            restore_rng(ckpt.rng)
        self.resumed_from = path
        self.saved_step = self.record.step
        log.info("resumed from %s at step %d", path, self.record.step)
        return path

    def _load_sharded(self, directory: Path) -> dict:
        """The policy bank's sharded state, read collectively from ``directory`` into its own template."""
        template = self.policy.state_dict().get("sharded")
        if template is None:
            raise ValueError(f"{directory.parent} holds sharded (FSDP) state: resume it with distributed.strategy="
                             "'fsdp' under torchrun")
        import torch.distributed.checkpoint as dcp

        dcp.load(template, checkpoint_id=str(directory))  # fails if a trainable tensor is missing from the shards
        return template
