"""The export directory ``OUT``: where an export may be written, and how it replaces a previous export without
touching anything else.

An export never destroys data. Before anything is read or written (all paths compared as realpaths):

======================================================  ==============================================================
``OUT`` ...                                             outcome
======================================================  ==============================================================
is, contains or lies inside the run directory, the      refused (:class:`ExportError` naming both paths)
checkpoint or the base model directory
is or lies inside any run directory (``config.yaml``    refused
plus ``checkpoints/`` or ``metrics.jsonl``)
is the current working directory or contains it         refused
is a file or a symbolic link                            refused
does not exist, or is an empty directory                written
holds a previous export (the ownership marker           replaced with ``overwrite=True`` (``--overwrite``), refused
``flowforge_export.json`` listing its ``files``) and    without it
nothing else
holds anything else (no marker, a marker without a      refused, with or without ``overwrite``
file list, or any entry the marker does not list)
======================================================  ==============================================================

The export is assembled in a hidden sibling directory (:func:`work_dir`) and moved into place by
:func:`install` only when complete, so a failed export leaves ``OUT`` as it was. Replacing a previous export moves
it aside, moves the new one in, then deletes only the files the old marker listed (and directories left empty).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from flowforge.runtime.errors import UserError
from flowforge.runtime.write_guard import check_write_target, real

log = logging.getLogger("flowforge")

EXPORT_META = "flowforge_export.json"
"""The ownership marker (and metadata) every export writes; its ``files`` list names every file of the export."""


class ExportError(UserError):
    """The run cannot be exported as asked (missing base, wrong form, an unsafe or occupied ``OUT``, a damaged or
    foreign checkpoint, ...). A ``ValueError``; printed as ``<what>: <why>; <fix>``."""


def _real(path: Path) -> Path:
    return real(path)


def _refuse(out: Path, why: str) -> ExportError:
    return ExportError(f"export directory {out}", why, "choose a new directory outside it (e.g. exports/<name>)")


def check_out(out: Path, protected: dict[str, Path], overwrite: bool) -> list[str] | None:
    """Check that exporting into ``out`` destroys nothing (module table): :func:`check_location`, then what
    ``out`` holds.

    Args:
        out: the export directory as given.
        protected: label -> directory that ``out`` must not be, contain, or lie inside (``"run directory"``,
            ``"checkpoint"``, ``"base model directory"``).
        overwrite: whether a previous export in ``out`` may be replaced.

    Returns:
        The previous export's file list (relative POSIX paths) when ``out`` holds one to replace, else ``None``.

    Raises:
        ExportError: a rule is broken; the message names ``out`` and the reason.
    """
    check_location(out, protected)
    if not out.exists():
        return None
    if not out.is_dir():
        raise _refuse(out, "is a file")
    if not any(out.iterdir()):
        return None
    return _previous_export(out, overwrite)


def check_location(out: Path, protected: dict[str, Path]) -> None:
    """The location rules alone (no look inside ``out``): the shared write rule
    (:func:`flowforge.runtime.write_guard.check_write_target`: not a protected directory, around or inside one, not
    inside any run directory or checkpoint), then not the working directory or around it, not a symbolic link."""
    try:
        resolved = check_write_target(out, "export directory", protected=protected, replaces_tree=True)
    except ExportError:
        raise
    except UserError as exc:
        raise ExportError(exc.what, exc.why, "choose a new directory outside it (e.g. exports/<name>)") from None
    cwd = _real(Path.cwd())
    if cwd.is_relative_to(resolved):
        raise _refuse(out, "is the current working directory" if cwd == resolved else
                      f"contains the current working directory {cwd}")
    if out.is_symlink():
        raise _refuse(out, f"is a symbolic link (to {resolved})")


def _previous_export(out: Path, overwrite: bool) -> list[str]:
    """The file list of the previous export in the non-empty directory ``out``, when it holds that and nothing
    else and ``overwrite`` is set."""
    marker = out / EXPORT_META
    what = f"export directory {out}"
    if not marker.is_file():
        raise ExportError(what, f"is not empty and holds no {EXPORT_META} (it is not a flowforge export)",
                          "choose a new or empty directory; --overwrite only replaces a previous export")
    try:
        files = json.loads(marker.read_text()).get("files")
    except (OSError, ValueError, AttributeError) as exc:
        raise ExportError(marker, f"cannot be read as an export marker ({type(exc).__name__})",
                          "remove the directory yourself or choose a new one") from exc
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise ExportError(marker, "lists no 'files' (written by an older flowforge), so it is unknown which "
                          "files the export owns", "remove the directory yourself or choose a new one")
    outside = [f for f in files if Path(f).is_absolute() or ".." in Path(f).parts or not f]
    if outside:  # deleting them would reach outside OUT: the marker was not written by an export
        raise ExportError(marker, f"lists {outside[0]!r}, a path outside the export directory",
                          "remove the directory yourself or choose a new one")
    foreign = _foreign_entry(out, set(files) | {EXPORT_META})
    if foreign is not None:
        raise ExportError(what, f"holds {foreign!r}, which the previous export did not write",
                          "move it away or choose a new directory; --overwrite only replaces an export's own files")
    if not overwrite:
        raise ExportError(what, "exists and is not empty (it holds a previous export)",
                          "choose a new directory or pass --overwrite to replace that export")
    return sorted(set(files) | {EXPORT_META})


def _foreign_entry(root: Path, owned: set[str]) -> str | None:
    """The first entry under ``root`` (relative POSIX path) that is neither an owned file nor a directory holding
    one; symbolic links count as files and are never followed."""
    owned_dirs = {parent.as_posix() for f in owned for parent in Path(f).parents if parent != Path(".")}
    for top, dirs, files in os.walk(root):
        rel_top = Path(top).relative_to(root)
        for name in sorted(dirs):
            rel = (rel_top / name).as_posix()
            if (Path(top) / name).is_symlink() and rel in owned:
                continue
            if rel not in owned_dirs:
                return rel + ("" if (Path(top) / name).is_symlink() else "/")
        for name in sorted(files):
            rel = (rel_top / name).as_posix()
            if rel not in owned:
                return rel
    return None


def listed_files(directory: Path) -> list[str]:
    """Every file under ``directory`` as sorted relative POSIX paths (the marker's ``files`` list)."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if not p.is_dir())


def work_dir(out: Path) -> Path:
    """A fresh hidden sibling of ``out`` to assemble the export in (created; a stale one of this process is
    removed)."""
    import shutil

    work = out.parent / f".{out.name}.export-{os.getpid()}"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    return work


def install(work: Path, out: Path, previous: list[str] | None) -> None:
    """Move the complete export ``work`` to ``out``; a previous export there (its file list ``previous``) is moved
    aside first and then only its listed files and the directories they leave empty are deleted."""
    if previous is None:
        if out.is_dir():
            out.rmdir()  # empty (checked): fails rather than replace anything that appeared meanwhile
        os.replace(work, out)
        return
    old = out.parent / f".{out.name}.replaced-{os.getpid()}"
    os.replace(out, old)
    try:
        os.replace(work, out)
    except OSError:
        os.replace(old, out)
        raise
    for rel in previous:
        (old / rel).unlink(missing_ok=True)
    for directory in sorted((p for p in old.rglob("*") if p.is_dir() and not p.is_symlink()),
                            key=lambda p: len(p.parts), reverse=True):
        if not any(directory.iterdir()):
            directory.rmdir()
    if any(old.iterdir()):
        log.warning("export: %s kept files the previous export did not list; they are in %s", out, old)
    else:
        old.rmdir()
