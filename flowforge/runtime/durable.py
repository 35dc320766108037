"""Crash-safe file writes shared by checkpoints, sidecars and sample grids.

``atomic_write(path, write)``: ``write(tmp)`` on a temporary sibling, fsync it, ``os.replace`` it onto ``path``,
fsync the directory. Readers never see a partial file under its final name; a crash leaves at most a stray
temporary (named ``.<name>.tmp-<pid>``, recognised by :func:`is_tmp`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (directories cannot be opened for fsync on Windows: skipped there)."""
    if os.name == "nt" and path.is_dir():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def is_tmp(name: str) -> bool:
    """Whether a file name is a temporary of :func:`atomic_write`."""
    return name.startswith(".") and ".tmp-" in name


def atomic_write(path: Path, write: Callable[[Path], None],
                 on_stage: Callable[[str], None] | None = None) -> None:
    """``write(tmp)`` → fsync tmp → ``os.replace`` onto ``path`` → fsync the directory.

    ``on_stage("tmp")`` runs once the temporary is complete and ``on_stage("renamed")`` once it is in place (tests use
    it to kill a writer at a known point). The temporary is removed if ``write`` raises.
    """
    tmp = tmp_name(path)
    try:
        write(tmp)
        fsync_path(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if on_stage is not None:
        on_stage("tmp")
    os.replace(tmp, path)
    fsync_path(path.parent)
    if on_stage is not None:
        on_stage("renamed")
