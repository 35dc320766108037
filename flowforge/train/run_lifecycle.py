"""A run directory's lifecycle, from the trainer's side: checked before anything is written, claimed (rank 0 takes
its lock; an existing run needs ``train.resume`` or ``--overwrite``, which moves it aside), accepted once the model
loaded and the resume checked (``config.yaml``, provenance, the metrics logger), abandoned by a refused command (lock
released, a directory it created removed when still empty), released at the end. A resume's claim first finishes
the checkpoint deletions a killed save left marked (:func:`flowforge.train.checkpoint.finish_removals`).

A command that fails after it was accepted but before it completed a step (a reward server down at the first
score) leaves the run directory as it found it: :class:`RunJournal` records, at acceptance, the existing files
the acceptance rewrites (their bytes), the append-only logs (their sizes) and which files the run's own names hold;
the failure puts the first back, cuts the second, removes the files it added (a new run's ``config.yaml`` too, so a
plain rerun is not refused) and releases the lock (undoing a claim it made). A failure after a completed step keeps
what that step wrote (its metrics, its checkpoint: a later ``train.resume`` continues from there) and releases the
lock. A resume cuts the logs back to the step it resumes from (:mod:`flowforge.train.history`).

``train.resume=auto`` (``must``) on a directory whose ``metrics.jsonl`` logged more steps than an interrupted first
checkpoint explains, but which holds no committed checkpoint (deleted, or all damaged), is refused: starting again at
step 0 would silently throw that training away (:func:`refuse_lost_history`). ``train.resume=must`` is refused
whenever there is nothing to resume; ``auto`` warns about a mistyped ``run.name`` (:func:`nothing_to_resume`).

:class:`RunDirectory` is a base of :class:`flowforge.train.trainer.Trainer`; it uses the trainer's ``cfg``,
``dist``, ``adapter``, ``threads`` (what :func:`~flowforge.train.perf.set_cpu_threads` returned) and ``overwrite``
and sets ``run_dir``, ``model_source``, ``train_prompts``, ``eval_prompts``, ``run_lock`` and ``logger``. The rules
themselves live in :mod:`flowforge.runtime.run_dir` and :mod:`flowforge.runtime.lock`.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
from pathlib import Path

from flowforge import config as config_lib
from flowforge.data.prompt_set import open_prompts
from flowforge.data.prompts import check_task
from flowforge.demo.paths import resolve_demo_path
from flowforge.runtime import distributed as dist_lib
from flowforge.runtime.durable import refuse_escaping_symlink, write_bytes
from flowforge.runtime.errors import UserError
from flowforge.runtime.lock import RunLock
from flowforge.runtime.run_dir import (CONFIG_FILE, EVAL_FILE, LOG_FILE, METRICS_FILE, MODEL_PROVENANCE_FILE,
                                       PROVENANCE_FILE, SAMPLES_DIR, TB_DIR, WRITTEN_FILES, check_artifacts_root,
                                       check_run_dir_outside_source, check_run_dir_place, committed_checkpoints,
                                       existing_run, last_logged_step, move_aside, refuse_foreign_resume,
                                       refuse_rerun, saved_setting)
from flowforge.train.checkpoint import RESUME_NEWEST, finish_removals
from flowforge.train.history import cut_history, purge_step
from flowforge.train.metrics import MetricsLogger, write_provenance

log = logging.getLogger("flowforge")


class RunDirectory:
    """The run-directory steps of :class:`~flowforge.train.trainer.Trainer` (see the module docstring)."""

    run_lock: RunLock | None = None
    own_area: Path | None = None  # the area around the run its owner writes (a pipeline stage: the pipeline directory)
    _created_run_dir: bool = False
    _journal: RunJournal | None = None  # rank 0, from acceptance on: what a failed command puts back
    _accepted_at: tuple[int, int | None] | None = None  # (step, saved checkpoint step) when accepted

    def _prepare_run(self) -> None:
        """Checks before anything is written: the run directory (refused inside the base model's; an existing run
        needs ``train.resume`` or ``--overwrite``; none of its files a symlink leading out of it), ``artifacts.root``
        (not inside checkpoints), the prompt files (bad ones fail before any model loads); then the run's lock
        (rank 0). ``config.yaml`` and provenance wait for :meth:`_accept_run`."""
        cfg = self.cfg
        self.run_dir = Path(cfg.run.output_dir) / cfg.run.name
        self.model_source = _model_source(cfg.model.path)
        if self.model_source is not None:
            check_run_dir_outside_source(self.run_dir, self.model_source, own=self.own_area)
        else:
            check_run_dir_place(self.run_dir, own=self.own_area)
        if not self.overwrite:  # a checkpoint continues in its own run or a new one, never over another run
            refuse_foreign_resume(self.run_dir, cfg.train.resume, cfg.run.output_dir)
        checked = getattr(self, "_checked_prompts", {})  # the files preflight opened (one pass over a big file)
        self.train_prompts = checked.get("data.prompts") or open_prompts(cfg.data.prompts)  # offsets, rows on demand
        eval_prompts = checked.get("data.eval_prompts") or open_prompts(cfg.data.eval_prompts)
        self.eval_prompts = eval_prompts[: cfg.eval.max_prompts]  # a list: every one is evaluated
        check_task(self.train_prompts, cfg.model.task, "data.prompts")
        check_task(self.eval_prompts, cfg.model.task, "data.eval_prompts")
        if cfg.artifacts.root is not None:
            check_artifacts_root(Path(cfg.artifacts.root), self.run_dir)
        for name in WRITTEN_FILES:
            refuse_escaping_symlink(self.run_dir / name, self.run_dir)
        if cfg.train.resume in RESUME_NEWEST and not committed_checkpoints(self.run_dir):
            nothing_to_resume(self.run_dir, cfg.train.resume)  # resume=must refused, a mistyped run.name warned
            refuse_lost_history(self.run_dir, cfg.checkpoint.every, cfg.train.steps)  # before any model loads
        if self.dist.is_main:
            self._claim_run_dir()
        dist_lib.barrier(self.dist)

    def _claim_run_dir(self) -> None:
        """Rank 0: refuse a new run into a directory holding one (or move that aside under ``--overwrite``, as a
        resume from another run's checkpoint into it: :func:`refuse_foreign_resume`), create
        the directory if missing, take its lock (a second process is refused, naming the holder)."""
        found = existing_run(self.run_dir)
        if found and (not self.cfg.train.resume or self.overwrite and self._foreign_resume()):
            # a live run first: "locked by PID N" says more than "already holds a run" (and --overwrite must wait)
            RunLock(self.run_dir).check_free()
            if not self.overwrite:
                refuse_rerun(self.run_dir, found)
            move_aside(self.run_dir)
        if not self.run_dir.exists():
            self.run_dir.mkdir(parents=True)
            self._created_run_dir = True
        self.run_lock = RunLock(self.run_dir)
        self.run_lock.acquire()
        if self.cfg.train.resume:  # a save killed while deleting a checkpoint: finish what it provably started
            finish_removals(self.run_dir)

    def _foreign_resume(self) -> bool:
        """Whether ``train.resume`` names a checkpoint that :func:`refuse_foreign_resume` keeps out of the existing
        run (``--overwrite`` then moves that run aside, as for a new run)."""
        try:
            refuse_foreign_resume(self.run_dir, self.cfg.train.resume, self.cfg.run.output_dir)
        except UserError:
            return True
        return False

    def _accept_run(self) -> None:
        """The command is accepted (model loaded, resume checked): write the resolved config and provenance
        atomically and open the metrics logger (rank 0). First the journal a failure undoes (:class:`RunJournal`);
        a resume that found no usable checkpoint (all damaged) is refused like a deleted one."""
        resume = self.cfg.train.resume
        if resume in RESUME_NEWEST and self.checkpoints.resumed_from is None:
            if resume == "must":  # every committed checkpoint was damaged
                nothing_to_resume(self.run_dir, resume)
            refuse_lost_history(self.run_dir, self.cfg.checkpoint.every, self.cfg.train.steps)
        self._accepted_at = (self.state.step, self.checkpoints.saved_step)
        if self.dist.is_main:
            self._journal = RunJournal(self.run_dir)
            if resume:  # steps after the resumed one are trained again: each is logged once
                cut_history(self.run_dir, self.state.step, self._journal.rewrite)
            write_bytes(self.run_dir / "config.yaml", config_lib.dump_config(self.cfg).encode())
            write_provenance(self.run_dir, {"cpu_threads": self.threads})  # set_cpu_threads: the peaks measured
            record = getattr(self.adapter, "provenance_record", None)  # a world model: every loaded tensor's source
            if record is not None:
                write_bytes(self.run_dir / MODEL_PROVENANCE_FILE, (json.dumps(record(), indent=1) + "\n").encode())
            self.logger = MetricsLogger(self.run_dir, trackers=self.cfg.metrics.trackers, run_name=self.cfg.run.name,
                                        wandb=self.cfg.metrics.wandb,
                                        purge_step=purge_step(self.state.step) if resume else None)
            self.logger.log_config(config_lib.to_dict(self.cfg), config_lib.dump_config(self.cfg))
        dist_lib.barrier(self.dist)

    def _abandon(self) -> None:
        """Undo what a refused command did to the run directory: its lock files, the directory if it made it."""
        if self.run_lock is not None:
            self.run_lock.release(undo=True)
        if self._created_run_dir:
            try:
                self.run_dir.rmdir()
            except OSError:  # not empty: something else wrote there meanwhile; left alone
                pass

    def _fail(self) -> None:
        """A command failed (an exception leaves :meth:`__init__` or :meth:`train`): close the metrics sinks; when it
        completed no step and saved no checkpoint, put the run directory back as it was (:class:`RunJournal`) and
        undo the claim (:meth:`_abandon`); otherwise keep what its steps wrote and release the lock."""
        logger = getattr(self, "logger", None)
        if logger is not None:
            logger.close()
        progressed = (self._accepted_at is not None
                      and self._accepted_at != (self.state.step, self.checkpoints.saved_step))
        if progressed:
            self.close()
            return
        if self._journal is not None:
            self._journal.restore()
            self._journal = None
        self._abandon()

    def close(self) -> None:
        """Release the run directory's lock (:meth:`train` does at its end; a later :meth:`train` takes it again)."""
        if self.run_lock is not None:
            self.run_lock.release()


class RunJournal:
    """What accepting a command is about to change in a run directory, so that a command that then fails without
    completing a step leaves the directory as it was (rank 0; the module docstring says when).

    Taken before :meth:`RunDirectory._accept_run` writes: the bytes of the existing files acceptance rewrites
    (``config.yaml``, provenance files, and the logs a resume cuts back, :meth:`rewrite`), the sizes of the existing
    append-only logs (``metrics.jsonl``, ``eval.jsonl``, ``train.log``) and the list of files under the names a run
    writes (:data:`~flowforge.runtime.run_dir.WRITTEN_FILES`, ``samples/`` and ``tb/`` included).
    :meth:`restore` puts the first back, cuts the second to their sizes and removes the files added since under
    those names (then ``samples/`` and ``tb/`` when this command made them and they are empty), so a failed first
    run leaves no ``config.yaml`` behind and a plain rerun is not refused. Nothing else is touched: files of other
    writers (a judge's request ledger, ``audit.jsonl``) record what really happened.
    """

    REWRITTEN = (CONFIG_FILE, PROVENANCE_FILE, MODEL_PROVENANCE_FILE)
    APPENDED = (METRICS_FILE, EVAL_FILE, LOG_FILE)
    OWNED = (*WRITTEN_FILES, TB_DIR)  # names only a run writes: files new under them are this command's
    DIRS = (SAMPLES_DIR, TB_DIR)

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.rewritten = {n: p.read_bytes() for n in self.REWRITTEN if (p := self.run_dir / n).is_file()}
        self.appended = {n: p.stat().st_size for n in self.APPENDED if (p := self.run_dir / n).is_file()}
        self.files = set(self._owned_files())
        self.dirs = {n for n in self.DIRS if os.path.lexists(self.run_dir / n)}

    def _owned_files(self) -> list[Path]:
        out = []
        for name in self.OWNED:
            path = self.run_dir / name
            if path.is_dir():
                out += [p for p in path.rglob("*") if p.is_file() or p.is_symlink()]
            elif path.is_file():
                out.append(path)
        return out

    def rewrite(self, name: str, data: bytes) -> None:
        """Replace the existing file ``name`` by ``data`` (atomically), its old bytes kept for :meth:`restore`."""
        path = self.run_dir / name
        self.rewritten.setdefault(name, path.read_bytes())
        self.appended.pop(name, None)
        write_bytes(path, data)

    def restore(self) -> None:
        """Put the run directory back as it was when the journal was taken (see the class docstring)."""
        for name, data in self.rewritten.items():
            path = self.run_dir / name
            if not path.is_file() or path.read_bytes() != data:
                write_bytes(path, data)
        for name, size in self.appended.items():
            path = self.run_dir / name
            if path.is_file() and path.stat().st_size > size:
                os.truncate(path, size)
        for path in set(self._owned_files()) - self.files:
            path.unlink(missing_ok=True)
        for name in set(self.DIRS) - self.dirs:
            path = self.run_dir / name
            if path.is_dir() and not path.is_symlink():
                for sub in sorted((p for p in path.rglob("*") if p.is_dir()), reverse=True):
                    _rmdir_if_empty(sub)
                _rmdir_if_empty(path)


def _rmdir_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:  # not empty: another writer's files stay
        pass


def nothing_to_resume(run_dir: Path, resume: str) -> None:
    """``run_dir`` holds no committed checkpoint: refuse ``train.resume=must``; under ``auto`` (which then starts
    from scratch) warn when the run directory does not exist but runs with close names do beside it (a mistyped
    ``run.name``: ``difflib`` close matches).

    Raises:
        UserError: ``train.resume=must: nothing to resume in <run_dir> ...`` (with the close names).
    """
    run_dir = Path(run_dir)
    close = []
    if not run_dir.exists() and run_dir.parent.is_dir():
        runs = [p.name for p in run_dir.parent.iterdir() if p.is_dir() and existing_run(p)]
        close = difflib.get_close_matches(run_dir.name, runs, n=3, cutoff=0.6)
    hint = f"did you mean run.name={' or run.name='.join(close)}? " if close else ""
    if resume == "must":
        why = "does not exist" if not run_dir.exists() else "holds no usable committed checkpoint"
        raise UserError("train.resume=must", f"nothing to resume: the run directory {run_dir} {why}",
                        f"{hint}check run.name and run.output_dir, or use train.resume=auto to start from scratch "
                        "when there is nothing")
    if close:
        log.warning("train.resume=auto: the run directory %s does not exist; %sstarting from scratch", run_dir, hint)


def refuse_lost_history(run_dir: Path, every: int, steps: int | None = None) -> None:
    """Refuse ``train.resume=auto`` on a run directory without a usable committed checkpoint whose
    ``metrics.jsonl`` logged more steps than an interrupted first checkpoint explains: past the step of the first
    save, ``min(checkpoint.every, train.steps)`` (the run's own ``config.yaml``'s values, else ``every`` and
    ``steps``; a kill between logging that step and committing its checkpoint leaves it logged, and a restart from 0
    replays it exactly), or any step with ``checkpoint.every`` 0 (nothing was ever saved: a restart would silently
    begin the run again). A run directory without such a history starts from step 0 as before.

    Raises:
        UserError: ``train.resume=auto: <run_dir> logged N steps but ...; <what to do>``.
    """
    done = last_logged_step(run_dir)
    for section, key in (("checkpoint", "every"), ("train", "steps")):
        try:  # the run's own value; unreadable: judged by this command's
            value = int(saved_setting(run_dir, section, key))
        except (ValueError, TypeError):
            continue
        every, steps = (value, steps) if key == "every" else (every, value)
    first = min(every, steps) if every > 0 and steps else every
    if done is None or done < 1 or (every > 0 and done <= first):
        return
    why = (f"its first save was at step {first} (checkpoint.every={every}): deleted or damaged" if every > 0
           else "checkpoint.every=0 saves only at the end")
    raise UserError("train.resume=auto", f"{run_dir} logged {done} steps in {METRICS_FILE} but holds no committed "
                    f"checkpoint to resume from ({why}); starting again at step 0 would throw that training "
                    "away",
                    "restore its checkpoints, or start it anew without train.resume and with --overwrite (the old run "
                    f"is moved aside to {Path(run_dir).name}.old-<n>), or choose another run.name")


def _model_source(path: str) -> Path | None:
    """The local directory (or file) holding the base weights, or None for a hub id."""
    local = Path(resolve_demo_path(path))
    return local if local.exists() else None
