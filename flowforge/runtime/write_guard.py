"""One rule for every command that writes: where its output may go.

The rule
--------
A target path (a file or a directory a command is about to write: ``sample --out``, ``data curate --out-dir``,
``data prepare --output``, ``export OUT``, a run directory, the pipeline directory of ``flowforge stages``, a judge
server's ``--request-log``) is resolved first — symlinks followed, ``..`` folded (``os.path.realpath``, which also
resolves the existing part of a path that does not exist yet) — and then refused, in one line and before anything
is written, when it

======================================================  ==============================================================
lies inside ...                                         because
======================================================  ==============================================================
a run directory (``config.yaml`` plus ``checkpoints/``  the run's grids, logs and checkpoints are the trainer's; a
or ``metrics.jsonl``)                                   write there replaces or adds files it did not create
a checkpoint (a directory holding ``COMMITTED``)        a committed checkpoint is immutable (rotation and re-save
                                                        refuse foreign files)
a pipeline directory (``pipeline.json``, or the         its condition ledger, request logs, judge ledgers, students
``conditions.jsonl`` + ``judge.token`` of one made      and stage runs are the pipeline's state: a foreign line or
before the marker existed)                              file stops or corrupts the next ``flowforge stages`` run
a ``protected`` path given by the command (the base     writing there would replace the command's own input or the
model, the command's inputs; equal to it, inside it,    model it reads
or — for a directory that is replaced as a whole —
containing it)
======================================================  ==============================================================

unless the target lies inside ``own``, the command's own output area (the trainer's run directory for the trainer,
the pipeline directory for the pipeline and the stages it trains, ``report.html`` of the run ``flowforge report``
reads), where the first three rows do not apply to ``own`` and below it; ``own`` itself is still checked against
the directories above it (a run may not be made inside another run). A judge server the pipeline starts proves it is
the pipeline's own by the pipeline's lock (:func:`flowforge.runtime.lock.held_by_parent`), so it may keep its
request log in the pipeline directory; any other ``serve judge --request-log`` there is refused.

:func:`check_write_target` is that rule; every writing command calls it with its own ``protected`` and ``own``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from flowforge.runtime.errors import UserError

RUN_DIR_FILES = ("config.yaml",)
"""A run directory holds all of these ..."""
RUN_DIR_CONTENT = ("checkpoints", "metrics.jsonl")
"""... and at least one of these."""
CHECKPOINT_MARKER = "COMMITTED"
"""The file that makes a directory a committed checkpoint (:data:`flowforge.runtime.run_dir.MARKER`)."""
PIPELINE_MARKER = "pipeline.json"
"""The file that makes a directory a pipeline directory, written by ``flowforge stages`` when it claims one."""
PIPELINE_LEGACY = ("conditions.jsonl", "judge.token")
"""A pipeline directory made before :data:`PIPELINE_MARKER` existed holds both of these."""


def real(path: str | Path) -> Path:
    """``path`` with symlinks followed and ``..`` folded (the existing prefix resolved, the rest appended)."""
    return Path(os.path.realpath(path))


def is_run_dir(path: Path) -> bool:
    """True when ``path`` looks like a flowforge run directory: ``config.yaml`` plus ``checkpoints/`` or
    ``metrics.jsonl``."""
    return all((path / f).is_file() for f in RUN_DIR_FILES) and any((path / c).exists() for c in RUN_DIR_CONTENT)


def is_pipeline_dir(path: Path) -> bool:
    """True when ``path`` is a flowforge pipeline directory: :data:`PIPELINE_MARKER`, or every file of
    :data:`PIPELINE_LEGACY`."""
    return (path / PIPELINE_MARKER).is_file() or all((path / f).is_file() for f in PIPELINE_LEGACY)


def enclosing(path: str | Path) -> tuple[str, Path] | None:
    """``("run directory" | "checkpoint" | "pipeline directory", dir)`` for the nearest directory at or above the
    resolved ``path`` that is one of them; None when there is none."""
    resolved = real(path)
    for ancestor in (resolved, *resolved.parents):
        if (ancestor / CHECKPOINT_MARKER).is_file():
            return "checkpoint", ancestor
        if is_run_dir(ancestor):
            return "run directory", ancestor
        if is_pipeline_dir(ancestor):
            return "pipeline directory", ancestor
    return None


def check_write_target(target: str | Path, what: str, *, protected: Mapping[str, str | Path | None] = (),
                       own: str | Path | None = None, replaces_tree: bool = False) -> Path:
    """Refuse writing ``target`` when the module's rule forbids it; returns the resolved target.

    Args:
        target: the file or directory about to be written (it need not exist).
        what: how the user named it, for the message (``"--out"``, ``"--out-dir"``, ``"export directory OUT"``).
        protected: label -> path (file or directory; None entries skipped) the target may not be or lie inside
            (``{"input": in_file, "base model": base_dir}``).
        own: the command's own output area; a target inside it may lie in a run, checkpoint or pipeline directory
            at or below ``own`` (``own`` itself may not lie inside one that is not its own).
        replaces_tree: ``target`` is a directory whose contents the command replaces as a whole, so it may not
            contain a protected path either.

    Raises:
        UserError: ``<what> <target>: <why>; <fix>``, naming the resolved directory that protects it.
    """
    resolved = real(target)
    label = f"{what} {target}"
    fix = "choose a path outside it"
    for name, path in (protected.items() if isinstance(protected, Mapping) else ()):
        if path is None:
            continue
        other = real(path)
        if resolved == other:
            raise UserError(label, f"is the {name} {other}" + ("" if str(other) == str(target) else
                                                              f" (resolved from {target})"), fix)
        if resolved.is_relative_to(other):
            raise UserError(label, f"lies inside the {name} {other}", fix)
        if replaces_tree and other.is_relative_to(resolved):
            raise UserError(label, f"contains the {name} {other}", fix)
    mine = real(own) if own is not None else None
    inside_own = mine is not None and resolved.is_relative_to(mine)
    found = enclosing(mine.parent if inside_own else resolved)
    if found is not None:
        kind, where = found
        said = f"{'is' if where == resolved else 'lies inside'} the {kind} {where}"
        if inside_own:
            said = f"lies inside {mine}, which lies inside the {kind} {where}"
        raise UserError(label, said + ("" if resolved == Path(target).absolute() else f" (resolves to {resolved})"),
                        f"{fix}; flowforge never writes into a run, a checkpoint or a pipeline it is not producing")
    return resolved
