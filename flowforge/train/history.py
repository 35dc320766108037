"""A resumed run's logged history, cut back to the step it resumes from, so every step is logged once.

What and why
------------
A run resumed from the checkpoint of step ``s`` trains steps ``s+1, ...`` again, although the killed process may
have logged some of them already (it was killed after step ``s`` was committed). Appending would log those steps
twice (65 rows for 60 steps, a zig-zag in TensorBoard). At acceptance the resume therefore cuts:

==================  =======================================================================================
file                rows kept
==================  =======================================================================================
``metrics.jsonl``   complete rows with ``step <= s``
``eval.jsonl``      complete rows with ``step <= s`` (the eval of step ``s`` ran before its checkpoint), none
                    when ``s == 0`` (a restart evaluates step 0 again)
TensorBoard         events of steps ``>= purge`` hidden by ``SummaryWriter(purge_step=purge)``,
                    ``purge = s + 1`` (``0`` when ``s == 0``): :func:`purge_step`
==================  =======================================================================================

A complete row is a line ending in a newline that parses as a JSON object with an integer ``step``; anything else
(the torn last line of a ``kill -9`` mid-write, which the next append would glue to a new row) is dropped and the
log says so. The cut file is written atomically; the run journal (:class:`flowforge.train.run_lifecycle.RunJournal`)
keeps the old bytes so a command that then fails before its first step puts them back.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from flowforge.runtime.run_dir import EVAL_FILE, METRICS_FILE

log = logging.getLogger("flowforge")


def purge_step(resumed_step: int) -> int:
    """The first TensorBoard step a run resumed at ``resumed_step`` logs again (see the module docstring)."""
    return resumed_step + 1 if resumed_step > 0 else 0


def cut_rows(path: Path, last_step: int) -> tuple[bytes, list[str]] | None:
    """The bytes of JSONL ``path`` keeping only complete rows with ``step <= last_step``, and what was dropped (in
    words, for the log); None when the file is missing or nothing is dropped.

    Raises:
        OSError: the file cannot be read.
    """
    path = Path(path)
    if not path.is_file():
        return None
    data = path.read_bytes()
    kept, later, broken = [], 0, 0
    lines = data.split(b"\n")
    torn = lines.pop() != b""  # the text after the last newline: empty for a file of complete lines
    for line in lines:
        try:
            row = json.loads(line)
            step = row["step"] if isinstance(row, dict) else None
        except (ValueError, KeyError):
            step = None
        if not isinstance(step, int) or isinstance(step, bool):
            broken += 1
        elif step > last_step:
            later += 1
        else:
            kept.append(line + b"\n")
    notes = []
    if later:
        notes.append(f"{later} rows of steps after {last_step} (trained again now)")
    if broken:
        notes.append(f"{broken} lines that are not a row")
    if torn:
        notes.append("a torn last line (a write cut by a kill)")
    return (b"".join(kept), notes) if notes else None


def cut_history(run_dir: Path, resumed_step: int, rewrite) -> None:
    """Cut ``metrics.jsonl`` and ``eval.jsonl`` of ``run_dir`` for a run resumed at ``resumed_step`` (module
    docstring), each through ``rewrite(name, data)`` (the run journal's, which writes atomically and can undo it),
    logging one line per cut file."""
    for name, last in ((METRICS_FILE, resumed_step), (EVAL_FILE, resumed_step if resumed_step > 0 else -1)):
        cut = cut_rows(Path(run_dir) / name, last)
        if cut is not None:
            data, notes = cut
            rewrite(name, data)
            log.info("resuming at step %d: %s: dropped %s", resumed_step, name, "; ".join(notes))
