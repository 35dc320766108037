"""Where every parameter of a loaded world model came from, and the protection of the source checkpoint.

A world model is usually assembled: a video backbone from one checkpoint, world-model modules (state, coupling,
tokenizer) that may be new. Loading therefore records, for every tensor of the model's state dict, one
:class:`ProvenanceRow`:

===============  ===================================================================================================
status           meaning
===============  ===================================================================================================
``loaded``       read from the checkpoint (shape checked)
``initialised``  absent from the checkpoint, freshly initialised because its module is listed in ``allow_init``
``missing``      absent from the checkpoint and not allowed to be initialised: loading is refused
``unexpected``   in the checkpoint but not in the model: loading is refused (a different architecture)
``mismatched``   in both with different shapes: loading is refused
===============  ===================================================================================================

Source protection: the checkpoint file is opened read-only (``"rb"``), its bytes are hashed (sha256) and parsed from
the same buffer, and its size and mtime are recorded before and after the read (a change in between is refused).
:func:`check_outside_sources` refuses an output path that overlaps a source (resolved with ``realpath``: equal, inside
the source's directory, or containing it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

from torch import Tensor, nn

STATUSES = ("loaded", "initialised", "missing", "unexpected", "mismatched")
REFUSED = ("missing", "unexpected", "mismatched")


class ProvenanceError(ValueError):
    """A checkpoint that would leave a module randomly initialised (or does not fit the model)."""


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """A checkpoint file as it was read."""

    path: str  # as given
    realpath: str  # os.path.realpath
    sha256: str  # of the bytes read
    size: int  # bytes
    mtime_ns: int  # os.stat st_mtime_ns


@dataclasses.dataclass(frozen=True)
class ProvenanceRow:
    """Provenance of one state-dict entry."""

    name: str  # state-dict key
    shape: tuple[int, ...]  # the model's shape (the checkpoint's for "unexpected")
    status: str  # one of STATUSES
    source: str | None  # checkpoint realpath (None when not read from one)
    sha256: str | None  # the checkpoint's sha256
    note: str  # why


def read_source(path: str | Path) -> tuple[SourceFile, dict[str, Tensor]]:
    """Read a safetensors checkpoint read-only: ``(record, tensors)``, the tensors parsed from the hashed bytes.

    Raises:
        FileNotFoundError: no such file. RuntimeError: the file changed (size / mtime) while it was read.
    """
    from safetensors.torch import load

    real = os.path.realpath(path)
    before = os.stat(real)
    with open(real, "rb") as fh:
        data = fh.read()
        after = os.fstat(fh.fileno())
    if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns) or len(data) != after.st_size:
        raise RuntimeError(f"{real} changed while it was read (size / mtime); refusing to load it")
    record = SourceFile(path=str(path), realpath=real, sha256=hashlib.sha256(data).hexdigest(), size=after.st_size,
                        mtime_ns=after.st_mtime_ns)
    return record, load(data)


def _allowed(name: str, prefixes: Sequence[str]) -> str | None:
    for prefix in prefixes:
        if name == prefix or name.startswith(prefix + "."):
            return prefix
    return None


def provenance_rows(model: nn.Module, tensors: Mapping[str, Tensor], source: SourceFile,
                    allow_init: Sequence[str] = ()) -> list[ProvenanceRow]:
    """One row per key of ``model.state_dict()`` and per unexpected checkpoint key (model order, then checkpoint
    order). ``allow_init`` lists exact module paths (``"latent_state_rollout"``, ``"blocks.3.coupling"``) whose
    parameters may be absent from the checkpoint."""
    rows = []
    state = model.state_dict()
    for name, value in state.items():
        shape = tuple(value.shape)
        if name in tensors:
            got = tuple(tensors[name].shape)
            if got != shape:
                rows.append(ProvenanceRow(name, shape, "mismatched", source.realpath, source.sha256,
                                          f"checkpoint shape {got}"))
            else:
                rows.append(ProvenanceRow(name, shape, "loaded", source.realpath, source.sha256, "from checkpoint"))
            continue
        prefix = _allowed(name, allow_init)
        if prefix is not None:
            rows.append(ProvenanceRow(name, shape, "initialised", None, None,
                                      f"not in checkpoint; fresh init allowed by allow_init {prefix!r}"))
        else:
            rows.append(ProvenanceRow(name, shape, "missing", None, None,
                                      "not in checkpoint and its module is not in allow_init"))
    for name, value in tensors.items():
        if name not in state:
            rows.append(ProvenanceRow(name, tuple(value.shape), "unexpected", source.realpath, source.sha256,
                                      "in checkpoint, not in the model"))
    return rows


def module_of(name: str, depth: int = 2) -> str:
    """The first ``depth`` components of a parameter name (``blocks.3.coupling.q.weight`` -> ``blocks.3``)."""
    return ".".join(name.split(".")[:depth])


def format_table(rows: Sequence[ProvenanceRow], sources: Sequence[SourceFile] = ()) -> str:
    """A readable summary: each source (path, sha256, size, mtime), then per top-level module the count of
    parameters in each status, then every refused row in full."""
    lines = [f"source {s.realpath}  sha256={s.sha256}  size={s.size}  mtime_ns={s.mtime_ns}" for s in sources]
    counts: dict[str, Counter] = {}
    for row in rows:
        counts.setdefault(module_of(row.name, 1), Counter())[row.status] += 1
    lines.append(f"{'module':<28}" + "".join(f"{s:>13}" for s in STATUSES))
    for module, c in counts.items():
        lines.append(f"{module:<28}" + "".join(f"{c.get(s, 0):>13}" for s in STATUSES))
    lines += [f"  {r.status}: {r.name} {r.shape} ({r.note})" for r in rows if r.status in REFUSED]
    return "\n".join(lines)


def summary_line(rows: Sequence[ProvenanceRow], sources: Sequence[SourceFile] = ()) -> str:
    """One log line: the count of tensors per status and each source's path and sha256 prefix."""
    counts = Counter(r.status for r in rows)
    parts = [f"{counts[s]} {s}" for s in STATUSES if counts.get(s)]
    where = "; ".join(f"{s.realpath} (sha256 {s.sha256[:12]})" for s in sources) or "no checkpoint"
    return f"{len(rows)} tensors: {', '.join(parts) or 'none'} from {where}"


