"""Verified weight sync: a manifest first, the weights streamed in buckets, verified, then committed.

One sync moves a named set of tensors (the sampling policy's LoRA tensors in ``adapter`` mode, every trained tensor
in ``full`` mode: the transformer's state dict, the trained submodules' entries, plus the LoRA tensors under
``module+lora``) from the trainer into a rollout worker as one transaction:

1. **Manifest** (:class:`SyncManifest`, sent first): the policy version it commits, the mode, the ordered entries
   ``(name, shape, dtype, nbytes)`` (sorted by name), the tensor count, the total bytes, ``layout_sha256`` (sha256
   over the ordered ``name|shape|dtype`` lines) and ``content_sha256`` (sha256 over the bytes of every tensor in
   entry order, native byte order), plus the bucket size.
2. **Buckets**: the byte stream (every tensor's bytes in entry order) cut into ``bucket_bytes`` pieces; bucket ``i``
   must carry exactly ``manifest.bucket_length(i)`` bytes and arrive in order.
3. **Verify** (:meth:`SyncReceiver.verify`): the receiver's own layout (what its transformer holds in this mode)
   has the manifest's layout hash; every bucket arrived whole; the received bytes hash to ``content_sha256``.
4. **Commit** (:meth:`SyncReceiver.commit`): only then are the tensors copied in and the version taken.

Any failure raises :class:`WeightSyncError` and leaves the receiver's weights and version as they were, so the
sender can retry the same version. A sync whose tensors are not the worker's own layout in its mode is refused at
the manifest -- a ``full`` sync of a whole state dict into a transformer holding LoRA layers (the state dict of a
LoRA-wrapped module names its base weights ``...base_layer.weight``), an ``adapter`` sync into one without -- so none
is ever half-applied.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

SYNC_MODES = ("adapter", "full")
"""Resolved weight-sync modes: LoRA tensors only, or every tensor of the transformer's state dict."""


class EngineError(RuntimeError):
    """A rollout-engine failure the trainer can recover from by retrying (rebuilding lost workers)."""


class WeightSyncError(EngineError):
    """A weight sync was refused or failed verification; the receiver kept its previous weights and version."""


class WorkerLostError(EngineError):
    """A rollout worker process ended (killed, crashed) while the trainer needed it."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a sync."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    nbytes: int


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def entries_of(tensors: Mapping[str, torch.Tensor]) -> tuple[TensorEntry, ...]:
    """The sync entries of ``tensors``, sorted by name (the order every sync uses on both sides)."""
    return tuple(TensorEntry(name, tuple(int(s) for s in t.shape), _dtype_name(t.dtype), t.numel() * t.element_size())
                 for name, t in sorted(tensors.items()))


def layout_sha256(entries: tuple[TensorEntry, ...]) -> str:
    """sha256 (hex) over the ordered ``name|shape|dtype`` lines of ``entries``."""
    text = "".join(f"{e.name}|{list(e.shape)}|{e.dtype}\n" for e in entries)
    return hashlib.sha256(text.encode()).hexdigest()


def _raw(t: torch.Tensor):
    """The bytes of ``t`` (native byte order, C order) as a buffer, from a CPU copy."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


