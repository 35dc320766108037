"""Reading checkpoints: which one to resume (:func:`resolve_resume`), whether it is intact
(:func:`verify_checkpoint`), and loading it (:func:`load_checkpoint`); see the package docstring for the layout."""
from __future__ import annotations

import json
import logging
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from flowforge.runtime.durable import sha256_file, step_of
from flowforge.runtime.errors import UserError, file_error
from flowforge.runtime.run_dir import (CHECKPOINTS_DIR, MARKER, committed_checkpoints, is_committed, last_logged_step,
                                       saved_setting)
from flowforge.train.checkpoint.layout import (FORMAT_VERSION, OPTIMIZER_FILE, SUPERSEDED, TRAINER_STATE_FILE,
                                               WEIGHTS_DIR, Checkpoint, _rel, _rng_files, _step_dirs)

log = logging.getLogger("flowforge")

def lost_progress(run_dir: str | Path) -> str | None:
    """What happened to a run directory that holds no committed checkpoint, for a user about to resume or export it:
    e.g. ``"the run was interrupted at step 5 of 20 before any checkpoint (checkpoint.every=0)"``, read from its
    ``metrics.jsonl`` (the last logged step) and ``config.yaml`` (``train.steps``, ``checkpoint.every``). ``None``
    when the directory has a committed checkpoint or logged no step. Never raises: an unreadable file gives ``?``."""
    run_dir = Path(run_dir)
    if committed_checkpoints(run_dir):
        return None
    done = last_logged_step(run_dir)
    if done is None:
        return None
    total, every = (saved_setting(run_dir, *key) for key in (("train", "steps"), ("checkpoint", "every")))
    total, every = ("?" if v is None else v for v in (total, every))
    return f"the run was interrupted at step {done} of {total} before any checkpoint (checkpoint.every={every})"


NO_CHECKPOINT_FIX = ("its training cannot be recovered; rerun it with checkpoint.every > 0 (every N steps and at the "
                     "end, checkpoint.keep bounds the disk) and --overwrite, or under another run.name")
RESTART_FIX = ("train.resume=auto starts it again from step 0 (it was killed before its first checkpoint was "
               "committed) and replaces the rows it logged")
RESUME_NEWEST = ("auto", "must")
"""``train.resume`` values that pick the newest committed checkpoint (``must``: refused when there is none)."""


def no_checkpoint_fix(run_dir: str | Path) -> str:
    """What to do about a run directory without a committed checkpoint (:func:`lost_progress`): with
    ``checkpoint.every > 0`` in its ``config.yaml`` a restart from step 0 (:data:`RESTART_FIX`), else
    :data:`NO_CHECKPOINT_FIX`."""
    every = saved_setting(run_dir, "checkpoint", "every")
    return RESTART_FIX if isinstance(every, int) and every > 0 else NO_CHECKPOINT_FIX


def no_checkpoints_note(run_dir: Path) -> str:
    """The note of :func:`resolve_resume` (``"auto"``) for a run directory that never held a checkpoint: a fact, not
    a problem (every fresh run and pipeline stage started with ``resume=auto`` gets it)."""
    return f"no checkpoints under {run_dir / CHECKPOINTS_DIR}: starting from step 0"


def resolve_resume(run_dir: str | Path, resume: str | None) -> tuple[Path | None, list[str]]:
    """Which checkpoint to resume from, and notes for the log.

    ``None`` → ``(None, [])``. ``"auto"`` → the newest committed checkpoint of ``run_dir`` (uncommitted or
    superseded newer directories are skipped and named in the notes), or ``(None, notes)`` if there is none. Any other
    string is a checkpoint directory path, returned as given.

    Every file's size and sha256 are checked against the manifest (:func:`verify_checkpoint`): ``"auto"`` skips a
    damaged checkpoint (named with its file in the notes) for the previous committed one.

    Raises:
        ValueError: an explicit path does not exist or has no ``COMMITTED`` marker.
        UserError: an explicit path holds a file that differs from its manifest.
    """
    if resume is None:
        return None, []
    run_dir = Path(run_dir)
    committed = committed_checkpoints(run_dir)
    newest = committed[-1] if committed else None
    if resume in RESUME_NEWEST:
        notes = []
        while committed:
            try:
                verify_checkpoint(committed[-1])
                break
            except UserError as e:
                damaged = committed.pop()
                notes.append(f"{e}; falling back to "
                             f"{committed[-1].name if committed else 'step 0 (no other committed checkpoint)'}")
                log.warning("resume=auto: %s is damaged, not used: %s", damaged, e)
        newest = committed[-1] if committed else None
        chosen = f"resuming from {newest.name}" if newest else "no committed checkpoint: starting from step 0"
        newest_step = step_of(newest) if newest else -1
        for s, p in _step_dirs(run_dir):
            if s <= newest_step or is_committed(p):
                continue
            why = ("was superseded (left by a run that later resumed from an earlier checkpoint)"
                   if (p / SUPERSEDED).exists() else f"has no {MARKER} marker (incomplete write)")
            notes.append(f"{_rel(run_dir, p)} {why}; {chosen}")
        lost = lost_progress(run_dir) if newest is None else None
        if lost:
            fix = no_checkpoint_fix(run_dir)
            notes.append(f"{lost}: nothing to resume, starting from step 0" + (
                " (its logged rows are replaced)" if fix == RESTART_FIX else f"; {fix}"))
        elif newest is None and not notes:
            notes.append(no_checkpoints_note(run_dir))
        return newest, notes
    path = Path(resume).expanduser()
    fallback = (f"resume=auto would fall back to {newest}" if newest
                else f"resume=auto would find no committed checkpoint in {run_dir} and start from step 0")
    if not path.exists():
        raise ValueError(f"resume={resume!r}: {path} does not exist; {fallback}")
    if not is_committed(path):
        why = ("it was superseded by a later save of a run that resumed from an earlier checkpoint"
               if (path / SUPERSEDED).exists() else "incomplete or interrupted write, or not a checkpoint directory")
        raise ValueError(f"resume={resume!r}: {path} has no {MARKER} marker ({why}); refusing to resume from it. "
                         f"{fallback}")
    verify_checkpoint(path, f"restore it, or resume another checkpoint ({fallback})")
    return path, []


