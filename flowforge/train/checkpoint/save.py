"""Saving a checkpoint: durable files, a crash at any instant never leaves a checkpoint that resume trusts.

The file layer of :mod:`flowforge.train.checkpoint`: writing, committing and rotating here, resolving and reading
in :mod:`.read`, the names of the layout in :mod:`.layout`. What goes into the files (the policy bank, the prompt
sampler, the trainer's record) is decided by :class:`flowforge.train.checkpoint.manager.CheckpointManager`.

What and why
------------
A training run is resumed from a checkpoint directory only if it carries a ``COMMITTED`` marker, and the marker is
the last thing written: every other file is written to a temporary name, fsynced, renamed into place, and its
directory fsynced first. A process killed (SIGKILL, power loss, OOM) at any point therefore leaves either a complete,
committed checkpoint or a directory without the marker, which :func:`resolve_resume` skips (``"auto"``) or refuses
(an explicit path). Nothing is unpickled: tensors are safetensors, RNG states are safetensors + JSON, and the
optimizer state is loaded with ``torch.load(..., weights_only=True)``.

Layout::

    <run_dir>/checkpoints/
      latest                          "step_000040\\n" — the last committed save (informational; see below)
      step_000040/
        weights/<group>.safetensors   one file per tensor group the caller passes ("live", "old", "ema", ...)
        optimizer.pt                  the optimizer state dict (torch.save; loaded weights_only) — if given
        dcp/                          torch.distributed.checkpoint shards (sharded FSDP state; every rank writes)
        rng/rank_<r>.json             python ``random`` + numpy global RNG state of rank r
        rng/rank_<r>.safetensors      torch CPU RNG state (+ ``cuda_<i>`` per visible CUDA device) of rank r
        trainer_state.json            the caller's JSON dict (step counters, sampler state, contract, ...)
        COMMITTED                     written last: JSON manifest {format, step, world_size, files: {path: bytes},
                                      sha256: {path: hex digest}}

Write order (one save of step ``n``)
------------------------------------
1. rank 0 prepares ``step_<n>/``: a leftover uncommitted ``step_<n>/`` (a crashed earlier attempt) is deleted; a
   committed one (a run that resumed from an earlier checkpoint and reached ``n`` again) is first *demoted* (its
   ``COMMITTED`` unlinked and the directory fsynced) and then deleted. Committed checkpoints with a step above
   ``n`` belong to the abandoned future of such a resumed run: their marker is renamed to ``SUPERSEDED`` (the files are
   kept, resume no longer trusts them), so the newest committed checkpoint is always the latest save.
   ``step_<n>/`` is created and ``checkpoints/`` fsynced. — barrier —
2. every rank writes its RNG files; rank 0 writes the weights, ``optimizer.pt``, its RNG files and
   ``trainer_state.json`` last. Each file: write ``.<name>.tmp-<pid>``, fsync it, ``os.replace`` to its name, fsync
   its directory. — barrier —
3. rank 0 checks that every rank's RNG files exist, fsyncs ``weights/``, ``rng/`` and ``step_<n>/``, writes
   ``COMMITTED`` (same tmp → fsync → rename → fsync-dir sequence), then replaces ``checkpoints/latest``
   atomically, then rotates. — barrier —

Rotation (rank 0, after the commit) keeps the newest ``keep`` committed checkpoints, always the one just written and
``protect`` (the checkpoint the run resumed from) and every ``keep_also`` (checkpoints the caller still needs, e.g.
the last good checkpoint of an audited stage). A checkpoint is deleted by unlinking its ``COMMITTED`` first, so a
crash mid-delete leaves an uncommitted directory, never a half-deleted committed one. Uncommitted directories with a
step below the newest committed one (debris of crashed saves) are deleted too.

Only flowforge's own directories are ever deleted (rotation, debris, a replaced step): one whose every file has a
name of the layout above (:func:`flowforge.runtime.durable.only_layout_files`); a directory holding anything else is
left alone and named in the log. A deletion renames ``COMMITTED`` to ``REMOVING`` and removes that marker last, so a
save killed mid-deletion leaves a directory that says it was being removed; the next save, and a resume
(:func:`finish_removals`, before anything is read), finish it.

``resume="auto"`` picks the newest committed checkpoint by step, not ``latest``: a crash between the marker and the
pointer update leaves ``latest`` one save behind, and the marker is the only thing resume trusts. Each file's sha256
(recorded in the manifest) is checked before a checkpoint is trusted: ``"auto"`` falls back to the previous committed
checkpoint naming the file that failed; an explicit path is refused.

Test-only knob
--------------
``_test_hook`` (module attribute, ``None`` in library use) is passed to every
:func:`flowforge.runtime.durable.atomic_write` of a save as ``hook(stage, relpath)``, ``stage`` ``"tmp"`` (file fully
written under its temporary name, not yet renamed) or ``"renamed"`` (in place). Tests set it in a subprocess to stop
the save at a known point and SIGKILL it there. Library code never sets it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from safetensors.torch import save_file
from torch import Tensor

from flowforge.runtime.durable import (atomic_write, demote, fsync_path, only_layout_files, remove_marked_dir,
                                       sha256_file, step_dir_name, step_of, torch_save, write_bytes)
from flowforge.runtime.errors import UserError
from flowforge.runtime.rng import capture_rng
from flowforge.runtime.run_dir import CHECKPOINTS_DIR, MARKER, committed_checkpoints, is_committed
from flowforge.train.checkpoint.layout import (_GROUP_RE, _LAYOUT, FORMAT_VERSION, LATEST, OPTIMIZER_FILE, REMOVING,
                                               RNG_DIR, SHARDED_DIR, SUPERSEDED, TRAINER_STATE_FILE, WEIGHTS_DIR,
                                               _rng_files, _step_dirs)

log = logging.getLogger("flowforge")

_test_hook: Callable[[str, str], None] | None = None


# ------------------------------------------------------------------------------------------------ paths
def _write(path: Path, write: Callable[[Path], None], relpath: str) -> None:
    """:func:`atomic_write` reporting to the test hook (read at call time: tests set it after import)."""
    atomic_write(path, write, _test_hook, relpath)


# ------------------------------------------------------------------------------------------------ RNG
def _write_rng(step_dir: Path, rank: int) -> None:
    rng = capture_rng()
    json_rel, st_rel = _rng_files(rank)
    (step_dir / RNG_DIR).mkdir(exist_ok=True)
    write_bytes(step_dir / json_rel, json.dumps({"python": rng["python"], "numpy": rng["numpy"]}).encode(),
                _test_hook, json_rel)
    tensors = {"torch": rng["torch"], **{f"cuda_{i}": s for i, s in enumerate(rng["cuda"])}}
    _write(step_dir / st_rel, lambda tmp: save_file(tensors, str(tmp)), st_rel)


# ------------------------------------------------------------------------------------------------ save
def _prepare_step_dir(run_dir: Path, step: int, protect: Path | None) -> Path:
    root = run_dir / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    step_dir = root / step_dir_name(step)
    for s, p in _step_dirs(run_dir):
        if s > step and is_committed(p) and (protect is None or p.resolve() != protect):
            log.warning("%s is from a run that went past step %d before this one resumed from an earlier "
                        "checkpoint: marked %s (files kept, no longer resumable)", p, step, SUPERSEDED)
            demote(p, MARKER, rename_to=SUPERSEDED)
    if step_dir.exists():
        if protect is not None and step_dir.resolve() == protect:
            raise ValueError(f"refusing to overwrite {step_dir}: it is the checkpoint this run resumed from")
        if not only_layout_files(step_dir, _LAYOUT):
            raise UserError(step_dir, "holds files flowforge did not write, so it will not be replaced",
                            "move those files out of the checkpoints directory")
        if is_committed(step_dir):
            log.warning("replacing committed checkpoint %s (this run resumed from an earlier step)", step_dir)
        _remove(step_dir)
    step_dir.mkdir()
    fsync_path(root)
    return step_dir


def _rotate(run_dir: Path, newest: Path, keep: int, protect: Path | None,
            keep_also: Sequence[Path] = ()) -> list[Path]:
    committed = committed_checkpoints(run_dir)
    keep_set = {p.resolve() for p in committed[-keep:]} | {newest.resolve()} | {Path(p).resolve() for p in keep_also}
    if protect is not None:
        keep_set.add(protect)
    removed = [p for p in committed if p.resolve() not in keep_set]
    newest_step = step_of(newest)
    removed += [p for s, p in _step_dirs(run_dir) if not is_committed(p) and not (p / SUPERSEDED).exists()
                and (s < newest_step or (p / REMOVING).exists())]
    foreign = [p for p in removed if not only_layout_files(p, _LAYOUT)]
    for p in foreign:
        log.warning("%s holds files flowforge did not write: not deleted", p)
    removed = [p for p in removed if p not in foreign]
    for p in removed:
        _remove(p)
    return removed


def _remove(step_dir: Path) -> None:
    """Delete one of flowforge's checkpoint directories, ``REMOVING`` marking it until the end (tests stop after the
    demotion through ``_test_hook("demoted", name)``)."""
    remove_marked_dir(step_dir, MARKER, pending=REMOVING, hook=_test_hook)


def finish_removals(run_dir: str | Path) -> list[Path]:
    """Finish the deletions a killed save started: every ``checkpoints/step_*`` directory marked ``REMOVING`` (never
    committed or superseded: the marker replaced ``COMMITTED``) that holds only files of the layout. Rank 0, under
    the run's lock, before a resume reads the checkpoints. Returns the directories removed.
    """
    done = []
    for _, p in _step_dirs(Path(run_dir)):
        if (p / REMOVING).exists() and not is_committed(p) and only_layout_files(p, _LAYOUT):
            _remove(p)
            log.info("finished removing %s (a save was interrupted while deleting it)", p)
            done.append(p)
    return done


def _state_json(step: int, keep: int, rank: int, world_size: int, barrier: Callable[[], None] | None,
                tensors: Mapping[str, Mapping[str, Tensor]], trainer_state: dict) -> str:
    """Check :func:`save_checkpoint`'s arguments; returns ``trainer_state`` as JSON text."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if world_size > 1 and barrier is None:
        raise ValueError("world_size > 1 needs a barrier (e.g. torch.distributed.barrier) to order the commit")
    bad = [g for g in tensors if not _GROUP_RE.match(g)]
    if bad:
        raise ValueError(f"tensor group names {bad} are not file-name safe (letters, digits, '_', '.', '-')")
    try:
        return json.dumps(trainer_state, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except (TypeError, ValueError) as e:
        raise ValueError(f"trainer_state is not JSON-serialisable: {e}") from e


def _write_tensors(step_dir: Path, tensors: Mapping[str, Mapping[str, Tensor]], optimizer_state: dict | None) -> None:
    """Rank 0's weight groups (contiguous CPU copies) and ``optimizer.pt``."""
    (step_dir / WEIGHTS_DIR).mkdir()
    for group in sorted(tensors):
        copies = {name: t.detach().to("cpu").contiguous().clone() for name, t in tensors[group].items()}
        rel = f"{WEIGHTS_DIR}/{group}.safetensors"
        _write(step_dir / rel, lambda tmp, c=copies: save_file(c, str(tmp)), rel)
    if optimizer_state is not None:
        _write(step_dir / OPTIMIZER_FILE, lambda tmp: torch_save(optimizer_state, tmp), OPTIMIZER_FILE)


def _commit(step_dir: Path, step: int, world_size: int, groups: list[str], has_optimizer: bool,
            rank_timeout_s: float) -> None:
    """Rank 0: wait for every rank's RNG files, fsync the directories, write the ``COMMITTED`` manifest."""
    rng_rel = [rel for r in range(world_size) for rel in _rng_files(r)]
    deadline = time.monotonic() + rank_timeout_s
    while missing := [rel for rel in rng_rel if not (step_dir / rel).is_file()]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{step_dir}: RNG files {missing} did not appear within {rank_timeout_s} s; "
                               "not committed")
        time.sleep(0.05)
    files = [f"{WEIGHTS_DIR}/{g}.safetensors" for g in groups]
    files += [OPTIMIZER_FILE] if has_optimizer else []
    files += rng_rel + [TRAINER_STATE_FILE]
    if (step_dir / SHARDED_DIR).is_dir():
        files += sorted(str(f.relative_to(step_dir)) for f in (step_dir / SHARDED_DIR).rglob("*") if f.is_file())
        fsync_path(step_dir / SHARDED_DIR)
    for d in (step_dir / WEIGHTS_DIR, step_dir / RNG_DIR, step_dir):
        fsync_path(d)
    manifest = {"format": FORMAT_VERSION, "step": step, "world_size": world_size, "groups": groups,
                "files": {rel: (step_dir / rel).stat().st_size for rel in files},
                "sha256": {rel: sha256_file(step_dir / rel) for rel in files}}
    _write_marker(step_dir, manifest)


