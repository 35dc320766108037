"""Crash-safe files shared by checkpoints, trajectory sidecars, sample grids and reports.

Atomic write
------------
:func:`atomic_write` runs ``write(tmp)`` on a temporary sibling ``.<name>.tmp-<pid>``, fsyncs it, renames it onto
the final name with ``os.replace`` and fsyncs the directory. Readers never see a partial file under its final name;
a crash leaves at most a stray temporary (recognised by :func:`is_tmp`).

Marked step directories
-----------------------
Checkpoints (``checkpoints/step_000040/`` + ``COMMITTED``) and sidecars (``step_000041/`` + ``DONE``) are step
directories named by :func:`step_dir_name` and trusted only while they hold their marker file, which is written
last. :func:`remove_marked_dir` deletes one by removing the marker first, so a crash mid-delete leaves an untrusted
directory, never a half-deleted trusted one.

Test hook
---------
``hook(stage, relpath)`` (an argument of :func:`atomic_write`) is called with ``stage`` ``"tmp"`` once the temporary
is complete and ``"renamed"`` once it is in place; tests use it to SIGKILL a writer at a known point.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

from flowforge.runtime.errors import UserError

StageHook = Callable[[str, str], None]
"""``hook(stage, relpath)``: ``stage`` is ``"tmp"`` or ``"renamed"``; ``relpath`` names the file for the caller."""

_STEP_RE = re.compile(r"^step_(\d{6,})$")


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
    """The temporary sibling :func:`atomic_write` writes first: ``.<name>.tmp-<pid>``."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def is_tmp(name: str) -> bool:
    """Whether a file name is a temporary of :func:`atomic_write`."""
    return name.startswith(".") and ".tmp-" in name


def atomic_write(path: Path, write: Callable[[Path], None], hook: StageHook | None = None,
                 relpath: str | None = None) -> None:
    """``write(tmp)`` → fsync tmp → ``os.replace`` onto ``path`` → fsync the directory.

    Args:
        path: the final file name.
        write: writes the whole file to the path it is given (the temporary).
        hook: optional ``hook(stage, relpath)`` (see the module docstring).
        relpath: the name passed to ``hook``; ``path.name`` when None.

    The temporary is removed if ``write`` raises; the exception propagates, except that an ``OSError`` of the
    write itself (a full disk, a quota, an I/O error) becomes a :class:`UserError` naming ``path`` and the OS's
    words (``No space left on device``): nothing is left under ``path``, and a checkpoint being written is not
    committed (its marker comes last).

    Raises:
        UserError: writing the temporary failed with an ``OSError`` (``errno`` set).
    """
    tmp = tmp_name(path)
    try:
        write(tmp)
        fsync_path(tmp)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno is None:
            raise
        raise UserError(path, f"could not be written ({exc.strerror or os.strerror(exc.errno)}); nothing was "
                        "left under this name", "free space (or fix the disk) and run again; a training run "
                        "resumes from its last committed checkpoint with train.resume=auto") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    label = path.name if relpath is None else relpath
    if hook is not None:
        hook("tmp", label)
    os.replace(tmp, path)
    fsync_path(path.parent)
    if hook is not None:
        hook("renamed", label)


def torch_save(obj: object, path: Path) -> None:
    """``torch.save(obj)`` into ``path`` through a file object opened here (the ``write`` of :func:`atomic_write`
    for torch files): a failed write (a full disk) then raises the ``OSError`` itself (``No space left on
    device``), which :func:`atomic_write` reports naming the file. Given a path, torch's own C++ writer raises
    ``RuntimeError: [enforce fail at inline_container.cc:...] . unexpected pos ...`` instead, which says neither."""
    import torch

    with open(path, "wb") as handle:
        torch.save(obj, handle)


def write_bytes(path: Path, data: bytes, hook: StageHook | None = None, relpath: str | None = None) -> None:
    """:func:`atomic_write` of ``data``."""
    atomic_write(path, lambda tmp: tmp.write_bytes(data), hook, relpath)


# ------------------------------------------------------------------------------------------------ step directories
def step_dir_name(step: int) -> str:
    """``step_000040``: the directory (or file stem) of training step ``step`` (at least six digits)."""
    return f"step_{step:06d}"


def step_of(path: Path) -> int | None:
    """The step of a :func:`step_dir_name` path, or None for any other name."""
    m = _STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step_*`` directory directly under ``root``, by step (empty if ``root`` is
    missing). Markers are not checked: callers filter by theirs."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((s, p) for p in root.iterdir() if p.is_dir() and (s := step_of(p)) is not None)


def demote(directory: Path, marker: str, rename_to: str | None = None) -> None:
    """Make a marked directory untrusted, durably: unlink (or rename to ``rename_to``) its ``marker`` file and
    fsync the directory. A no-op when the marker is absent."""
    path = directory / marker
    if path.exists():
        if rename_to is None:
            path.unlink()
        else:
            os.replace(path, directory / rename_to)
        fsync_path(directory)


