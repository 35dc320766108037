"""Rows of the unified prompt schema as the data tools see them: validation that lists every problem, media paths,
the content hash used for dedup and leakage, the split key, and the safe JSONL writer.

The schema is :mod:`flowforge.data.prompts`'s (``{"prompt": str, "metadata": {"task", "sample_id", ...}}``); the
data tools add two things to it:

**Media.** ``metadata.image``, ``metadata.video`` and ``metadata.audio`` name media files, each a path or a list of
paths, relative to the JSONL file's directory or absolute (as :func:`flowforge.data.prompts.load_prompts` resolves
``image``). An image-conditioned task (``i2i``, ``i2v``) needs exactly one ``image`` path or a non-empty ``images``
list (a multi-image edit's reference images, in order; not both). A video is a file or a directory of frame
images; an audio entry a sound file (a WAV decodes in ``inspect --decode-media``). ``audio`` is carried for
audio-conditioned tasks: it is validated, checked, deduplicated and kept like the other media, but no built-in adapter
consumes it yet (``LTX2Pipeline``, the one audio-video family, has no audio-conditioned mode: the ``ltx2`` adapter
generates the sound itself).

**Placeholders.** A prompt may mark where its media go with ``<image>`` / ``<video>`` / ``<audio>``. For each kind the
prompt holds either no placeholder (the media are conditioning inputs, as ``i2i`` / ``i2v`` use ``metadata.image``) or
exactly one per listed file of that kind; any other count is a problem.

**Content hash** (dedup in ``curate``, leakage in ``inspect``)::

    content_hash = sha256(json([normalize(prompt), sorted(media paths, each made absolute and normalised)]))
    normalize(p) = casefold(collapse runs of whitespace to one space(strip(NFC(p))))

so two rows with the same words (up to case, Unicode composition and spacing) and the same media files are one
content, wherever the files that list them live. Paths are normalised lexically (``os.path.normpath``), not through
symlinks, so the hash does not depend on what exists on disk.

**Split key**: ``int(sha256("flowforge-split\\0" + sample_id), 16)``; ``curate`` orders records by it.
"""

from __future__ import annotations

import hashlib
import json
import os
import unicodedata
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from flowforge.data.peer_prompts import TRAIN_FILES, unified_row
from flowforge.data.prompts import IMAGE_TASKS, TASKS, prompt_file
from flowforge.runtime.durable import atomic_write
from flowforge.runtime.errors import UserError, file_error

MEDIA_KEYS = ("image", "images", "video", "audio")
"""Metadata keys that name media files (a path or a list of paths; ``images``: a list, a multi-image edit's
reference images, of kind ``image``)."""

PLACEHOLDERS = {"image": "<image>", "video": "<video>", "audio": "<audio>"}
"""The prompt placeholder of each media kind."""

TOP_LEVEL_KEYS = ("prompt", "metadata")


def normalize_prompt(prompt: str) -> str:
    """The prompt as the content hash sees it: NFC, whitespace runs collapsed to one space, stripped, casefolded."""
    return " ".join(unicodedata.normalize("NFC", prompt).split()).casefold()


def count_words(prompt: str) -> int:
    """Whitespace-separated words of ``prompt``, ``<image>`` / ``<video>`` / ``<audio>`` placeholders not counted."""
    for tag in PLACEHOLDERS.values():
        prompt = prompt.replace(tag, " ")
    return len(prompt.split())


def media_paths(metadata: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(kind, path)`` of every media file ``metadata`` lists, in key then list order (kinds: :data:`MEDIA_KEYS`).
    Values that are not a path or a list of paths are skipped (:func:`row_problems` reports them)."""
    found = []
    for key in MEDIA_KEYS:
        value = metadata.get(key)
        values = [value] if isinstance(value, str) else value if isinstance(value, list) else []
        found += [("image" if key == "images" else key, v) for v in values if isinstance(v, str) and v]
    return found


def absolute_media(base_dir: Path, path: str) -> str:
    """``path`` (relative to ``base_dir`` or absolute) as a normalised absolute path, symlinks not followed."""
    return os.path.normpath(os.path.join(os.path.abspath(base_dir), path))


def content_hash(prompt: str, absolute_paths: list[str]) -> str:
    """sha256 hex of the normalised prompt and the sorted absolute media paths (module docstring)."""
    payload = json.dumps([normalize_prompt(prompt), sorted(absolute_paths)], ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def split_key(sample_id: str) -> int:
    """The record's position key for the train / eval split: a 256-bit integer from sha256 of the ``sample_id``."""
    return int(hashlib.sha256(b"flowforge-split\0" + sample_id.encode("utf-8")).hexdigest(), 16)


def _media_value_problem(key: str, value: Any, task: Any) -> str | None:
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p for p in paths):
        return f"field 'metadata.{key}' must be a path or a non-empty list of paths, got {value!r}"
    if key == "image" and task in IMAGE_TASKS and not isinstance(value, str):
        return (f"field 'metadata.image' must be one path for task {task!r} (its condition image; several: "
                f"'metadata.images'), got {value!r}")
    if key == "images" and not isinstance(value, list):
        return f"field 'metadata.images' must be a non-empty list of paths, got {value!r}"
    return None


