"""``inspect``: list every problem of a train and / or eval prompt file, each with its file and line.

Checks per row (see :mod:`flowforge.data.tools.records` for the rules):

- the file is any prompt source training reads (:func:`flowforge.data.prompts.load_prompts`): a ``.txt`` file (one
  prompt a line), JSONL rows without ``metadata`` (read as training reads them, with derived ids), unified-schema
  JSONL, a dataset directory's train split, ``demo:train`` / ``demo:eval``;
- the row is UTF-8 and valid JSON, with only ``prompt`` / ``metadata`` at the top level;
- ``prompt`` is a non-empty string; ``metadata.task`` is one of the tasks; ``metadata.sample_id`` is a non-empty
  string, unique within its file;
- media values are paths or lists of paths; ``i2i`` / ``i2v`` rows name one condition image (``image``) or a list
  (``images``: a multi-image edit; the count of condition images per row is reported);
- ``<image>`` / ``<video>`` placeholders agree with the media listed (none, or one per file of that kind);
- every listed media file exists (relative paths from the file's directory);
- with ``decode_media``, every media file decodes (:mod:`flowforge.data.tools.media`; each distinct file once).

Across the two files, **leakage**: an eval row whose content hash (normalised prompt + media) or ``sample_id`` is
also in the train file is a problem on the eval row, naming the train line.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from flowforge.data.prompts import IMAGE_TASKS, condition_images
from flowforge.data.tools.media import decode_problem
from flowforge.data.tools.records import (
    absolute_media, content_hash, input_file, media_missing, media_paths, read_rows, row_problems,
)
from flowforge.runtime.errors import UserError


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem of one row, printed as ``path:line: message``."""

    path: str
    line: int  # 1-based
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


@dataclasses.dataclass(frozen=True)
class Inspection:
    """What :func:`inspect_files` found."""

    problems: list[Problem]  # file order (train, eval), then line order
    records: dict[str, int]  # file -> rows read (non-blank lines)
    decoded: int | None  # distinct media files decoded (None: decoding not asked for)
    condition_images: dict[str, dict[int, int]] = dataclasses.field(default_factory=dict)  # file -> {n: rows}

    @property
    def clean(self) -> bool:
        return not self.problems


@dataclasses.dataclass(frozen=True)
class _Seen:
    line: int
    sample_id: str | None
    content: str | None


def _media_problems(path: Path, metadata: dict, decode: bool,
                    cache: dict[str, str | None]) -> tuple[list[str], list[str]]:
    """(problems, absolute media paths) of one row's media."""
    problems, absolute = [], []
    for kind, listed in media_paths(metadata):
        full = absolute_media(path.parent, listed)
        absolute.append(full)
        if media_missing(kind, full):
            problems.append(f"metadata.{kind} {listed!r} is missing ({full})")
        elif decode:
            if full not in cache:
                cache[full] = decode_problem(kind, Path(full))
            if cache[full]:
                problems.append(f"metadata.{kind} {listed!r} {cache[full]}")
    return problems, absolute


def _inspect_file(path: Path, decode: bool, cache: dict[str, str | None],
                  counts: dict[int, int]) -> tuple[list[Problem], list[_Seen], int]:
    problems: list[Problem] = []
    seen: list[_Seen] = []
    first_line: dict[str, int] = {}
    rows = 0
    for number, row, problem in read_rows(path):
        rows += 1
        messages = [problem] if problem else row_problems(row)
        metadata = row.get("metadata") if isinstance(row, dict) else None
        if isinstance(metadata, dict):
            sample_id = metadata.get("sample_id") if isinstance(metadata.get("sample_id"), str) else None
            if sample_id and sample_id in first_line:
                messages.append(f"sample_id {sample_id!r} repeats the one on line {first_line[sample_id]}; ids must "
                                "be unique")
            elif sample_id:
                first_line[sample_id] = number
            if metadata.get("task") in IMAGE_TASKS:  # condition images per row (image: 1, images: its length)
                n = len(condition_images(metadata)) if isinstance(metadata.get("images", []), list) else 0
                counts[n] = counts.get(n, 0) + 1
            media_messages, absolute = _media_problems(path, metadata, decode, cache)
            messages += media_messages
            prompt = row.get("prompt")
            content = content_hash(prompt, absolute) if isinstance(prompt, str) and prompt.strip() else None
            seen.append(_Seen(number, sample_id, content))
        problems += [Problem(str(path), number, message) for message in messages]
    return problems, seen, rows


def _leakage(train: Path, train_seen: list[_Seen], evaluation: Path, eval_seen: list[_Seen]) -> list[Problem]:
    by_content = {s.content: s for s in reversed(train_seen) if s.content}
    by_id = {s.sample_id: s for s in reversed(train_seen) if s.sample_id}
    problems = []
    for s in eval_seen:
        same = by_content.get(s.content) if s.content else None
        same_id = by_id.get(s.sample_id) if s.sample_id else None
        if same is not None:
            also = " and the same sample_id" if same.sample_id == s.sample_id else ""
            message = f"train/eval leakage: same content{also} as {train}:{same.line}"
        elif same_id is not None:
            message = f"train/eval leakage: sample_id {s.sample_id!r} is also on {train}:{same_id.line}"
        else:
            continue
        problems.append(Problem(str(evaluation), s.line, message))
    return problems


def inspect_files(train: str | Path | None = None, evaluation: str | Path | None = None, *,
                  decode_media: bool = False) -> Inspection:
    """Check ``train`` and / or ``evaluation`` (module docstring); returns every problem found.

    Raises:
        UserError: neither file given, a file that is missing or unreadable, or the same file given twice.
    """
    if train is None and evaluation is None:
        raise UserError("--train / --eval", "neither was given", "give the prompt files to inspect")
    files = [input_file(p, what) for p, what in ((train, "--train"), (evaluation, "--eval")) if p is not None]
    if len(files) == 2 and files[0].resolve() == files[1].resolve():
        raise UserError("--eval", f"is the same file as --train ({files[0]})", "give the held-out file")
    cache: dict[str, str | None] = {}
    problems, seen, records, counts = [], {}, {}, {}
    for path in files:
        counts[str(path)] = {}
        found, seen[path], records[str(path)] = _inspect_file(path, decode_media, cache, counts[str(path)])
        problems += found
    if train is not None and evaluation is not None:
        leaks = _leakage(files[0], seen[files[0]], files[1], seen[files[1]])
        problems = sorted(problems + leaks, key=lambda p: (p.path != str(files[0]), p.line))
    return Inspection(problems=problems, records=records, decoded=len(cache) if decode_media else None,
                      condition_images={k: dict(sorted(v.items())) for k, v in counts.items() if v})
