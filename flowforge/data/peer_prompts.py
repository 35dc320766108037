"""Peer prompt sources read as they are: what flow_grpo / DiffusionNFT / Flow-Factory datasets ship.

- a ``.txt`` file: one prompt a line (blank lines skipped), task ``t2i``;
- a JSONL row without ``metadata``: ``{"prompt": ..., "image": ...}`` (``image`` optional, or ``images``: a list of
  reference images for a multi-image edit; every other key is kept as metadata for the scorers, e.g. geneval's
  ``tag`` / ``include``), task ``i2i`` when it names an image, else ``t2i``;
- a dataset directory (Flow-Factory / flow_grpo layout): its train split, the first of ``train.jsonl``,
  ``train_metadata.jsonl``, ``train.txt`` found; name ``DIR/test.txt`` (or ``test.jsonl``) for the held-out split.

Ids are derived deterministically from the row: ``sample_id = "<stem>-<index>-<sha256(line)[:12]>"`` (index the
0-based row number among non-blank rows), so the same file gives the same ids on every load and machine, and a
repeated line still gets a unique id. Rows in flowforge's own schema (with ``metadata``) are parsed by
:func:`flowforge.data.prompts.load_prompts` unchanged.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Any

TRAIN_FILES = ("train.jsonl", "train_metadata.jsonl", "train.txt")
"""A dataset directory's train split, in order of preference."""


def derived_id(path: pathlib.Path, index: int, text: str) -> str:
    """The deterministic ``sample_id`` of non-blank row ``index`` (0-based) of ``path`` whose text is ``text``."""
    return f"{path.stem}-{index}-{hashlib.sha256(text.encode('utf-8')).hexdigest()[:12]}"


def dataset_file(directory: pathlib.Path) -> pathlib.Path | None:
    """The train-split file of a dataset directory (``TRAIN_FILES``), or ``None`` when it holds none."""
    return next((directory / name for name in TRAIN_FILES if (directory / name).is_file()), None)


def txt_row(path: pathlib.Path, index: int, text: str) -> dict[str, Any]:
    """A ``.txt`` line as a unified-schema row (``t2i``)."""
    prompt = text.strip()
    return {"prompt": prompt, "metadata": {"task": "t2i", "sample_id": derived_id(path, index, prompt)}}


def peer_row(path: pathlib.Path, index: int, text: str, row: dict[str, Any]) -> dict[str, Any]:
    """A JSONL row without ``metadata`` as a unified-schema row: ``image`` / ``images`` (if any) move into the metadata
    and make the task ``i2i``; other keys (but ``prompt``) are kept as metadata."""
    extra = {k: v for k, v in row.items() if k != "prompt"}
    task = "i2i" if extra.get("image") or extra.get("images") else "t2i"
    return {"prompt": row.get("prompt"), "metadata": {**extra, "task": task,
                                                      "sample_id": derived_id(path, index, text.strip())}}


def unified_row(path: pathlib.Path, index: int, text: str) -> Any:
    """Non-blank line ``text`` (row ``index``, 0-based among non-blank rows) of prompt file ``path`` as every reader
    sees it (training's :func:`flowforge.data.prompts.load_prompts` and the data tools' ``inspect`` / ``curate``):
    a ``.txt`` line is :func:`txt_row`; otherwise the line is JSON, and an object without ``metadata`` is
    :func:`peer_row`. Anything else (a unified-schema row, a list, a number) is returned as parsed, for the caller's
    schema checks.

    Raises:
        json.JSONDecodeError: a line of a non-``.txt`` file is not JSON.
    """
    if path.suffix == ".txt":
        return txt_row(path, index, text)
    row = json.loads(text)
    if isinstance(row, dict) and "metadata" not in row:
        return peer_row(path, index, text, row)
    return row