def _placeholder_problems(prompt: str, metadata: Mapping[str, Any]) -> list[str]:
    listed = media_paths(metadata)
    problems = []
    for kind, tag in PLACEHOLDERS.items():
        marks, files = prompt.count(tag), sum(1 for k, _ in listed if k == kind)
        if marks and marks != files:
            problems.append(f"prompt has {marks} {tag} placeholder{'s' * (marks > 1)} but metadata lists "
                            f"{files or 'no'} {kind}{'s' * (files != 1)}; give one {tag} per {kind} (or none)")
    return problems


def row_problems(row: Any) -> list[str]:
    """Every schema problem of one parsed JSONL row (empty when valid); media existence is not checked here.

    Checks: a JSON object with only ``prompt`` / ``metadata``; ``prompt`` a non-empty string; ``metadata`` an object
    with ``task`` in :data:`~flowforge.data.prompts.TASKS` and a non-empty string ``sample_id``; media values (module
    docstring); ``image`` present for ``i2i`` / ``i2v``; placeholders consistent with the media listed.
    """
    if not isinstance(row, dict):
        return [f"each line must be a JSON object, got {type(row).__name__}"]
    problems = [f"top-level key {key!r} is not allowed; top-level keys are {list(TOP_LEVEL_KEYS)}"
                for key in row if key not in TOP_LEVEL_KEYS]
    prompt, metadata = row.get("prompt"), row.get("metadata")
    if not isinstance(prompt, str) or not prompt.strip():
        problems.append(f"field 'prompt' must be a non-empty string, got {prompt!r}")
    if not isinstance(metadata, dict):
        return problems + [f"field 'metadata' must be an object with 'task' and 'sample_id', got {metadata!r}"]
    task, sample_id = metadata.get("task"), metadata.get("sample_id")
    if task not in TASKS:
        problems.append(f"field 'metadata.task' must be one of {list(TASKS)}, got {task!r}")
    if not isinstance(sample_id, str) or not sample_id:
        problems.append(f"field 'metadata.sample_id' must be a non-empty string, got {sample_id!r}")
    for key in MEDIA_KEYS:
        if key in metadata and (problem := _media_value_problem(key, metadata[key], task)):
            problems.append(problem)
    if task in IMAGE_TASKS and "image" not in metadata and "images" not in metadata:
        problems.append(f"field 'metadata.image' is required for task {task!r} (the condition image's path; or "
                        "'metadata.images', a list of paths)")
    if "image" in metadata and "images" in metadata:
        problems.append("fields 'metadata.image' and 'metadata.images' are both given; give one")
    if isinstance(prompt, str):
        problems += _placeholder_problems(prompt, metadata)
    return problems


def media_missing(kind: str, path: str) -> bool:
    """Whether the media file at absolute ``path`` is absent: an image or audio must be a file, a video a file or
    a directory (of frames)."""
    return not (os.path.isfile(path) or (kind == "video" and os.path.isdir(path)))


