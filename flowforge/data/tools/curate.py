"""``curate``: filter, dedup and split a unified-schema JSONL file into train / eval files, deterministically.

Steps, in order (a dropped record is counted once, under the first reason that applies):

1. **read** every row; a row that breaks the schema (:func:`~flowforge.data.tools.records.row_problems`) is an
   error naming file and line (``flowforge data inspect`` lists them all), and so is a ``sample_id`` given to two
   different rows (a row repeated verbatim is a duplicate, step 4);
2. ``too_short``: fewer than ``min_prompt_words`` words (placeholders not counted; 0 keeps every prompt);
3. ``missing_media``: a listed image is not a file or a listed video is neither a file nor a directory (paths
   relative to the input file); skipped with ``check_media=False``;
4. ``duplicate``: records with the same content hash (normalised prompt + sorted absolute media paths, see
   :mod:`flowforge.data.tools.records`) keep one: the smallest ``sample_id``;
5. **split**: kept records are ordered by ``split_key(sample_id)`` (sha256 of the id, never an RNG); the first
   ``n_eval`` form the eval set, the rest the train set; the eval subset of size ``s`` is the first ``s`` eval
   records, so ``eval64 ⊂ eval256 ⊂ eval``.

**Eval size.** With ``N`` kept records, ``eval_size`` and ``eval_fraction`` set ``n_eval`` as follows:

==========================  ====================================
given                       ``n_eval``
==========================  ====================================
neither                     ``2048`` (:data:`DEFAULT_EVAL_SIZE`)
``eval_size`` only          ``eval_size``
``eval_fraction`` only      ``floor(eval_fraction * N)``
both                        ``min(eval_size, floor(eval_fraction * N))`` (the fraction, capped)
==========================  ====================================

``1 <= n_eval < N`` is required (an empty eval or train set is an error) and every subset size must be at most
``n_eval``.

**Determinism.** Every output row is in split-key order and every choice above depends on the records' content and
ids only, so a rerun writes byte-identical files, and so does a reordered input: the split is a function of the
set of records. Adding records never moves a train record into eval for a fixed ``eval_size`` (the eval set is the
``n_eval`` smallest keys; new records can only push eval records out).

Outputs in ``out_dir`` (written as one set, :func:`~flowforge.runtime.durable.write_file_set`: all as temporaries
first, then renamed in place under an in-flight marker that readers refuse, so a kill never leaves an unmarked
mix of old and new files): ``{prefix}train.jsonl``, ``{prefix}eval.jsonl``,
``{prefix}eval{s}.jsonl`` per subset size, ``{prefix}summary.json`` (counts kept / dropped by reason, a few dropped
ids per reason, the settings). Relative media paths are rewritten to stay valid from ``out_dir``. Existing outputs
are replaced only with ``overwrite``; symlinks are never written through.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

from flowforge.data.tools.records import (
    absolute_media, check_output, content_hash, count_words, dumps_row, input_file, media_missing, media_paths,
    read_rows, rebase_media, row_problems, split_key,
)
from flowforge.runtime.durable import StageHook, write_file_set
from flowforge.runtime.errors import UserError
from flowforge.runtime.write_guard import check_write_target

DEFAULT_EVAL_SIZE = 2048
"""``n_eval`` when neither ``eval_size`` nor ``eval_fraction`` is given."""

DROP_REASONS = ("too_short", "missing_media", "duplicate")
"""Why a record is dropped, in the order the filters run."""

EXAMPLES_PER_REASON = 10
"""Dropped sample ids listed per reason in the summary (the smallest ones)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One valid input row."""

    line: int  # 1-based line in the input
    row: dict[str, Any]  # the parsed row
    content: str  # content hash (records module docstring)
    media: tuple[tuple[str, str], ...]  # (kind, absolute path) of each listed media file

    @property
    def sample_id(self) -> str:
        return self.row["metadata"]["sample_id"]

    @property
    def canonical(self) -> str:
        """The row as key-sorted JSON: equal for rows that are the same object."""
        return json.dumps(self.row, sort_keys=True, ensure_ascii=False)


@dataclasses.dataclass(frozen=True)
class CurateSettings:
    """The knobs of :func:`curate` (CLI flags of the same names)."""

    prefix: str = ""
    min_prompt_words: int = 6
    eval_size: int | None = None
    eval_fraction: float | None = None
    eval_subset_sizes: tuple[int, ...] = (64, 256)
    check_media: bool = True

    def validate(self) -> None:
        """Raises ``UserError`` naming the flag for a value out of range or a prefix that is not a plain name."""
        if self.prefix and (Path(self.prefix).name != self.prefix or self.prefix in (".", "..")):
            raise UserError("--prefix", f"is {self.prefix!r}, not a plain file-name prefix", "drop the slashes")
        if self.min_prompt_words < 0:
            raise UserError("--min-prompt-words", f"is {self.min_prompt_words}", "give 0 (keep all) or more")
        if self.eval_size is not None and self.eval_size < 1:
            raise UserError("--eval-size", f"is {self.eval_size}", "give a size of at least 1")
        if self.eval_fraction is not None and not 0.0 < self.eval_fraction < 1.0:
            raise UserError("--eval-fraction", f"is {self.eval_fraction}", "give a fraction in (0, 1)")
        if any(size < 1 for size in self.eval_subset_sizes):
            raise UserError("--eval-subset-sizes", f"are {list(self.eval_subset_sizes)}", "give sizes of at least 1")

    def eval_count(self, kept: int) -> int:
        """``n_eval`` for ``kept`` records (module docstring table); not range-checked."""
        if self.eval_fraction is None:
            return DEFAULT_EVAL_SIZE if self.eval_size is None else self.eval_size
        by_fraction = math.floor(self.eval_fraction * kept)
        return by_fraction if self.eval_size is None else min(self.eval_size, by_fraction)

    def subset_sizes(self) -> list[int]:
        return sorted(set(self.eval_subset_sizes))


def output_names(settings: CurateSettings) -> dict[str, str]:
    """Role -> file name: ``train``, ``eval``, ``eval{s}`` per subset size, ``summary``."""
    p = settings.prefix
    names = {"train": f"{p}train.jsonl", "eval": f"{p}eval.jsonl"}
    names.update({f"eval{s}": f"{p}eval{s}.jsonl" for s in settings.subset_sizes()})
    names["summary"] = f"{p}summary.json"
    return names


def read_entries(path: Path) -> list[Entry]:
    """Every row of ``path`` as an :class:`Entry`, in file order.

    Raises:
        UserError: the file cannot be read or holds no rows, a row breaks the schema (first one, with its line), or
            one sample_id names two different rows.
    """
    entries, by_id = [], {}
    for number, row, problem in read_rows(path):
        problems = [problem] if problem else row_problems(row)
        if problems:
            raise UserError(f"{path}:{number}", problems[0], "fix the row (flowforge data inspect lists every "
                                                             "problem of a file)")
        media = tuple((kind, absolute_media(path.parent, p)) for kind, p in media_paths(row["metadata"]))
        entry = Entry(number, row, content_hash(row["prompt"], [p for _, p in media]), media)
        first = by_id.setdefault(entry.sample_id, entry)
        if first is not entry and first.canonical != entry.canonical:
            raise UserError(f"{path}:{number}", f"sample_id {entry.sample_id!r} is also on line {first.line}, with "
                                                "different content", "give every record its own sample_id")
        entries.append(entry)
    if not entries:
        raise UserError(path, "holds no records", "give a JSONL file of the unified prompt schema")
    return entries


def _filter(entries: list[Entry], settings: CurateSettings) -> tuple[list[Entry], dict[str, list[str]]]:
    dropped: dict[str, list[str]] = {reason: [] for reason in DROP_REASONS}
    survivors = []
    for entry in entries:
        if count_words(entry.row["prompt"]) < settings.min_prompt_words:
            dropped["too_short"].append(entry.sample_id)
        elif settings.check_media and any(media_missing(kind, path) for kind, path in entry.media):
            dropped["missing_media"].append(entry.sample_id)
        else:
            survivors.append(entry)
    best: dict[str, Entry] = {}
    for entry in survivors:
        held = best.get(entry.content)
        if held is None or (entry.sample_id, entry.canonical) < (held.sample_id, held.canonical):
            best[entry.content] = entry
    kept_ids = {id(entry) for entry in best.values()}
    dropped["duplicate"] = [entry.sample_id for entry in survivors if id(entry) not in kept_ids]
    return list(best.values()), dropped


def _split(kept: list[Entry], settings: CurateSettings) -> tuple[list[Entry], list[Entry]]:
    n_eval = settings.eval_count(len(kept))
    if not 1 <= n_eval < len(kept):
        raise UserError("--eval-size / --eval-fraction", f"give an eval set of {n_eval} of the {len(kept)} kept "
                        "records; eval and train must each hold at least one",
                        "pick a size (or fraction) below the kept count")
    too_big = [s for s in settings.subset_sizes() if s > n_eval]
    if too_big:
        raise UserError("--eval-subset-sizes", f"{too_big} exceed the eval set ({n_eval} records)",
                        "lower them, pass an empty --eval-subset-sizes, or enlarge the eval set")
    ordered = sorted(kept, key=lambda e: (split_key(e.sample_id), e.sample_id))
    return ordered[n_eval:], ordered[:n_eval]


def _summary(entries: list[Entry], files: dict[str, list[Entry]], dropped: dict[str, list[str]],
             settings: CurateSettings, names: dict[str, str]) -> dict[str, Any]:
    return {
        "records_read": len(entries),
        "kept": len(files["train"]) + len(files["eval"]),
        "dropped": {reason: len(ids) for reason, ids in dropped.items()},
        "dropped_examples": {reason: sorted(ids)[:EXAMPLES_PER_REASON] for reason, ids in dropped.items()},
        "counts": {role: len(rows) for role, rows in files.items()},
        "files": names,
        "settings": {
            "min_prompt_words": settings.min_prompt_words, "eval_size": settings.eval_size,
            "eval_fraction": settings.eval_fraction, "eval_subset_sizes": settings.subset_sizes(),
            "check_media": settings.check_media,
            "split": "records ordered by sha256('flowforge-split\\0' + sample_id); the first n_eval are eval",
        },
    }


def stale_subsets(out_dir: Path, settings: CurateSettings) -> list[str]:
    """Names of ``{prefix}eval{s}.jsonl`` files in ``out_dir`` that this run does not write (left by an earlier run
    with other subset sizes; never deleted)."""
    pattern = re.compile(re.escape(settings.prefix) + r"eval(\d+)\.jsonl")
    ours = set(output_names(settings).values())
    found = [p.name for p in out_dir.iterdir() if pattern.fullmatch(p.name)] if out_dir.is_dir() else []
    return sorted(name for name in found if name not in ours)


def curate(input_path: str | Path, out_dir: str | Path, settings: CurateSettings = CurateSettings(), *,
           overwrite: bool = False, hook: StageHook | None = None) -> dict[str, Any]:
    """Filter, dedup and split ``input_path`` into ``out_dir`` (module docstring); returns the summary written.

    Raises:
        UserError: a setting out of range, an unreadable or invalid input (file and line), an output that exists
            (without ``overwrite``), is a symlink or is the input, or an eval / train / subset size that cannot be
            met.

    ``hook`` is :func:`~flowforge.runtime.durable.write_file_set`'s test hook.
    """
    settings.validate()
    input_path, out_dir = input_file(input_path, "--input"), Path(out_dir)
    names = output_names(settings)
    paths = {role: out_dir / name for role, name in names.items()}
    for path in paths.values():
        check_write_target(path, "--out-dir / --prefix", protected={"input": input_path})
        check_output(path, overwrite)
    entries = read_entries(input_path)
    kept, dropped = _filter(entries, settings)
    if not kept:
        why = ", ".join(f"{len(ids)} {reason}" for reason, ids in dropped.items() if ids)
        raise UserError(input_path, f"keeps no records (dropped: {why})", "lower --min-prompt-words or fix the media")
    train, evaluation = _split(kept, settings)
    files = {"train": train, "eval": evaluation}
    files.update({f"eval{s}": evaluation[:s] for s in settings.subset_sizes()})
    data = {names[role]: "".join(dumps_row({"prompt": e.row["prompt"],
                                            "metadata": rebase_media(e.row["metadata"], input_path.parent, out_dir)})
                                 for e in rows).encode("utf-8")
            for role, rows in files.items()}
    summary = _summary(entries, files, dropped, settings, names)
    data[names["summary"]] = (json.dumps(summary, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    write_file_set(out_dir, data, f"curate-{settings.prefix}", hook=hook)
    return summary