def _write_marker(step_dir: Path, manifest: dict) -> None:
    """Write ``COMMITTED`` (the commit point). Everything it lists must already be durable."""
    write_bytes(step_dir / MARKER, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode(), _test_hook,
                MARKER)


def save_checkpoint(run_dir: str | Path, step: int, *, tensors: Mapping[str, Mapping[str, Tensor]],
                    optimizer_state: dict | None, trainer_state: dict, keep: int, rank: int = 0,
                    world_size: int = 1, protect: Path | None = None, keep_also: Sequence[Path] = (),
                    barrier: Callable[[], None] | None = None, rank_timeout_s: float = 600.0,
                    sharded_writer: Callable[[Path], None] | None = None) -> Path:
    """Write ``<run_dir>/checkpoints/step_<step:06d>/`` durably and commit it (see the module docstring for the
    write order), update ``checkpoints/latest``, then rotate.

    Args:
        run_dir: the run directory.
        step: completed training steps (the directory name; ``Checkpoint.step`` on load).
        tensors: named groups (``"live"``, ``"old"``, ``"ema"``, …) of named tensors; stored as contiguous CPU
            copies, one safetensors file per group. Group names: letters, digits, ``_ . -``. Only rank 0's are used.
        optimizer_state: ``optimizer.state_dict()`` (or a dict of several state dicts) made of tensors and plain
            Python values, so that it loads with ``weights_only=True``; ``None`` writes no ``optimizer.pt``.
        trainer_state: JSON-serialisable dict (tuples come back as lists; NaN/inf are refused).
        keep: committed checkpoints to keep (``>= 1``); the new one and ``protect`` are never deleted.
        rank, world_size: this process's rank; every rank calls this, rank 0 writes the shared files and commits.
        protect: the checkpoint the run resumed from; never deleted or overwritten.
        keep_also: checkpoints rotation keeps besides the newest ``keep`` (e.g. an audited stage's last good one).
        barrier: collective barrier (e.g. ``torch.distributed.barrier``); required when ``world_size > 1``.
        rank_timeout_s: how long rank 0 waits for the other ranks' RNG files after the barrier.
        sharded_writer: called on every rank with ``<step_dir>/dcp`` after the directory is prepared and before the
            commit, to write sharded state collectively (``torch.distributed.checkpoint.save``); every file it
            leaves there is listed in the manifest, so a damaged shard is detected on load.

    Returns:
        The committed step directory.

    Raises:
        ValueError: invalid ``step`` / ``keep`` / ``rank`` / group name, ``trainer_state`` not JSON-serialisable,
            ``world_size > 1`` without ``barrier``, or ``step`` is the protected checkpoint's step.
        RuntimeError: (rank 0) another rank's RNG files did not appear within ``rank_timeout_s``.
    """
    state_json = _state_json(step, keep, rank, world_size, barrier, tensors, trainer_state)
    sync = barrier if barrier is not None else (lambda: None)
    run_dir = Path(run_dir)
    protect = Path(protect).resolve() if protect is not None else None
    step_dir = run_dir / CHECKPOINTS_DIR / step_dir_name(step)
    if rank == 0:
        _prepare_step_dir(run_dir, step, protect)
    sync()
    if rank == 0:
        _write_tensors(step_dir, tensors, optimizer_state)
    if sharded_writer is not None:
        sharded_writer(step_dir / SHARDED_DIR)
    _write_rng(step_dir, rank)
    if rank == 0:
        write_bytes(step_dir / TRAINER_STATE_FILE, state_json.encode(), _test_hook, TRAINER_STATE_FILE)
    sync()
    if rank == 0:
        _commit(step_dir, step, world_size, sorted(tensors), optimizer_state is not None, rank_timeout_s)
        write_bytes(run_dir / CHECKPOINTS_DIR / LATEST, (step_dir.name + "\n").encode(), _test_hook, LATEST)
        for p in _rotate(run_dir, step_dir, keep, protect, keep_also):
            log.info("removed old checkpoint %s", p)
    sync()
    return step_dir
