"""A prompt file held as byte offsets: any number of rows at a few bytes each, a row parsed when it is drawn.

:func:`open_prompts` reads the file once, line by line, and validates every row exactly as
:func:`flowforge.data.prompts.load_prompts` does (schema, images, unique ``sample_id``), but keeps only

==============  ===========  ==========================================================================
array           dtype        meaning
==============  ===========  ==========================================================================
``offsets``     int64 [N]    byte offset of row ``i``'s text in the file
``lengths``     int32 [N]    its length in bytes (without the line ending)
``task_codes``  int8 [N]     ``TASKS.index(metadata.task)``: ``model.task`` checks need no parsing
==============  ===========  ==========================================================================

13 bytes a row (13 MB for a million rows) instead of a parsed record (about 1 KB of Python objects). Uniqueness of
``sample_id`` is checked on 64-bit hashes sorted with numpy (only rows whose hashes collide are parsed again).
``set[i]`` reads row ``i`` again (``os.pread`` on a descriptor held open since the scan, so a file replaced by a
rename keeps serving the rows it was opened with) and parses it; a file modified in place since the scan is refused.
"""

from __future__ import annotations

import array
import os
import pathlib
import weakref
from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np

from flowforge.data.prompts import (TASKS, PromptRecord, _parse_row, open_prompt_file, repeated_id_error,
                                    scan_rows)

__all__ = ["PromptSet", "open_prompts"]


class PromptSet(Sequence[PromptRecord]):
    """The validated rows of one prompt file, parsed on access (see the module docstring). Read-only.

    ``set[i]`` is the :class:`PromptRecord` of row ``i`` (0-based among non-blank rows, as
    :func:`~flowforge.data.prompts.load_prompts` numbers them); ``set[a:b]`` a list of them. :attr:`prompts` is the
    prompt texts as a lazy sequence.

    Raises (on access):
        RuntimeError: the file was changed in place since it was opened (its rows may have moved).
    """

    def __init__(self, path: pathlib.Path, offsets: np.ndarray, lengths: np.ndarray, task_codes: np.ndarray,
                 fd: int) -> None:
        self.path = path
        self.offsets = offsets  # [N] int64
        self.lengths = lengths  # [N] int32
        self.task_codes = task_codes  # [N] int8
        self._fd = fd
        info = os.fstat(fd)
        self._identity = (info.st_size, info.st_mtime_ns)
        weakref.finalize(self, os.close, fd)

    def __len__(self) -> int:
        return int(self.offsets.shape[0])

    @overload
    def __getitem__(self, index: int) -> PromptRecord: ...

    @overload
    def __getitem__(self, index: slice) -> list[PromptRecord]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._record(i) for i in range(*index.indices(len(self)))]
        i = int(index)
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} is outside the {len(self)} rows of {self.path}")
        return self._record(i % len(self))

    def __iter__(self) -> Iterator[PromptRecord]:
        return (self._record(i) for i in range(len(self)))

    @property
    def prompts(self) -> Sequence[str]:
        """The prompt text of every row, read on access (a sequence of ``len(self)`` strings)."""
        return _Prompts(self)

    @property
    def tasks(self) -> np.ndarray:
        """``[N]`` str: ``metadata.task`` of every row."""
        return np.asarray(TASKS)[self.task_codes]

    def _text(self, i: int) -> str:
        info = os.fstat(self._fd)
        if (info.st_size, info.st_mtime_ns) != self._identity:
            raise RuntimeError(f"{self.path} was changed since it was opened (its rows were indexed by byte offset); "
                               "write a new file (or replace this one by a rename) and restart the run")
        return os.pread(self._fd, int(self.lengths[i]), int(self.offsets[i])).decode("utf-8")

    def _record(self, i: int) -> PromptRecord:
        return _parse_row(self.path, 0, self._text(i), i, check_image=False)


class _Prompts(Sequence[str]):
    """The prompt texts of a :class:`PromptSet`, each parsed when asked for."""

    def __init__(self, rows: PromptSet) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self._rows[index].prompt


def open_prompts(source: str | pathlib.Path) -> PromptSet:
    """Scan and validate a prompt source into a :class:`PromptSet` (the same sources, checks and errors as
    :func:`flowforge.data.prompts.load_prompts`, with no record kept in memory).

    Raises:
        FileNotFoundError, UserError, ValueError: as :func:`~flowforge.data.prompts.load_prompts` (a repeated
            ``sample_id`` is reported at its earliest repeat, naming both lines, after the other row checks).
    """
    path = open_prompt_file(source)
    offsets, lengths, codes, hashes = array.array("q"), array.array("i"), array.array("b"), array.array("q")
    for _, offset, length, record in scan_rows(path):
        offsets.append(offset)
        lengths.append(length)
        codes.append(TASKS.index(record.task))
        hashes.append(hash(record.sample_id))  # this process's str hash: only compared within this scan
    if not offsets:
        raise ValueError(f"{path}: holds no prompt rows")
    fd = os.open(path, os.O_RDONLY)
    rows = PromptSet(path, np.frombuffer(offsets, dtype=np.int64), np.frombuffer(lengths, dtype=np.int32),
                     np.frombuffer(codes, dtype=np.int8), fd)
    _check_unique_ids(rows, np.frombuffer(hashes, dtype=np.int64))
    return rows


def _check_unique_ids(rows: PromptSet, hashes: np.ndarray) -> None:
    """Raise :func:`~flowforge.data.prompts.repeated_id_error` for the earliest row whose ``sample_id`` an earlier
    row holds; only rows of colliding hashes are parsed."""
    order = np.argsort(hashes, kind="stable")
    ordered = hashes[order]
    same = np.flatnonzero(ordered[1:] == ordered[:-1])
    if same.size == 0:
        return
    suspects = np.unique(np.concatenate([order[same], order[same + 1]]))  # file order
    first: dict[str, int] = {}
    for i in suspects.tolist():
        sample_id = rows[i].sample_id
        if sample_id in first:
            lines = _line_numbers(rows, [first[sample_id], i])
            raise repeated_id_error(rows.path, lines[1], sample_id, lines[0])
        first[sample_id] = i


def _line_numbers(rows: PromptSet, indices: list[int]) -> list[int]:
    """1-based line numbers of rows ``indices`` (scanned again: only for an error message)."""
    wanted = {int(rows.offsets[i]): i for i in indices}
    found = {wanted[offset]: line for line, offset, _, _ in scan_rows(rows.path) if offset in wanted}
    return [found[i] for i in indices]