def provenance_record(rows: Sequence[ProvenanceRow], sources: Sequence[SourceFile] = ()) -> dict:
    """JSON-ready provenance: ``{"sources": [...], "tensors": [...]}`` (one dict per :class:`SourceFile` and per
    :class:`ProvenanceRow`, shapes as lists) -- what a run directory and an export keep."""
    return {"sources": [dataclasses.asdict(s) for s in sources],
            "tensors": [{**dataclasses.asdict(r), "shape": list(r.shape)} for r in rows]}


def refuse_unsafe(rows: Sequence[ProvenanceRow], sources: Sequence[SourceFile] = ()) -> None:
    """Raise when any row is missing / unexpected / mismatched.

    Raises:
        ProvenanceError: listing the offending parameters (the full table in the message).
    """
    bad = [r for r in rows if r.status in REFUSED]
    if bad:
        kinds = Counter(r.status for r in bad)
        raise ProvenanceError(f"refusing this checkpoint: {dict(kinds)} parameters would be randomly initialised or "
                              "do not fit the model (list a module in allow_init to initialise it on purpose)\n"
                              + format_table(rows, sources))


def _contains(parent: str, child: str) -> bool:
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def check_outside_sources(output: str | Path, sources: Sequence[SourceFile]) -> None:
    """Refuse writing to ``output`` when it overlaps a source checkpoint (realpaths): the file itself, anything
    inside the source's directory, or a directory that contains the source.

    Raises:
        ValueError: ``output`` overlaps a source (both paths named).
    """
    out = os.path.realpath(output)
    for source in sources:
        directory = os.path.dirname(source.realpath)
        if _contains(directory, out) or _contains(out, source.realpath):
            raise ValueError(f"output {out} overlaps the source checkpoint {source.realpath} (read-only); "
                             "write somewhere else")
