"""The checkpoint format: durable files, a crash at any instant never leaves a checkpoint that resume trusts.

Saving, committing and rotating live in :mod:`.save` (its docstring describes the layout and the write order),
resolving and reading in :mod:`.read`, the names of the layout in :mod:`.layout`; what goes into the files is decided
by :class:`flowforge.train.checkpoint.manager.CheckpointManager`. This module re-exports their API
(``from flowforge.train import checkpoint``). The test-only save hook is ``flowforge.train.checkpoint.save._test_hook``.
"""

from __future__ import annotations

from flowforge.runtime.durable import sha256_file, step_dir_name, step_of
from flowforge.runtime.errors import UserError
from flowforge.runtime.run_dir import CHECKPOINTS_DIR, MARKER, committed_checkpoints, is_committed
from flowforge.train.checkpoint.layout import (FORMAT_VERSION, LATEST, OPTIMIZER_FILE, REMOVING, RNG_DIR, SHARDED_DIR,
                                               SUPERSEDED, TRAINER_STATE_FILE, WEIGHTS_DIR, Checkpoint)
from flowforge.train.checkpoint.read import (NO_CHECKPOINT_FIX, RESUME_NEWEST, load_checkpoint, lost_progress,
                                             no_checkpoint_fix, no_checkpoints_note, resolve_resume, verify_checkpoint)
from flowforge.train.checkpoint.save import finish_removals, save_checkpoint

__all__ = ["CHECKPOINTS_DIR", "Checkpoint", "FORMAT_VERSION", "LATEST", "MARKER", "NO_CHECKPOINT_FIX",
           "OPTIMIZER_FILE", "REMOVING", "RESUME_NEWEST", "RNG_DIR", "SHARDED_DIR", "SUPERSEDED",
           "TRAINER_STATE_FILE", "UserError", "WEIGHTS_DIR", "committed_checkpoints", "finish_removals",
           "is_committed", "load_checkpoint", "lost_progress", "no_checkpoint_fix", "no_checkpoints_note",
           "resolve_resume", "save_checkpoint", "sha256_file", "step_dir_name", "step_of", "verify_checkpoint"]
