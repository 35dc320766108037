"""``prepare``: turn a raw prompt source into one JSONL file of the unified prompt schema.

==========  ==========================================================================================================
source      what ``--input`` is
==========  ==========================================================================================================
pickapic    a Pick-a-Pic prompt dump: a parquet file, or a directory whose ``*.parquet`` files (recursively, in path
            order) are read; the prompt column is ``caption`` (pickapic_v1 / pickapic_v2 /
            pickapic_v1_no_images) or else ``prompt`` (PickaPic-rankings), or ``--column``
parquet     any parquet file / directory; ``--column`` names the prompt column (a string column)
jsonl       one JSON object per line; the prompt is field ``--prompt-field`` (default ``prompt``); an object
            ``metadata`` and every other top-level key are kept as metadata (a key in both is an error)
lines       a UTF-8 text file, one prompt per line (surrounding whitespace stripped; blank lines are not prompts)
==========  ==========================================================================================================

Parquet is read with pyarrow, column by column in batches (the image bytes of a Pick-a-Pic shard are never loaded).
Rows whose prompt is null or only whitespace are skipped and counted; anything else wrong in the input is an error
naming the file and line (or parquet row).

**Sample ids** are a hash of the source kind and the row's content, never of its position::

    sample_id = f"{source}-{sha256(json([source, task, prompt, sorted(media paths as written)]))[:16 hex]}"

The ``n``-th repeat (n >= 1, in input order) of the same content gets ``-{n}`` appended. Repeats are identical, so
the set of ``(sample_id, row)`` pairs does not depend on the input order. A ``jsonl`` row that already has a
``metadata.sample_id`` keeps it. Ids must be unique in the output (an error names both rows otherwise).

The output is written atomically; an existing ``--output`` is replaced only with ``overwrite``; a symlink is never
written through. Relative media paths of ``jsonl`` rows are rewritten to stay valid from the output's directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flowforge.data.prompts import IMAGE_TASKS, TASKS
from flowforge.data.tools.records import (
    check_output, dumps_row, media_paths, parse_line, read_lines, rebase_media, row_problems, write_text,
)
from flowforge.runtime.errors import UserError, file_error
from flowforge.runtime.write_guard import check_write_target

SOURCES = ("pickapic", "parquet", "jsonl", "lines")
"""Values of ``--source``."""

PICKAPIC_COLUMNS = ("caption", "prompt")
"""Prompt columns of Pick-a-Pic dumps, tried in this order when ``--column`` is not given."""

Item = tuple[str, Any, dict[str, Any]]
"""``(where, prompt, metadata)`` from a reader: ``where`` is ``"file:line"`` / ``"file:row N"`` for messages."""


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What :func:`prepare` wrote."""

    output: Path
    written: int  # rows in the output
    skipped_empty: int  # input rows whose prompt was null or only whitespace


def stable_id(source: str, task: str, prompt: str, media: list[str]) -> str:
    """``f"{source}-{16 hex digits}"``: sha256 of the source kind, task, prompt and sorted media paths."""
    payload = json.dumps([source, task, prompt, sorted(media)], ensure_ascii=False)
    return f"{source}-{hashlib.sha256(payload.encode('utf-8')).hexdigest()[:16]}"


def _check_args(source: str, task: str, column: str | None, prompt_field: str | None) -> None:
    if source not in SOURCES:
        raise UserError("--source", f"is {source!r}", f"choose one of {list(SOURCES)}")
    if task not in TASKS:
        raise UserError("--task", f"is {task!r}", f"choose one of {list(TASKS)}")
    if column is not None and source not in ("parquet", "pickapic"):
        raise UserError("--column", f"does not apply to --source {source}",
                        "use --prompt-field for jsonl; lines files have no columns")
    if prompt_field is not None and source != "jsonl":
        raise UserError("--prompt-field", f"does not apply to --source {source}", "use --column for parquet")
    if source == "parquet" and column is None:
        raise UserError("--column", "is required for --source parquet", "name the column that holds the prompts")
    if task in IMAGE_TASKS and source != "jsonl":
        raise UserError("--task", f"{task} needs metadata.image on every row, which --source {source} cannot carry",
                        "give a jsonl input whose rows name their condition image")


def _lines(path: Path) -> Iterator[Item]:
    for number, text, problem in read_lines(path):
        if problem:
            raise UserError(f"{path}:{number}", problem, "give a UTF-8 text file")
        yield f"{path}:{number}", text.strip(), {}


def _jsonl(path: Path, prompt_field: str) -> Iterator[Item]:
    for number, text, problem in read_lines(path):
        where = f"{path}:{number}"
        row, problem = (None, problem) if problem else parse_line(text)
        if problem or not isinstance(row, dict):
            raise UserError(where, problem or f"is a JSON {type(row).__name__}, not an object",
                            "give one JSON object per line")
        if prompt_field not in row:
            raise UserError(where, f"has no field {prompt_field!r} (fields: {sorted(row)})",
                            "name the prompt field with --prompt-field")
        prompt = row[prompt_field]
        if prompt is not None and not isinstance(prompt, str):
            raise UserError(where, f"field {prompt_field!r} is a {type(prompt).__name__}, not a string",
                            "give text prompts")
        metadata = row.get("metadata", {})
        if not isinstance(metadata, dict):
            raise UserError(where, f"field 'metadata' is a {type(metadata).__name__}, not an object",
                            "give metadata as a JSON object")
        metadata = dict(metadata)
        for key, value in row.items():
            if key in (prompt_field, "metadata"):
                continue
            if key in metadata:
                raise UserError(where, f"key {key!r} is both a top-level field and a metadata key", "keep one")
            metadata[key] = value
        yield where, prompt, metadata


