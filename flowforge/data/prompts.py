"""Prompt records (the unified JSONL schema): reading and validating prompt files.

**Schema.** A prompt file is JSON Lines, one object per line (blank lines are skipped)::

    {"prompt": "a handwritten seven", "metadata": {"task": "t2i", "sample_id": "demo-train-t00-d7", "digit": 7}}

``prompt`` is a non-empty string; ``metadata`` is an object with ``task`` in ``TASKS`` and ``sample_id`` a non-empty
string unique within the file. Any other metadata keys are free-form and reach the reward scorers untouched (the demo
digit scorer reads ``metadata["digit"]``). Other top-level keys are rejected, so a typo cannot be silently ignored.
``"demo:train"`` and ``"demo:eval"`` name the packaged prompt files of the embedded default.

Image-conditioned tasks (``i2v``, ``i2i``) also need ``metadata.image``: the path of the condition image (the first
frame for i2v), relative to the prompt file's directory or absolute; :func:`load_prompts` checks that it exists and
stores it resolved to an absolute path::

    {"prompt": "the cat walks away", "metadata": {"task": "i2v", "sample_id": "v1", "image": "frames/cat.png"}}

Multi-image edits list several reference images instead, in order (``metadata.images``, a non-empty list; ``image``
and ``images`` are not both allowed; :func:`condition_images` gives either as a list), checked and resolved the same
way; how many a family takes is checked when training starts (:func:`check_condition_images`)::

    {"prompt": "the cat from picture 1 on the sofa of picture 2", "metadata": {"task": "i2i", "sample_id": "e1",
     "images": ["refs/cat.png", "refs/sofa.png"]}}

**K-repeat sampling** (which prompts a step draws) lives in :mod:`flowforge.data.sampler`; its names are
re-exported here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import stat
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from PIL import Image

from flowforge.data import peer_prompts as peer
from flowforge.data.sampler import KRepeatBatch, KRepeatSampler  # noqa: F401 -- re-exported: callers import them here
from flowforge.runtime.durable import incomplete_set
from flowforge.runtime.errors import UserError, file_error

TASKS = ("t2i", "i2i", "t2v", "i2v")
"""Allowed values of ``metadata.task``."""

IMAGE_TASKS = ("i2i", "i2v")
"""Tasks conditioned on an image (``metadata.image``)."""

DEMO_PROMPT_SETS = ("demo:train", "demo:eval", "demo:world-train", "demo:world-eval")
"""Names that resolve to the embedded default's packaged prompt files."""

PACKAGED_PROMPTS_DIR = pathlib.Path(__file__).resolve().parents[1] / "demo" / "prompts"
"""Where the packaged prompt files live (package data of ``flowforge/demo``; the data layer names the files by path
and imports no demo code, so :mod:`flowforge.demo.paths` resolves its prompt names through here)."""

