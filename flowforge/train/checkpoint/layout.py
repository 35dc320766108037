"""The checkpoint directory's names and the :class:`Checkpoint` record, shared by the writer (this package's
``__init__``) and the reader (:mod:`.read`); see the package docstring for the layout and write order."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from flowforge.runtime.durable import step_dirs
from flowforge.runtime.run_dir import CHECKPOINTS_DIR

SUPERSEDED = "SUPERSEDED"
REMOVING = "REMOVING"  # a checkpoint directory being deleted (COMMITTED renamed); removed last
LATEST = "latest"
WEIGHTS_DIR = "weights"
RNG_DIR = "rng"
OPTIMIZER_FILE = "optimizer.pt"
TRAINER_STATE_FILE = "trainer_state.json"
SHARDED_DIR = "dcp"  # torch.distributed.checkpoint shards of sharded (FSDP) state, written by every rank
FORMAT_VERSION = 1

_GROUP_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
# every file a checkpoint directory may hold (relative path); anything else makes it not flowforge's to delete
_LAYOUT = re.compile(r"weights/[A-Za-z0-9_][A-Za-z0-9_.-]*\.safetensors|optimizer\.pt|rng/rank_\d+\.(json|safetensors)"
                     r"|trainer_state\.json|dcp/.+|COMMITTED|SUPERSEDED|REMOVING")


@dataclass(frozen=True)
class Checkpoint:
    """One loaded checkpoint (all tensors on CPU)."""

    path: Path
    step: int
    tensors: dict[str, dict[str, Tensor]]  # group -> name -> tensor
    optimizer_state: dict | None
    trainer_state: dict
    rng: dict | None  # this rank's :func:`capture_rng` dict; None if the checkpoint has no state for this rank


def _step_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    return step_dirs(Path(run_dir) / CHECKPOINTS_DIR)


def _rng_files(rank: int) -> tuple[str, str]:
    return f"{RNG_DIR}/rank_{rank}.json", f"{RNG_DIR}/rank_{rank}.safetensors"


def _rel(run_dir: Path, p: Path) -> str:
    try:
        return p.relative_to(run_dir).as_posix()
    except ValueError:
        return str(p)