def read_lines(path: Path) -> Iterator[tuple[int, str | None, str | None]]:
    """``(line number, text, problem)`` for every non-blank line of ``path`` (1-based); ``text`` is None and
    ``problem`` says why when the line is not UTF-8. A UTF-8 byte-order mark on line 1 is dropped.

    Raises:
        UserError: the file cannot be opened or read.
    """
    try:
        with open(path, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                try:
                    text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
                except UnicodeDecodeError as exc:
                    yield number, None, f"is not UTF-8 text (byte {exc.start})"
                    continue
                if text.strip():
                    yield number, text, None
    except OSError as exc:
        raise file_error(path, exc, "check the path") from exc


def parse_line(text: str) -> tuple[Any, str | None]:
    """``(value, None)`` for a line of valid JSON, ``(None, problem)`` otherwise."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON ({exc.msg} at column {exc.colno})"


def parse_row(path: Path, index: int, text: str) -> tuple[Any, str | None]:
    """``(row, None)`` for non-blank line ``text`` (row ``index``, 0-based) of prompt file ``path`` read as training
    reads it (:func:`flowforge.data.peer_prompts.unified_row`: a ``.txt`` line, a JSONL row without ``metadata``,
    a unified-schema row), ``(None, problem)`` for a line that is not JSON."""
    try:
        return unified_row(path, index, text), None
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON ({exc.msg} at column {exc.colno})"


def read_rows(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    """``(line number, row, problem)`` of every non-blank line of prompt file ``path`` (:func:`read_lines` +
    :func:`parse_row`): ``row`` is None and ``problem`` says why for a line that is not UTF-8 or not JSON.

    Raises:
        UserError: the file cannot be opened or read.
    """
    for index, (number, text, problem) in enumerate(read_lines(path)):
        row, problem = (None, problem) if problem else parse_row(path, index, text)
        yield number, row, problem


def input_file(source: str | Path, what: str) -> Path:
    """The prompt file ``source`` names, as training resolves it (:func:`flowforge.data.prompts.prompt_file`:
    ``demo:train``, a dataset directory's train split).

    Raises:
        UserError: it is not a file (``what`` names the option, e.g. ``--train``), or not a known demo set.
    """
    try:
        path = prompt_file(source)
    except ValueError as exc:
        raise UserError(what, str(exc), "give a prompt file") from None
    if not path.is_file():
        raise UserError(path, "is not a file", "give a .txt (one prompt a line) or JSONL prompt file, or a dataset "
                                               "directory with " + " / ".join(TRAIN_FILES))
    return path


def rebase_media(metadata: dict[str, Any], src_dir: Path, dst_dir: Path) -> dict[str, Any]:
    """``metadata`` with every relative media path rewritten from ``src_dir`` to ``dst_dir`` (POSIX separators), so
    a file written into ``dst_dir`` names the same media; absolute paths, and everything when the two directories
    are the same, are kept as they are. Returns a new dict; key order is kept."""
    src, dst = os.path.abspath(src_dir), os.path.abspath(dst_dir)
    if src == dst:
        return dict(metadata)

    def move(path: str) -> str:
        if os.path.isabs(path):
            return path
        try:
            return Path(os.path.relpath(os.path.join(src, path), dst)).as_posix()
        except ValueError:  # another drive (Windows): no relative path exists
            return os.path.join(src, path)

    out = dict(metadata)
    for key in MEDIA_KEYS:
        value = out.get(key)
        if isinstance(value, str):
            out[key] = move(value)
        elif isinstance(value, list):
            out[key] = [move(v) if isinstance(v, str) else v for v in value]
    return out


def dumps_row(row: Mapping[str, Any]) -> str:
    """One JSONL line (with its newline), UTF-8 text as is, keys in their given order."""
    return json.dumps(row, ensure_ascii=False) + "\n"


def check_output(path: Path, overwrite: bool) -> None:
    """Refuse an output path that is a symlink (always), a directory, or an existing file without ``overwrite``.

    Raises:
        UserError: naming ``path``.
    """
    if path.is_symlink():
        raise UserError(path, "is a symbolic link, and the data tools never write through one",
                        "give the real file's path or remove the link")
    if path.is_dir():
        raise UserError(path, "is a directory", "give a file path")
    if path.exists() and not overwrite:
        raise UserError(path, "already exists", "pass --overwrite to replace it")


def write_text(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically: a fresh temporary in the same directory, opened without
    following links, fsynced and renamed over ``path`` (``os.replace`` swaps the name: a link there is replaced,
    never followed). Call :func:`check_output` first; missing parent directories are created."""
    data = text.encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path) -> None:
        tmp.unlink(missing_ok=True)  # a stray temporary of an earlier crash (or a planted link) is removed, not used
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)

    atomic_write(path, write)