def _parquet_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.parquet") if p.is_file())
        if not files:
            raise UserError(path, "holds no *.parquet files", "give a parquet file or a directory of them")
        return files
    if not path.is_file():
        raise UserError(path, "does not exist", "give a parquet file or a directory of them")
    return [path]


def _prompt_column(file: Path, names: list[str], column: str | None) -> str:
    if column is not None:
        if column not in names:
            raise UserError(file, f"has no column {column!r} (columns: {names})", "pass --column with one of them")
        return column
    for name in PICKAPIC_COLUMNS:
        if name in names:
            return name
    raise UserError(file, f"has none of the Pick-a-Pic prompt columns {list(PICKAPIC_COLUMNS)} (columns: {names})",
                    "pass --column NAME")


def _parquet(path: Path, column: str | None) -> Iterator[Item]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    string_types = (pa.types.is_string, pa.types.is_large_string, getattr(pa.types, "is_string_view", None))
    for file in _parquet_files(path):
        try:
            handle = pq.ParquetFile(file)
        except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a file that is not parquet
            raise file_error(file, exc, "give a parquet file") from exc
        schema = handle.schema_arrow
        name = _prompt_column(file, list(schema.names), column)
        kind = schema.field(name).type
        if not any(test is not None and test(kind) for test in string_types):
            raise UserError(file, f"column {name!r} holds {kind}, not strings", "pass --column naming a text column")
        row = 0
        with handle:
            for batch in handle.iter_batches(columns=[name], batch_size=8192):
                for value in batch.column(0).to_pylist():
                    row += 1
                    yield f"{file}:row {row}", value, {}


def _items(source: str, path: Path, column: str | None, prompt_field: str | None) -> Iterator[Item]:
    if source in ("pickapic", "parquet"):
        return _parquet(path, column)
    if not path.is_file():
        raise UserError(path, "is not a file", f"give the {source} file to read")
    return _jsonl(path, prompt_field or "prompt") if source == "jsonl" else _lines(path)


def _row(source: str, task: str, item: Item, occurrences: Counter, dirs: tuple[Path, Path]) -> dict[str, Any]:
    where, prompt, metadata = item
    if metadata.get("task", task) != task:
        raise UserError(where, f"has metadata.task={metadata['task']!r} but --task is {task!r}",
                        "pass the matching --task, or prepare each task separately")
    sample_id = metadata.get("sample_id")
    if sample_id is None:
        base = stable_id(source, task, prompt, [path for _, path in media_paths(metadata)])
        repeat = occurrences[base]
        occurrences[base] += 1
        sample_id = base if repeat == 0 else f"{base}-{repeat}"
    rest = {k: v for k, v in metadata.items() if k not in ("task", "sample_id")}
    row = {"prompt": prompt, "metadata": rebase_media({"task": task, "sample_id": sample_id, **rest}, *dirs)}
    problems = row_problems(row)
    if problems:
        raise UserError(where, problems[0], "fix the input row")
    return row


def prepare(source: str, input_path: str | Path, output: str | Path, *, task: str = "t2i", column: str | None = None,
            prompt_field: str | None = None, overwrite: bool = False) -> Prepared:
    """Convert ``input_path`` (a ``source`` of :data:`SOURCES`) into the unified JSONL ``output`` (module docstring).

    Args:
        source: ``pickapic`` | ``parquet`` | ``jsonl`` | ``lines``.
        input_path: the raw file (parquet: a file or a directory of ``*.parquet``).
        output: the JSONL file to write.
        task: ``metadata.task`` of every row (one of :data:`~flowforge.data.prompts.TASKS`).
        column: prompt column of a parquet source (required for ``parquet``; ``pickapic`` finds its own).
        prompt_field: prompt field of a ``jsonl`` source (default ``prompt``).
        overwrite: replace an existing ``output``.

    Raises:
        UserError: a bad argument, an unreadable or malformed input (naming file and line / row), an existing
            ``output`` without ``overwrite``, an ``output`` that is a symlink, repeated sample ids, or no prompts.
    """
    _check_args(source, task, column, prompt_field)
    input_path, output = Path(input_path), Path(output)
    check_write_target(output, "--output", protected={"input": input_path})
    check_output(output, overwrite)
    lines, first_seen, occurrences, skipped = [], {}, Counter(), 0
    for item in _items(source, input_path, column, prompt_field):
        if item[1] is None or not item[1].strip():
            skipped += 1
            continue
        row = _row(source, task, item, occurrences, (input_path.parent, output.parent))
        sample_id = row["metadata"]["sample_id"]
        if sample_id in first_seen:
            raise UserError(item[0], f"sample_id {sample_id!r} repeats the one of {first_seen[sample_id]}",
                            "give every row its own sample_id")
        first_seen[sample_id] = item[0]
        lines.append(dumps_row(row))
    if not lines:
        raise UserError(input_path, f"holds no prompts ({skipped} empty)", "check --source and the prompt column")
    write_text(output, "".join(lines))
    return Prepared(output=output, written=len(lines), skipped_empty=skipped)
