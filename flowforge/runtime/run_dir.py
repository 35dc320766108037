"""Run-directory safety: one run per directory, explicitly; the base model and the run directory kept apart; the
base model's identity (sha256).

What and why
------------
A run directory holds a week of work, so flowforge refuses anything that could silently mix two runs or destroy one:

- :func:`existing_run` tells whether a directory already holds a run (``config.yaml``, ``metrics.jsonl``,
  ``checkpoints/`` or the guard's ``guard_best.safetensors``). A new run into it is refused unless it resumes
  (``train.resume``) or the user passes ``--overwrite``, which moves the old run aside to ``<name>.old-<n>``
  (:func:`move_aside`) after saying so: nothing is deleted.
- :func:`refuse_foreign_resume` refuses ``train.resume=<checkpoint>`` into a directory holding another run (the
  checkpoint's own run, or a fresh ``run.name``, are the two places a checkpoint continues), unless ``--overwrite``
  moves that run aside first.
- :func:`check_run_dir_place` keeps a run directory out of other runs, checkpoints and pipeline directories (the
  shared write rule, :mod:`flowforge.runtime.write_guard`); :func:`check_run_dir_outside_source` also refuses a run
  directory inside, equal to, or containing the base model, so checkpoint rotation can never delete model files.
- :func:`check_artifacts_root` refuses an ``artifacts.root`` that is, or lies inside, a run's ``checkpoints/``.
- :func:`sha256_of_path` identifies the base model, stored in every checkpoint's training contract.

The per-run lock (one process per run directory) is :class:`flowforge.runtime.lock.RunLock`.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from flowforge.runtime.durable import step_dir_name, step_dirs
from flowforge.runtime.errors import UserError
from flowforge.runtime.write_guard import check_write_target

log = logging.getLogger("flowforge")

# The run directory's layout: one name per file, shared by the writers (train) and the readers (report, tools).
CONFIG_FILE = "config.yaml"  # the resolved config
METRICS_FILE = "metrics.jsonl"  # one JSON object per step
EVAL_FILE = "eval.jsonl"  # one JSON object per held-out evaluation
EVAL_PREFIX = "eval/"  # the namespace of eval.jsonl's metrics
TB_DIR = "tb"  # TensorBoard events
SAMPLES_DIR = "samples"  # eval grids, samples/step_000010.png (+ .json captions)
START_SAMPLES_FILE = "start_samples.safetensors"  # in SAMPLES_DIR: the step-0 eval's samples, small
PROVENANCE_FILE = "provenance.json"  # versions, git commit, host
MODEL_PROVENANCE_FILE = "model_provenance.json"  # every loaded tensor's source (models that record it: world models)
LOG_FILE = "train.log"
CHECKPOINTS_DIR = "checkpoints"  # checkpoints/step_000020/, each counted once its MARKER is written
MARKER = "COMMITTED"
GUARD_BEST_FILE = "guard_best.safetensors"  # the reward-hacking guard's rollback target (flowforge.train.guard)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".json")
RUN_FILES = (CONFIG_FILE, METRICS_FILE, CHECKPOINTS_DIR, GUARD_BEST_FILE)
"""Any of these marks a directory as holding a run."""
WRITTEN_FILES = (CONFIG_FILE, METRICS_FILE, EVAL_FILE, LOG_FILE, PROVENANCE_FILE, MODEL_PROVENANCE_FILE,
                 GUARD_BEST_FILE, SAMPLES_DIR)
"""What a run writes under fixed names; each refused when it is a link leading out of the run directory (writing or
renaming over a name there would replace a file elsewhere). ``samples/`` is here because its files have fixed names
(``step_N.png``, ``start_samples.safetensors``); ``tb/`` (event files named by host, time and pid, never replaced)
and ``checkpoints/`` (a link to a larger disk is a common, deliberate set-up) are not."""


def sample_grid_path(run_dir: Path, step: int) -> Path:
    """``<run_dir>/samples/step_000010.png``: where the loop saves, and the report finds, the grid of ``step``."""
    return Path(run_dir) / SAMPLES_DIR / f"{step_dir_name(step)}.png"


def is_committed(path: str | Path) -> bool:
    """True if ``path`` is a checkpoint directory holding a ``COMMITTED`` marker."""
    return (Path(path) / MARKER).is_file()


def last_logged_step(run_dir: str | Path) -> int | None:
    """The last integer ``step`` of ``<run_dir>/metrics.jsonl``; ``None`` when the file is missing or unreadable or
    logs no step. Lines that are not a metrics row (a torn last line after a kill) are skipped. Never raises."""
    import json

    try:
        lines = (Path(run_dir) / METRICS_FILE).read_text(encoding="utf-8").splitlines()
    except (OSError, ValueError):
        return None
    done = None
    for line in lines:
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int) and not isinstance(step, bool):
            done = step
    return done


def saved_setting(run_dir: str | Path, section: str, key: str) -> Any:
    """``<section>.<key>`` of the run's own ``config.yaml``; ``None`` when the file, the section or the key is
    missing or unreadable. Never raises."""
    import yaml

    try:
        saved = yaml.safe_load((Path(run_dir) / CONFIG_FILE).read_text(encoding="utf-8"))
        return saved[section][key]
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError):
        return None


def committed_checkpoints(run_dir: str | Path) -> list[Path]:
    """Committed ``<run_dir>/checkpoints/step_*`` directories, sorted by step (oldest first)."""
    return [p for _, p in step_dirs(Path(run_dir) / CHECKPOINTS_DIR) if is_committed(p)]


def existing_run(run_dir: Path) -> list[str]:
    """The entries of ``run_dir`` that show it already holds a run (of :data:`RUN_FILES`); empty for a new run."""
    return [n for n in RUN_FILES if os.path.lexists(Path(run_dir) / n)]


def refuse_rerun(run_dir: Path, found: list[str]) -> None:
    """Refuse a new (not resuming) run into ``run_dir`` that already holds ``found``.

    Raises:
        UserError: saying the three ways on.
    """
    raise UserError(run_dir, f"already holds a run ({', '.join(found)})",
                    "continue it with train.resume=auto, choose another run.name, or pass --overwrite to move the "
                    f"old run aside to {Path(run_dir).name}.old-<n>")


def refuse_foreign_resume(run_dir: Path, resume: str | None, output_dir: str | Path) -> None:
    """Refuse ``train.resume=<checkpoint path>`` into ``run_dir`` when ``run_dir`` already holds a run that is not
    the checkpoint's: the new run would replace that run's checkpoints (rotation, saves at the same steps),
    ``config.yaml`` and logs. Allowed: a checkpoint inside ``run_dir`` (the run's own); a new or empty run directory;
    a run directory without a committed checkpoint whose own ``config.yaml`` records a resume from this same
    checkpoint (the same command started again after it was killed before its first save, e.g. a pipeline's stage
    C; compared relative to the recorded ``run.output_dir``, so a moved pipeline directory still matches).

    Args:
        run_dir: ``run.output_dir / run.name``. resume: ``train.resume`` (``auto`` / ``must`` / None: nothing to
            check). output_dir: ``run.output_dir`` as configured.

    Raises:
        UserError: naming the checkpoint's run, the run that would be overwritten and how to start a new run.
    """
    from flowforge.runtime.write_guard import enclosing, real

    if not resume or resume in ("auto", "must") or not existing_run(run_dir):
        return
    checkpoint = real(Path(resume).expanduser())
    if checkpoint.is_relative_to(real(run_dir)):
        return
    if not committed_checkpoints(run_dir):
        saved, saved_out = saved_setting(run_dir, "train", "resume"), saved_setting(run_dir, "run", "output_dir")
        if isinstance(saved, str) and isinstance(saved_out, str) and (
                real(saved) == checkpoint
                or os.path.relpath(saved, saved_out) == os.path.relpath(Path(resume).expanduser(), output_dir)):
            return
    owner = enclosing(checkpoint.parent)
    whose = (f"belongs to the run {owner[1]}" if owner and owner[0] == "run directory"
             else f"lies in no run directory ({checkpoint})")
    raise UserError(f"train.resume={resume}", f"the checkpoint {whose}, but run.name={Path(run_dir).name} names the "
                    f"existing run {run_dir}, whose checkpoints, config.yaml and logs this would replace",
                    f"to start a new run from that checkpoint choose a fresh run.name (one that does not exist in "
                    f"{Path(run_dir).parent}); to continue {run_dir} use train.resume=auto; or pass --overwrite to "
                    f"move it aside to {Path(run_dir).name}.old-<n> first")


def move_aside(run_dir: Path) -> Path:
    """Rename ``run_dir`` to the first free ``<name>.old-<n>`` (n = 1, 2, ...) beside it, saying so; returns it."""
    run_dir = Path(run_dir)
    n = 1
    while os.path.lexists(aside := run_dir.with_name(f"{run_dir.name}.old-{n}")):
        n += 1
    log.warning("--overwrite: moving the old run %s aside to %s (nothing is deleted)", run_dir, aside)
    os.rename(run_dir, aside)
    return aside


def check_artifacts_root(root: Path, run_dir: Path) -> None:
    """Refuse an ``artifacts.root`` equal to or inside a run's checkpoint directory (this run's, or any directory
    named ``checkpoints`` that holds ``step_*`` checkpoints), where reaping rollouts would delete checkpoints.

    Raises:
        UserError: naming ``artifacts.root``.
    """
    root = Path(root).resolve()
    own = (Path(run_dir) / "checkpoints").resolve()
    for d in (root, *root.parents):
        if d == own or (d.name == "checkpoints" and (d.parent / "config.yaml").exists()):
            raise UserError("artifacts.root", f"{root} is inside the checkpoint directory {d}",
                            "point artifacts.root at an empty directory of its own")


def check_run_dir_place(run_dir: str | Path, own: str | Path | None = None) -> None:
    """The shared write rule for a run directory: its parent may not lie in another run, a checkpoint or a pipeline
    directory, unless inside ``own`` (the pipeline directory of a pipeline's stage). The run directory itself is
    this run's own area; an existing run there is handled by :func:`existing_run` and :func:`refuse_foreign_resume`.

    Raises:
        UserError: naming the directory it lies inside (:func:`flowforge.runtime.write_guard.check_write_target`).
    """
    check_write_target(Path(run_dir).parent, "run directory " + str(run_dir) + " (its parent)", own=own)


def check_run_dir_outside_source(run_dir: str | Path, source_dir: str | Path, own: str | Path | None = None) -> None:
    """Refuse a run directory that equals, lies inside, or contains the source model directory (symlinks resolved),
    so checkpoints and rotation can never write into or delete the base model.

    Raises:
        ValueError: naming both resolved paths; UserError: the run directory's place is refused
            (:func:`check_run_dir_place`).
    """
    check_run_dir_place(run_dir, own)
    run, src = Path(run_dir).resolve(), Path(source_dir).resolve()
    if run == src:
        raise ValueError(f"run directory {run} is the source model directory; choose a run directory elsewhere")
    if run.is_relative_to(src):
        raise ValueError(f"run directory {run} lies inside the source model directory {src}; choose a run "
                         "directory elsewhere")
    if src.is_relative_to(run):
        raise ValueError(f"run directory {run} contains the source model directory {src}; choose a run "
                         "directory elsewhere")


def _hash_file_into(h: Any, path: Path) -> None:
    with open(path, "rb") as f:
        while chunk := f.read((1 << 20)):
            h.update(chunk)


def sha256_of_path(path: str | Path) -> str:
    """sha256 hex digest identifying a model: of a file's bytes (equals ``sha256sum``), or of a directory's weight
    files — every ``*.safetensors`` / ``*.bin`` / ``*.json`` below it (hidden directories skipped, file symlinks
    followed), in sorted relative-path order, each framed as ``relpath NUL size NUL contents``. Read-only, streamed
    in 1 MiB chunks.

    Raises:
        ValueError: the path does not exist, or a directory holds no weight files.
    """
    path = Path(path)
    h = hashlib.sha256()
    if path.is_file():
        _hash_file_into(h, path)
        return h.hexdigest()
    if not path.is_dir():
        raise ValueError(f"{path} does not exist (cannot hash the base model)")
    files = []
    for root, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        files += [Path(root) / n for n in names if n.endswith(WEIGHT_SUFFIXES) and not n.startswith(".")]
    if not files:
        raise ValueError(f"{path} holds no {list(WEIGHT_SUFFIXES)} files (cannot hash the base model)")
    for f in sorted(files, key=lambda p: p.relative_to(path).as_posix()):
        rel = f.relative_to(path).as_posix().encode()
        h.update(rel + b"\0" + str(f.stat().st_size).encode() + b"\0")
        _hash_file_into(h, f)
    return h.hexdigest()