def verify_checkpoint(path: str | Path, fix: str = "restore it, or resume from another checkpoint") -> dict:
    """Check every file a committed checkpoint's manifest lists: present, its size, and its sha256 (when the
    manifest records checksums). Returns the manifest.

    Raises:
        UserError: the manifest is unreadable or of another format, or a file is missing, has another size or
            another sha256 — naming the first such file.
    """
    path = Path(path)
    try:
        manifest = json.loads((path / MARKER).read_text())
        files: dict[str, int] = manifest["files"]
        int(manifest["step"]), list(manifest["groups"])
        if not isinstance(files, dict) or not set(manifest.get("sha256") or {}) <= set(files):
            raise ValueError("'files' must map every file (including those with a sha256) to its size")
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise UserError(path / MARKER, f"is not a valid checkpoint manifest ({e!r})", fix) from e
    if manifest.get("format") != FORMAT_VERSION:
        raise UserError(path, f"checkpoint format {manifest.get('format')!r}, this flowforge reads {FORMAT_VERSION}",
                        fix)
    problems = []
    for rel, size in files.items():
        f = path / rel
        if not f.is_file():
            problems.append(f"{rel} is missing")
        elif f.stat().st_size != size:
            problems.append(f"{rel} has {f.stat().st_size} bytes, the manifest says {size}")
    if problems:
        raise UserError(path, "is committed but damaged: " + "; ".join(problems), fix)
    for rel, expected in sorted((manifest.get("sha256") or {}).items()):
        if sha256_file(path / rel) != expected:
            raise UserError(path / rel, f"sha256 differs from the checkpoint manifest's {str(expected)[:12]}… (the "
                            "file changed after it was written)", fix)
    return manifest


def _read(f: Path, read: Callable[[Path], Any], fix: str) -> Any:
    """``read(f)``, with a damaged file (its checksum may agree when the manifest predates the damage) raising
    :class:`UserError` that names ``f`` instead of the reader's bare message (``legacy .tar format``, a JSON
    position, a safetensors header error)."""
    try:
        if f.suffix == ".pt" and not zipfile.is_zipfile(f):  # torch.save writes a zip archive
            raise ValueError("is not a torch.save archive (zeroed, truncated or overwritten)")
        return read(f)
    except (OSError, ValueError, RuntimeError, EOFError, KeyError, SafetensorError) as e:
        raise file_error(f, e, fix) from e


def load_checkpoint(path: str | Path, *, rank: int = 0,
                    fix: str = "restore it, or resume from another checkpoint") -> Checkpoint:
    """Load a committed checkpoint (tensors on CPU; the optimizer state with ``weights_only=True``).

    ``rng`` is this ``rank``'s saved state, or ``None`` when the checkpoint was written by fewer ranks.

    Raises:
        ValueError: not committed; (:class:`UserError`, ending in ``fix``) the manifest is unreadable, a listed
            file is missing or has the wrong size or sha256 (:func:`verify_checkpoint`), or a file cannot be read
            (naming it).
    """
    path = Path(path)
    if not is_committed(path):
        raise ValueError(f"{path} has no {MARKER} marker (incomplete or interrupted write); refusing to load it")
    manifest = verify_checkpoint(path, fix)
    files: dict[str, int] = manifest["files"]
    step, groups = int(manifest["step"]), list(manifest["groups"])
    tensors = {g: _read(path / WEIGHTS_DIR / f"{g}.safetensors", lambda f: load_file(str(f), device="cpu"), fix)
               for g in groups}
    optimizer_state = None
    if OPTIMIZER_FILE in files:
        optimizer_state = _read(path / OPTIMIZER_FILE,
                                lambda f: torch.load(f, map_location="cpu", weights_only=True), fix)
    trainer_state = _read(path / TRAINER_STATE_FILE, lambda f: json.loads(f.read_text()), fix)
    return Checkpoint(path=path, step=step, tensors=tensors, optimizer_state=optimizer_state,
                      trainer_state=trainer_state, rng=_read_rng(path, rank, fix))


def _read_rng(step_dir: Path, rank: int, fix: str) -> dict | None:
    json_rel, st_rel = _rng_files(rank)
    if not (step_dir / json_rel).is_file() or not (step_dir / st_rel).is_file():
        return None
    state = _read(step_dir / json_rel, lambda f: json.loads(f.read_text()), fix)
    tensors = _read(step_dir / st_rel, lambda f: load_file(str(f), device="cpu"), fix)
    n_cuda = sum(1 for k in tensors if k.startswith("cuda_"))
    return {"python": state["python"], "numpy": state["numpy"], "torch": tensors["torch"],
            "cuda": [tensors[f"cuda_{i}"] for i in range(n_cuda)]}