def remove_marked_dir(directory: Path, marker: str, *, pending: str | None = None,
                      hook: Callable[[str, str], None] | None = None) -> None:
    """Delete a marked directory: :func:`demote` it first, then remove the tree and fsync the parent.

    With ``pending`` the marker is renamed to that name instead of unlinked (created when the marker is absent) and
    removed last, after everything else: a crash at any point leaves a directory that still says it was being
    removed, so the next run can prove it is its own and finish (:func:`flowforge.train.checkpoint.finish_removals`).
    ``hook("demoted", directory.name)`` is called once the directory is demoted (tests stop there).
    """
    directory = Path(directory)
    if pending is not None and not (directory / marker).exists() and not (directory / pending).exists():
        (directory / pending).touch()
        fsync_path(directory)
    demote(directory, marker, rename_to=pending)
    if hook is not None:
        hook("demoted", directory.name)
    if pending is None:
        shutil.rmtree(directory)
    else:
        for p in directory.iterdir():
            if p.name == pending:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        fsync_path(directory)
        (directory / pending).unlink()
        directory.rmdir()
    fsync_path(directory.parent)


# ------------------------------------------------------------------------------------------------ ownership
def sha256_file(path: Path) -> str:
    """sha256 hex digest of a file's bytes (equals ``sha256sum``), streamed in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def only_layout_files(directory: Path, layout: re.Pattern) -> bool:
    """Whether every file below ``directory`` (relative POSIX path, temporaries of :func:`atomic_write` with their
    ``.<name>.tmp-<pid>`` prefix/suffix removed) fully matches ``layout``; symlinks and other non-files count as
    foreign. An empty directory is flowforge's (a save that crashed right after ``mkdir``)."""
    for p in Path(directory).rglob("*"):
        if p.is_symlink() or not (p.is_file() or p.is_dir()):
            return False
        if p.is_dir():
            continue
        rel = p.relative_to(directory).as_posix()
        head, _, name = rel.rpartition("/")
        if is_tmp(name):
            name = name[1:name.rindex(".tmp-")]
            rel = f"{head}/{name}" if head else name
        if not layout.fullmatch(rel):
            return False
    return True


def refuse_escaping_symlink(path: Path, root: Path) -> None:
    """Refuse to write ``path`` (a file of the run directory ``root``) when it is a symlink that resolves outside
    ``root``: writing through it would overwrite or append to a file elsewhere.

    Raises:
        UserError: naming the link and its target.
    """
    path = Path(path)
    if path.is_symlink():
        target = path.resolve()
        if not target.is_relative_to(Path(root).resolve()):
            raise UserError(path, f"is a symlink to {target}, outside the run directory {root}",
                            "remove the link (flowforge never writes a run's files through a link leading out of it)")


# ------------------------------------------------------------------------------------------------ file sets
INCOMPLETE_PREFIX = ".flowforge-incomplete"
"""File sets in flight: ``<dir>/.flowforge-incomplete-<tag>.json`` lists the files a :func:`write_file_set` is
replacing; it exists only between the first and the last rename, so while it is there the set is mixed."""


def incomplete_set(path: Path) -> Path | None:
    """The in-flight marker of an interrupted :func:`write_file_set` that lists ``path`` (a file name in its
    directory), or None when ``path`` is not part of an incomplete set."""
    path = Path(path)
    if not path.parent.is_dir():
        return None
    for marker in sorted(path.parent.glob(f"{INCOMPLETE_PREFIX}*.json")):
        try:
            names = json.loads(marker.read_text(encoding="utf-8")).get("files", [])
        except (OSError, ValueError, AttributeError):
            return marker  # unreadable: treat every file of the directory as suspect
        if path.name in names:
            return marker
    return None


def write_file_set(directory: Path, files: dict[str, bytes], tag: str, hook: StageHook | None = None) -> None:
    """Replace several files of ``directory`` as one set: every file is written and fsynced as a temporary first
    (a crash then leaves the old set whole), then the in-flight marker ``.flowforge-incomplete-<tag>.json`` is
    written, the temporaries are renamed onto their names in order, and the marker is removed last. A crash during
    the renames leaves the marker, which :func:`incomplete_set` reports to readers, until a rerun completes.

    Temporaries are created with ``O_EXCL | O_NOFOLLOW`` (a planted link is never written through) and ``os.replace``
    swaps names, never following a link at the final name. ``hook(stage, name)`` is called with ``"tmp"`` once all
    temporaries are complete and ``"renamed"`` after each rename (tests kill the writer there). Temporaries of these
    names that a killed writer left are removed first.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name in files:  # temporaries a killed writer left (any pid): named by this set, never a user's file
        for stray in directory.glob(f".{glob.escape(name)}.tmp-*"):
            if stray.is_file() or stray.is_symlink():
                stray.unlink()
    temps = {}
    try:
        for name, data in files.items():
            tmp = tmp_name(directory / name)
            tmp.unlink(missing_ok=True)  # a stray temporary of an earlier crash (or a planted link) is not used
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
            temps[name] = tmp
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
    except BaseException:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
        raise
    if hook is not None:
        hook("tmp", "")
    marker = directory / f"{INCOMPLETE_PREFIX}-{tag}.json"
    write_bytes(marker, json.dumps({"files": list(files), "note": "an interrupted write; rerun it"}).encode())
    for name, tmp in temps.items():
        os.replace(tmp, directory / name)
        if hook is not None:
            hook("renamed", name)
    fsync_path(directory)
    marker.unlink()
    fsync_path(directory)
