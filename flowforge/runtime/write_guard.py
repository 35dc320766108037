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
a ``protected`` path given by the command (the base     writing there would replace the command's own input or the
model, the command's inputs; equal to it, inside it,    model it reads
or — for a directory that is replaced as a whole —
containing it)
======================================================  ==============================================================

unless the target lies inside ``own``, the command's own output area (the trainer's run directory for the trainer,
``report.html`` of the run ``flowforge report`` reads), where the first two rows do not apply.

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


def real(path: str | Path) -> Path:
    """``path`` with symlinks followed and ``..`` folded (the existing prefix resolved, the rest appended)."""
    return Path(os.path.realpath(path))


def is_run_dir(path: Path) -> bool:
    """True when ``path`` looks like a flowforge run directory: ``config.yaml`` plus ``checkpoints/`` or
    ``metrics.jsonl``."""
    return all((path / f).is_file() for f in RUN_DIR_FILES) and any((path / c).exists() for c in RUN_DIR_CONTENT)


def enclosing(path: str | Path) -> tuple[str, Path] | None:
    """``("run directory" | "checkpoint", dir)`` for the nearest directory at or above the resolved ``path`` that is
    a run directory or a committed checkpoint; None when there is none."""
    resolved = real(path)
    for ancestor in (resolved, *resolved.parents):
        if (ancestor / CHECKPOINT_MARKER).is_file():
            return "checkpoint", ancestor
        if is_run_dir(ancestor):
            return "run directory", ancestor
    return None


def check_write_target(target: str | Path, what: str, *, protected: Mapping[str, str | Path | None] = (),
                       own: str | Path | None = None, replaces_tree: bool = False) -> Path:
    """Refuse writing ``target`` when the module's rule forbids it; returns the resolved target.

    Args:
        target: the file or directory about to be written (it need not exist).
        what: how the user named it, for the message (``"--out"``, ``"--out-dir"``, ``"export directory OUT"``).
        protected: label -> path (file or directory; None entries skipped) the target may not be or lie inside
            (``{"input": in_file, "base model": base_dir}``).
        own: the command's own output area; a target inside it may lie in a run directory or checkpoint.
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
    if own is not None and resolved.is_relative_to(real(own)):
        return resolved
    found = enclosing(resolved)
    if found is not None:
        kind, where = found
        raise UserError(label, f"{'is' if where == resolved else 'lies inside'} the {kind} {where}"
                        + ("" if resolved == Path(target).absolute() else f" (resolves to {resolved})"),
                        f"{fix}; flowforge never writes into a run or a checkpoint it is not producing")
    return resolved
