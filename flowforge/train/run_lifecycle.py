"""A run directory's lifecycle, from the trainer's side: checked before anything is written, claimed (rank 0 takes
its lock; an existing run needs ``train.resume`` or ``--overwrite``, which moves it aside), accepted once the model
loaded and the resume checked (``config.yaml``, provenance, the metrics logger), abandoned by a refused command (lock
released, a directory it created removed when still empty), released at the end.

:class:`RunDirectory` is a base of :class:`flowforge.train.trainer.Trainer`; it uses the trainer's ``cfg``,
``dist``, ``adapter`` and ``overwrite`` and sets ``run_dir``, ``model_source``, ``train_prompts``, ``eval_prompts``,
``run_lock`` and ``logger``. The rules themselves live in :mod:`flowforge.runtime.run_dir` and
:mod:`flowforge.runtime.lock`.
"""

from __future__ import annotations

import json
from pathlib import Path

from flowforge import config as config_lib
from flowforge.data.prompts import check_task, load_prompts
from flowforge.demo.paths import resolve_demo_path
from flowforge.runtime import distributed as dist_lib
from flowforge.runtime.durable import refuse_escaping_symlink, write_bytes
from flowforge.runtime.lock import RunLock
from flowforge.runtime.run_dir import (MODEL_PROVENANCE_FILE, WRITTEN_FILES, check_artifacts_root,
                                       check_run_dir_outside_source, existing_run, move_aside, refuse_rerun)
from flowforge.train.metrics import MetricsLogger, write_provenance


class RunDirectory:
    """The run-directory steps of :class:`~flowforge.train.trainer.Trainer` (see the module docstring)."""

    run_lock: RunLock | None = None
    _created_run_dir: bool = False

    def _prepare_run(self) -> None:
        """Checks before anything is written: the run directory (refused inside the base model's; an existing run
        needs ``train.resume`` or ``--overwrite``; none of its files a symlink leading out of it), ``artifacts.root``
        (not inside checkpoints), the prompt files (bad ones fail before any model loads); then the run's lock
        (rank 0). ``config.yaml`` and provenance wait for :meth:`_accept_run`."""
        cfg = self.cfg
        self.run_dir = Path(cfg.run.output_dir) / cfg.run.name
        self.model_source = _model_source(cfg.model.path)
        if self.model_source is not None:
            check_run_dir_outside_source(self.run_dir, self.model_source)
        self.train_prompts = load_prompts(cfg.data.prompts)
        self.eval_prompts = load_prompts(cfg.data.eval_prompts)[: cfg.eval.max_prompts]
        check_task(self.train_prompts, cfg.model.task, "data.prompts")
        check_task(self.eval_prompts, cfg.model.task, "data.eval_prompts")
        if cfg.artifacts.root is not None:
            check_artifacts_root(Path(cfg.artifacts.root), self.run_dir)
        for name in WRITTEN_FILES:
            refuse_escaping_symlink(self.run_dir / name, self.run_dir)
        if self.dist.is_main:
            self._claim_run_dir()
        dist_lib.barrier(self.dist)

    def _claim_run_dir(self) -> None:
        """Rank 0: refuse a new run into a directory holding one (or move that aside under ``--overwrite``), create
        the directory if missing, take its lock (a second process is refused, naming the holder)."""
        found = existing_run(self.run_dir)
        if found and not self.cfg.train.resume:
            if not self.overwrite:
                refuse_rerun(self.run_dir, found)
            RunLock(self.run_dir).check_free()  # refused while another process runs the old run
            move_aside(self.run_dir)
        if not self.run_dir.exists():
            self.run_dir.mkdir(parents=True)
            self._created_run_dir = True
        self.run_lock = RunLock(self.run_dir)
        self.run_lock.acquire()

    def _accept_run(self) -> None:
        """The command is accepted (model loaded, resume checked): write the resolved config and provenance
        atomically and open the metrics logger (rank 0)."""
        if self.dist.is_main:
            write_bytes(self.run_dir / "config.yaml", config_lib.dump_config(self.cfg).encode())
            write_provenance(self.run_dir)
            record = getattr(self.adapter, "provenance_record", None)  # a world model: every loaded tensor's source
            if record is not None:
                write_bytes(self.run_dir / MODEL_PROVENANCE_FILE, (json.dumps(record(), indent=1) + "\n").encode())
            self.logger = MetricsLogger(self.run_dir, trackers=self.cfg.metrics.trackers, run_name=self.cfg.run.name)
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

    def close(self) -> None:
        """Release the run directory's lock (:meth:`train` does at its end; a later :meth:`train` takes it again)."""
        if self.run_lock is not None:
            self.run_lock.release()


def _model_source(path: str) -> Path | None:
    """The local directory (or file) holding the base weights, or None for a hub id."""
    local = Path(resolve_demo_path(path))
    return local if local.exists() else None