@dataclass(frozen=True)
class SyncManifest:
    """What a sync will deliver, sent before any bucket (see the module docstring)."""

    version: int  # policy version committed on success
    mode: str  # "adapter" | "full"
    entries: tuple[TensorEntry, ...]  # sorted by name
    total_bytes: int
    layout_sha256: str
    content_sha256: str
    bucket_bytes: int

    @property
    def count(self) -> int:
        return len(self.entries)

    @property
    def num_buckets(self) -> int:
        return -(-self.total_bytes // self.bucket_bytes)

    def bucket_length(self, index: int) -> int:
        """Bytes bucket ``index`` must carry (all full but the last)."""
        return min(self.bucket_bytes, self.total_bytes - index * self.bucket_bytes)


def make_manifest(tensors: Mapping[str, torch.Tensor], *, version: int, mode: str, bucket_bytes: int) -> SyncManifest:
    """The manifest of syncing ``tensors`` (one pass over their bytes for the content hash).

    Raises:
        ValueError: ``mode`` not in :data:`SYNC_MODES`, no tensors, or ``bucket_bytes < 1``.
    """
    if mode not in SYNC_MODES:
        raise ValueError(f"weight-sync mode {mode!r} is not one of {list(SYNC_MODES)}")
    if not tensors:
        raise ValueError("a weight sync needs at least one tensor")
    if bucket_bytes < 1:
        raise ValueError(f"bucket size {bucket_bytes} bytes must be >= 1")
    entries = entries_of(tensors)
    content = hashlib.sha256()
    for e in entries:
        content.update(_raw(tensors[e.name]))
    return SyncManifest(version=version, mode=mode, entries=entries, total_bytes=sum(e.nbytes for e in entries),
                        layout_sha256=layout_sha256(entries), content_sha256=content.hexdigest(),
                        bucket_bytes=int(bucket_bytes))


def iter_buckets(tensors: Mapping[str, torch.Tensor], manifest: SyncManifest) -> Iterator[bytes]:
    """The byte stream of ``tensors`` in the manifest's entry order, cut into ``manifest.bucket_bytes`` pieces; at
    most one bucket is held at a time."""
    size = manifest.bucket_bytes
    pending = bytearray()
    for e in manifest.entries:
        raw = memoryview(_raw(tensors[e.name])).cast("B")
        start = 0
        while start < len(raw):
            take = min(size - len(pending), len(raw) - start)
            pending += raw[start:start + take]
            start += take
            if len(pending) == size:
                yield bytes(pending)
                pending = bytearray()
    if pending:
        yield bytes(pending)


class SyncReceiver:
    """The receiving end of one sync into ``targets`` (the receiver's own tensors in ``mode``, by name).

    ``add`` records the first problem instead of raising, so a sender can stream every bucket without waiting for
    replies; :meth:`verify` raises it.

    Raises (from :meth:`__init__` / :meth:`verify`):
        WeightSyncError: mode or layout mismatch, a bucket out of order or of the wrong length, missing bytes,
            a content hash mismatch.
    """

    def __init__(self, manifest: SyncManifest, targets: Mapping[str, torch.Tensor], mode: str):
        if manifest.mode != mode:
            held = "holds LoRA layers" if mode == "adapter" else "receives every trained tensor"
            raise WeightSyncError(f"{manifest.mode} weight sync of version {manifest.version} refused: the worker "
                                  f"{held} and takes only {mode!r} syncs (rollout.weight_sync must follow "
                                  "lora.trainable)")
        mine = entries_of(targets)
        if layout_sha256(mine) != manifest.layout_sha256 or mine != manifest.entries:
            theirs = {e.name for e in manifest.entries}
            ours = {e.name for e in mine}
            raise WeightSyncError(
                f"weight sync of version {manifest.version}: the manifest's layout ({manifest.count} tensors) does "
                f"not match the worker's ({len(mine)} tensors): not in the manifest {sorted(ours - theirs)[:3]}, not "
                f"in the worker {sorted(theirs - ours)[:3]}, or a shape / dtype differs")
        self.manifest = manifest
        self.targets = dict(targets)
        self.stream = bytearray(manifest.total_bytes)
        self.received = 0  # buckets
        self.offset = 0
        self.digest = hashlib.sha256()
        self.problem: str | None = None

    def add(self, index: int, data: bytes) -> None:
        """Take bucket ``index``; a problem is recorded for :meth:`verify` (the first one only)."""
        if self.problem is not None:
            return
        m = self.manifest
        if index != self.received or index >= m.num_buckets:
            self.problem = f"bucket {index} arrived, expected bucket {self.received} of {m.num_buckets}"
            return
        expected = m.bucket_length(index)
        if len(data) != expected:
            self.problem = f"bucket {index} of {m.num_buckets} holds {len(data)} bytes, expected {expected} (truncated)"
            return
        self.stream[self.offset:self.offset + expected] = data
        self.digest.update(data)
        self.offset += expected
        self.received += 1

    def verify(self) -> dict[str, torch.Tensor]:
        """Check what arrived against the manifest; returns the received tensors by name (copies: entries of
        different dtypes need not be aligned in the stream)."""
        m = self.manifest
        where = f"weight sync of version {m.version}"
        if self.problem is not None:
            raise WeightSyncError(f"{where}: {self.problem}")
        if self.received != m.num_buckets or self.offset != m.total_bytes:
            raise WeightSyncError(f"{where}: {self.received} of {m.num_buckets} buckets ({self.offset} of "
                                  f"{m.total_bytes} bytes) arrived")
        if self.digest.hexdigest() != m.content_sha256:
            raise WeightSyncError(f"{where}: the received bytes' sha256 {self.digest.hexdigest()[:16]}... does not "
                                  f"match the manifest's {m.content_sha256[:16]}...")
        flat = torch.frombuffer(self.stream, dtype=torch.uint8) if m.total_bytes else torch.empty(0, dtype=torch.uint8)
        out, start = {}, 0
        for e in m.entries:
            out[e.name] = flat[start:start + e.nbytes].clone().view(getattr(torch, e.dtype)).reshape(e.shape)
            start += e.nbytes
        return out

    @torch.no_grad()
    def commit(self) -> int:
        """:meth:`verify`, then copy every tensor into its target; returns the committed version."""
        received = self.verify()
        for name, value in received.items():
            self.targets[name].copy_(value)
        return self.manifest.version