_TOP_LEVEL_KEYS = ("prompt", "metadata")


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One prompt and its metadata (``task``, ``sample_id`` and any task-specific keys such as ``digit``).

    ``metadata`` is a plain dict so it serialises with ``json``; treat it as read-only.
    """

    prompt: str
    metadata: dict[str, Any]

    @property
    def task(self) -> str:
        return self.metadata["task"]

    @property
    def sample_id(self) -> str:
        return self.metadata["sample_id"]

    def to_dict(self) -> dict[str, Any]:
        """The record as a JSON-ready row of the unified schema (a deep copy)."""
        return json.loads(json.dumps({"prompt": self.prompt, "metadata": self.metadata}))


def resolve_prompt_path(source: str | pathlib.Path) -> pathlib.Path:
    """Turn a prompt source into a file path: ``"demo:train"`` / ``"demo:eval"`` give the packaged demo files,
    anything else is taken as a filesystem path (not checked for existence here).

    Raises:
        ValueError: ``source`` starts with ``"demo:"`` but is not one of ``DEMO_PROMPT_SETS``.
    """
    text = str(source)
    if text.startswith("demo:"):
        if text not in DEMO_PROMPT_SETS:
            raise ValueError(f"prompt source {text!r}: demo prompt sets are {list(DEMO_PROMPT_SETS)}")
        return PACKAGED_PROMPTS_DIR / f"{text[len('demo:'):]}.jsonl"
    return pathlib.Path(source)


def prompt_file(source: str | pathlib.Path) -> pathlib.Path:
    """The file a prompt source reads: :func:`resolve_prompt_path`, and a dataset directory's train split
    (:data:`flowforge.data.peer_prompts.TRAIN_FILES`) for a directory holding one (not checked for existence).

    Raises:
        ValueError: as :func:`resolve_prompt_path`.
    """
    path = resolve_prompt_path(source)
    if path.is_dir() and (train := peer.dataset_file(path)) is not None:
        return train
    return path


_PREPARE = "flowforge data prepare SOURCE OUT.jsonl converts other formats"


def _row_error(path: pathlib.Path, line: int, field: str, problem: str) -> ValueError:
    return ValueError(f"{path}:{line}: field {field!r} {problem}; {_PREPARE}")


def _lone_surrogate(value: Any, field: str = "") -> tuple[str, str] | None:
    """``(field, "\\ud800 at character 5")`` for the first string in ``value`` (a JSON row: keys and values,
    nested) holding a lone surrogate code point, which JSON's ``\\ud800`` escape can give and UTF-8 cannot
    encode; None when there is none."""
    if isinstance(value, str):
        for i, char in enumerate(value):
            if "\ud800" <= char <= "\udfff":
                return field or "prompt", f"{char.encode('unicode_escape').decode()} at character {i + 1}"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        name = f"{field}.{key}" if field else str(key)
        found = _lone_surrogate(key, name) if isinstance(key, str) else None
        found = found or _lone_surrogate(item, name)
        if found is not None:
            return found
    return None


def _parse_row(path: pathlib.Path, line: int, text: str, index: int, *, check_image: bool = True) -> PromptRecord:
    try:
        row = peer.unified_row(path, index, text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{line}: not valid JSON ({err.msg} at column {err.colno}); {_PREPARE}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{line}: each line must be a JSON object, got {type(row).__name__}; {_PREPARE}")
    surrogate = _lone_surrogate(row)
    if surrogate is not None:
        field, where = surrogate
        raise _row_error(path, line, field, f"holds a lone surrogate escape ({where}): half of a UTF-16 pair, no "
                                            "character, which cannot be encoded as UTF-8; write the character "
                                            "itself or its complete \\uD8xx\\uDCxx pair")
    unknown = sorted(set(row) - set(_TOP_LEVEL_KEYS))
    if unknown:
        raise _row_error(path, line, unknown[0], f"is not allowed; top-level keys are {list(_TOP_LEVEL_KEYS)}")
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise _row_error(path, line, "prompt", f"must be a non-empty string, got {prompt!r}")
    metadata = row.get("metadata")
    if not isinstance(metadata, dict):
        raise _row_error(path, line, "metadata", f"must be an object with 'task' and 'sample_id', got {metadata!r}")
    task = metadata.get("task")
    if task not in TASKS:
        raise _row_error(path, line, "metadata.task", f"must be one of {list(TASKS)}, got {task!r}")
    sample_id = metadata.get("sample_id")
    if not isinstance(sample_id, str) or not sample_id:
        raise _row_error(path, line, "metadata.sample_id", f"must be a non-empty string, got {sample_id!r}")
    if task in IMAGE_TASKS:
        metadata = _resolve_condition_images(path, line, task, metadata, check_image)
    return PromptRecord(prompt=prompt, metadata=metadata)


def condition_images(metadata: Mapping[str, Any]) -> list[str]:
    """The condition image paths of an image-task record, in order: ``metadata.images`` (a list) or
    ``[metadata.image]`` (one image is a one-element list); ``[]`` when it names none."""
    images = metadata.get("images")
    if images is not None:
        return list(images)
    return [metadata["image"]] if metadata.get("image") else []


def _resolve_condition_images(path: pathlib.Path, line: int, task: str, metadata: dict[str, Any],
                              check_image: bool = True) -> dict[str, Any]:
    """``metadata`` with its condition image path(s) (``image``: one, or ``images``: a non-empty list) checked to be
    readable images and made absolute (relative paths start at the prompt file's folder). ``check_image=False``: a
    row read again (:class:`~flowforge.data.prompt_set.PromptSet`), whose images were checked when the file was
    opened: only resolved."""
    if "image" in metadata and "images" in metadata:
        raise _row_error(path, line, "metadata.images", "and 'metadata.image' are both given; give one: 'image' "
                                                        "(one path) or 'images' (a list of paths)")
    key = "images" if "images" in metadata else "image"
    value = metadata.get(key)
    paths = value if key == "images" else [value]
    if (key == "images" and (not isinstance(value, list) or not value)) or not all(
            isinstance(p, str) and p for p in paths):
        want = "a non-empty list of condition image paths" if key == "images" else "the condition image's path"
        raise _row_error(path, line, f"metadata.{key}", f"must be {want} for task {task!r}, got {value!r}")
    resolved = []
    for image in paths:
        full = (path.parent / image).resolve()
        if not check_image:
            resolved.append(str(full))
            continue
        if not full.is_file():
            raise _row_error(path, line, f"metadata.{key}", f"names {image!r}, which is not a file ({full})")
        try:
            with Image.open(full) as opened:
                opened.verify()
        except Exception as exc:  # PIL raises several types for unreadable / truncated files
            raise _row_error(path, line, f"metadata.{key}", f"names {image!r}, which is not a readable image "
                                                            f"({type(exc).__name__}: {exc})") from None
        resolved.append(str(full))
    return {**metadata, key: resolved if key == "images" else resolved[0]}


_FIX = ("give a .txt (one prompt a line) or JSONL prompt file, or a dataset directory with "
        f"{' / '.join(peer.TRAIN_FILES)}; {_PREPARE}")
_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"),
          (stat.S_ISSOCK, "a socket"))


def missing_file_message(path: pathlib.Path, what: str) -> str:
    """``"<what> PATH does not exist"``, plus the absolute path tried and where a relative path starts (the working
    directory, not the config file's folder) when ``path`` is relative."""
    if path.is_absolute():
        return f"{what} {path} does not exist"
    return (f"{what} {path} does not exist (tried {path.absolute()}: relative paths are resolved against the working "
            "directory)")


def check_prompt_file(path: pathlib.Path) -> None:
    """``path`` (symlinks followed) is a regular file that can be opened.

    Raises:
        FileNotFoundError: nothing is there (or a symlink points at nothing).
        UserError: a directory, something that is not a regular file (``/dev/null``, a FIFO, whose reading would
            give nothing or block), or a path that cannot be reached or read (a symlink loop, no permission).
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(missing_file_message(path, "prompt file")) from None
    except OSError as exc:
        raise file_error(path, exc, _FIX) from None
    if stat.S_ISDIR(mode):
        raise UserError(path, "is a directory with no train split", _FIX)
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "a special file")
        raise UserError(path, f"is not a regular file ({kind})", _FIX)
    if not os.access(path, os.R_OK):
        raise UserError(path, "cannot be read (Permission denied)", _FIX)


def open_prompt_file(source: str | pathlib.Path) -> pathlib.Path:
    """The checked file of a prompt source: :func:`prompt_file`, :func:`check_prompt_file`, and no interrupted file
    set (:func:`flowforge.runtime.durable.incomplete_set`).

    Raises:
        FileNotFoundError, UserError: as :func:`check_prompt_file`, or the file's set was left half-written.
    """
    path = prompt_file(source)
    check_prompt_file(path)
    if (marker := incomplete_set(path)) is not None:
        raise UserError(path, f"belongs to a file set whose writing was interrupted ({marker.name} is still there), "
                        "so it may mix old and new rows", "rerun the command that wrote it (e.g. flowforge data "
                        "curate ... --overwrite)")
    return path


def scan_rows(path: pathlib.Path) -> Iterator[tuple[int, int, int, PromptRecord]]:
    """Every prompt row of ``path``, validated, read line by line (the file is never held whole).

    Lines end at ``\\n``, ``\\r\\n`` or ``\\r`` (``bytes.splitlines``); blank lines are skipped.

    Yields:
        ``(line, offset, length, record)``: the 1-based line number, the byte offset and length of the row's text
        (without its line ending) and its :class:`PromptRecord`; row ``i`` (0-based among non-blank rows) is the
        ``i``-th item.

    Raises:
        UserError: the file cannot be read. ValueError: a row is invalid or not UTF-8 (file, line, field).
    """
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise file_error(path, exc, _FIX) from None
    index, line = 0, 0
    with handle:
        for offset, raw in _lines(handle, path):
            line += 1
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{line}: not UTF-8 text (byte {exc.start + 1} of the line is "
                                 f"0x{raw[exc.start]:02x}); save the file as UTF-8") from None
            if not text.strip():
                continue
            yield line, offset, len(raw), _parse_row(path, line, text, index)
            index += 1


def _lines(handle, path: pathlib.Path) -> Iterator[tuple[int, bytes]]:
    """``(offset, text)`` of every line of the binary file ``handle``, line endings removed, as
    ``bytes.splitlines`` splits them (a lone ``\\r`` ends a line too)."""
    offset = 0
    while True:
        try:
            raw = handle.readline()
        except OSError as exc:
            raise file_error(path, exc, _FIX) from None
        if not raw:
            return
        if b"\r" in raw:  # rare: CRLF or old-Mac endings; splitlines knows every case
            position = offset
            for part in raw.splitlines(keepends=True):
                yield position, part.rstrip(b"\r\n")
                position += len(part)
        else:
            yield offset, raw[:-1] if raw.endswith(b"\n") else raw
        offset += len(raw)


def load_prompts(source: str | pathlib.Path) -> list[PromptRecord]:
    """Load and validate a prompt file (see the module docstring for the schema) into a list; peer sources are read
    as they are (:mod:`flowforge.data.peer_prompts`: a ``.txt`` file, ``{"prompt": ..., "image": ...}`` JSONL, a
    dataset directory's train split), with derived ids. Training opens its files as a
    :class:`flowforge.data.prompt_set.PromptSet` instead (byte offsets, a row parsed when drawn: any size).

    Args:
        source: a path (file or dataset directory), or ``"demo:train"`` / ``"demo:eval"`` for the demo prompts.

    Returns:
        The records in file order.

    Raises:
        FileNotFoundError: the file does not exist.
        UserError: (a ``ValueError``) the path is a directory, not a regular file (``/dev/null``, a FIFO), or
            cannot be read (a symlink loop, no permission), naming it and the cause.
        ValueError: a row is invalid or not UTF-8 text (the message names the file, the 1-based line number and
            the field), a ``sample_id`` repeats (naming both lines), or the file holds no rows.
    """
    path = open_prompt_file(source)
    records: list[PromptRecord] = []
    first_line: dict[str, int] = {}
    for line, _, _, record in scan_rows(path):
        if record.sample_id in first_line:
            raise repeated_id_error(path, line, record.sample_id, first_line[record.sample_id])
        first_line[record.sample_id] = line
        records.append(record)
    if not records:
        raise ValueError(f"{path}: holds no prompt rows")
    return records


def repeated_id_error(path: pathlib.Path, line: int, sample_id: str, first: int) -> ValueError:
    """The error of a ``sample_id`` on ``line`` that line ``first`` already used."""
    return _row_error(path, line, "metadata.sample_id", f"{sample_id!r} repeats the one on line {first}; ids must "
                                                        "be unique")


def check_task(records: Sequence[PromptRecord], task: str, source: str) -> None:
    """Every record of ``source`` must fit ``model.task``: an image task (i2v / i2i) needs records of exactly that
    task (each with its image); a text task takes t2i / t2v records (an image would be silently ignored).
    ``records`` with a ``tasks`` array (:class:`flowforge.data.prompt_set.PromptSet`) are checked on it, unparsed.

    Raises:
        ValueError: naming the first disagreeing record and the allowed tasks.
    """
    allowed = [task] if task in IMAGE_TASKS else [t for t in TASKS if t not in IMAGE_TASKS]
    tasks = getattr(records, "tasks", None)
    rows = range(len(records)) if tasks is None else [int(i) for i in np.flatnonzero(~np.isin(tasks, allowed))[:1]]
    for i in rows:
        record = records[i]
        if record.task not in allowed:
            raise ValueError(f"{source}: record {record.sample_id!r} has metadata.task={record.task!r} but "
                             f"model.task={task!r} needs records with metadata.task in {allowed}")


def check_condition_images(records: list[PromptRecord], limit: int | None, source: str) -> None:
    """Every image-task record of ``source`` names at most ``limit`` condition images (the adapter's
    ``max_condition_images``; ``None``: no limit, as the multi-image pipelines have none).

    Raises:
        ValueError: naming the first record over the limit, its count and the limit.
    """
    tasks = getattr(records, "tasks", None)  # a PromptSet knows every row's task without parsing it
    if limit is None or (tasks is not None and not np.isin(tasks, list(IMAGE_TASKS)).any()):
        return
    for record in records:
        if record.task in IMAGE_TASKS and (n := len(condition_images(record.metadata))) > limit:
            raise ValueError(f"{source}: record {record.sample_id!r} lists {n} condition images in metadata.images but "
                             f"this model takes at most {limit} (model.adapter's max_condition_images)")
