"""Prompt-encoding cache: encode each prompt list once, keep the embeddings on disk (HF ``datasets``).

Text encoders are frozen, so their outputs are a pure function of (encoder, prompts). A run encodes a prompt list of
up to :data:`STREAM_ABOVE` prompts once, up front; later runs (and resumes) load the embeddings from disk and never
need the encoder in memory. A longer list is never encoded whole: :class:`StreamedConditioning` encodes the prompts a
step draws, each alone (a single-prompt entry of the same cache), and keeps recent ones in memory.

Layout of one cache entry, ``<cache_dir>/<fingerprint>/``::

    meta.json           encoder_id, prompt count, dtype, which fields are present
    cond/               datasets.Dataset, one row per prompt: prompt, prompt_embeds, [pooled], [mask]
    negative/           the same for ``Conditioning.negative`` (one row when it is the same for every prompt)

``fingerprint = sha256(json.dumps({"encoder_id": ..., "prompts": [...]}))`` — the encoder id and the *ordered*
prompt list, so a different order, encoder or ``max_length`` is a different entry. Tensors are stored as float32
and cast back to the encoder's dtype on load. An entry is written to a temporary directory and renamed into place,
so an interrupted write is never mistaken for a cache hit.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from flowforge.models.base import Conditioning

_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


def prompts_fingerprint(encoder_id: str, prompts: Sequence[str]) -> str:
    """sha256 hex digest of the encoder id and the ordered prompt list."""
    payload = json.dumps({"encoder_id": encoder_id, "prompts": list(prompts)}, ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def _to_dataset(cond: Conditioning, prompts: Sequence[str] | None):
    import datasets

    columns: dict[str, object] = {"prompt_embeds": cond.prompt_embeds.detach().float().cpu().numpy()}
    if cond.pooled is not None:
        columns["pooled"] = cond.pooled.detach().float().cpu().numpy()
    if cond.mask is not None:
        columns["mask"] = cond.mask.detach().cpu().long().numpy()
    if prompts is not None:
        columns["prompt"] = list(prompts)
    features = {"prompt_embeds": datasets.Array2D(shape=tuple(cond.prompt_embeds.shape[1:]), dtype="float32")}
    if cond.pooled is not None:
        features["pooled"] = datasets.Sequence(datasets.Value("float32"), length=cond.pooled.shape[1])
    if cond.mask is not None:
        features["mask"] = datasets.Sequence(datasets.Value("int64"), length=cond.mask.shape[1])
    if prompts is not None:
        features["prompt"] = datasets.Value("string")
    return datasets.Dataset.from_dict(columns, features=datasets.Features(features))


def _from_dataset(ds, dtype: torch.dtype) -> Conditioning:
    columns = [c for c in ("prompt_embeds", "pooled", "mask") if c in ds.column_names]
    rows = ds.select_columns(columns).with_format("torch")[:]
    embeds = rows["prompt_embeds"].to(dtype)
    pooled = rows["pooled"].to(dtype) if "pooled" in rows else None
    mask = rows["mask"].long() if "mask" in rows else None
    return Conditioning(prompt_embeds=embeds, pooled=pooled, mask=mask)


def _same_rows(cond: Conditioning) -> bool:
    fields = [t for t in (cond.prompt_embeds, cond.pooled, cond.mask) if t is not None]
    return all(bool((t == t[:1]).all()) for t in fields)


@contextlib.contextmanager
def _quiet_datasets():
    """No per-save progress bars (one entry is a handful of rows); restores the previous setting."""
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def save_conditioning(cond: Conditioning, directory: str | Path, *, encoder_id: str,
                      prompts: Sequence[str] | None = None) -> Path:
    """Write ``cond`` (and its ``negative``) to ``directory`` atomically; returns ``directory``.

    An entry that another process completed meanwhile is kept (entries are content-addressed) and this copy dropped.

    Raises:
        FileExistsError: ``directory`` exists without ``meta.json`` (not an entry this cache wrote; left as it is).
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        with _quiet_datasets():
            _to_dataset(cond, prompts).save_to_disk(str(tmp / "cond"))
        negative_broadcast = False
        if cond.negative is not None:
            negative = cond.negative
            negative_broadcast = negative.batch_size > 0 and _same_rows(negative)
            if negative_broadcast:
                negative = negative.index([0])
            with _quiet_datasets():
                _to_dataset(negative, None).save_to_disk(str(tmp / "negative"))
        meta = {
            "encoder_id": encoder_id,
            "num_prompts": cond.batch_size,
            "dtype": str(cond.prompt_embeds.dtype),
            "has_negative": cond.negative is not None,
            "negative_broadcast": negative_broadcast,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        # Two runs that start together may both miss and both write the same content-addressed entry. The lock
        # makes the check and the rename one step: whoever comes second finds a complete entry (the same bytes'
        # meaning: same encoder, same prompts) and drops its own copy. Nothing already there is ever deleted.
        with FileLock(str(directory.parent / f".{directory.name}.lock")):
            if (directory / "meta.json").is_file():
                shutil.rmtree(tmp, ignore_errors=True)
                return directory
            if directory.exists():
                raise FileExistsError(f"{directory} exists but is not a complete encoding cache entry (no meta.json);"
                                      f" move it away or use another cache_dir")
            os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def load_conditioning(directory: str | Path) -> Conditioning:
    """Read a cache entry written by :func:`save_conditioning`.

    Raises:
        FileNotFoundError: ``directory`` holds no complete entry.
    """
    import datasets

    directory = Path(directory)
    meta_file = directory / "meta.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"no encoding cache entry at {directory} (meta.json missing)")
    meta = json.loads(meta_file.read_text())
    dtype = _DTYPES.get(meta["dtype"], torch.float32)
    cond = _from_dataset(datasets.load_from_disk(str(directory / "cond")), dtype)
    negative = None
    if meta["has_negative"]:
        negative = _from_dataset(datasets.load_from_disk(str(directory / "negative")), dtype)
        if meta["negative_broadcast"]:
            negative = negative.index(torch.zeros(cond.batch_size, dtype=torch.long))
    return Conditioning(prompt_embeds=cond.prompt_embeds, pooled=cond.pooled, mask=cond.mask, negative=negative)


def encode_cached(encode_fn: Callable[[Sequence[str]], Conditioning], encoder_id: str, prompts: Sequence[str],
                  cache_dir: str | Path, batch_size: int = 64) -> Conditioning:
    """Conditioning of ``prompts`` (row ``i`` ↔ ``prompts[i]``), from the disk cache when present.

    On a miss, ``encode_fn`` is called on consecutive chunks of ``batch_size`` prompts, the chunks are concatenated,
    written to ``<cache_dir>/<fingerprint>/`` and returned. On a hit ``encode_fn`` is not called at all. Returned
    tensors are on CPU.

    Args:
        encode_fn: e.g. ``adapter.encode``; must be deterministic.
        encoder_id: identifies the encoder and its settings (e.g. ``adapter.encoder_id``).
        prompts: the ordered prompt list (may contain duplicates).
        cache_dir: root directory of the cache.
        batch_size: prompts per ``encode_fn`` call.

    Raises:
        ValueError: empty ``prompts``, ``batch_size < 1``, or ``encode_fn`` returned the wrong number of rows.
    """
    prompts = list(prompts)
    if not prompts:
        raise ValueError("encode_cached needs at least one prompt")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    entry = Path(cache_dir) / prompts_fingerprint(encoder_id, prompts)
    if (entry / "meta.json").is_file():
        return load_conditioning(entry)
    chunks = []
    for start in range(0, len(prompts), batch_size):
        part = prompts[start : start + batch_size]
        cond = encode_fn(part)
        if cond.batch_size != len(part):
            raise ValueError(f"encode_fn returned {cond.batch_size} rows for {len(part)} prompts")
        chunks.append(cond.to("cpu"))
    cond = Conditioning.cat(chunks)
    save_conditioning(cond, entry, encoder_id=encoder_id, prompts=prompts)
    return cond



STREAM_ABOVE = 512
"""Prompt lists longer than this are streamed (:class:`StreamedConditioning`); shorter ones are encoded up front in
chunks of 64, one cache entry for the list (the embedded default's files hold 32-220 prompts: encoded as before).
Why not stream every list: MiniLM's output for a prompt changes in the last bits with the batch it is padded in,
so streaming would change an existing run's numbers."""

STREAM_CACHE_BYTES = 256 * 2**20
"""Memory :class:`StreamedConditioning` keeps recently used prompts' conditioning in (at least one prompt)."""


def encode_prompts(encode_fn: Callable[[Sequence[str]], Conditioning], encoder_id: str, prompts: Sequence[str],
                   cache_dir: str | Path) -> Conditioning | StreamedConditioning:
    """The conditioning of ``prompts``: all of it (:func:`encode_cached`, 64 prompts a call) for up to
    :data:`STREAM_ABOVE` prompts, else a :class:`StreamedConditioning` that encodes rows when they are indexed.
    Both answer ``.index(rows)`` with a :class:`Conditioning` and ``.to(device)``. ``prompts`` is read only at the
    rows used when streamed (e.g. :attr:`flowforge.data.prompt_set.PromptSet.prompts`).

    Raises:
        ValueError: empty ``prompts``.
    """
    if len(prompts) <= STREAM_ABOVE:
        return encode_cached(encode_fn, encoder_id, list(prompts), cache_dir, batch_size=64)
    return StreamedConditioning(encode_fn, encoder_id, prompts, cache_dir)


class StreamedConditioning:
    """The conditioning of a prompt list too long to encode up front: ``index(rows)`` encodes only those rows.

    Each distinct prompt is encoded alone (``encode_fn([prompt])``; through :func:`encode_cached`, so it is a
    single-prompt entry of the on-disk cache, keyed like every entry) and kept in a least-recently-used memory cache
    of about ``max_bytes``. One prompt per call because a text encoder's output can depend in the last bits on the
    batch it is padded in: alone, a prompt's conditioning is the same bits whichever prompts a step drew with it,
    from memory, from disk or encoded again after a resume.

    Args:
        encode_fn, encoder_id, cache_dir: as :func:`encode_cached`.
        prompts: ``[N]`` the prompt texts (read lazily, one row at a time).
        max_bytes: memory budget of the in-memory cache (at least one prompt is kept).
        device: where :meth:`index` returns its rows.
    """

    def __init__(self, encode_fn: Callable[[Sequence[str]], Conditioning], encoder_id: str, prompts: Sequence[str],
                 cache_dir: str | Path, *, max_bytes: int = STREAM_CACHE_BYTES,
                 device: torch.device | str = "cpu") -> None:
        if not len(prompts):
            raise ValueError("StreamedConditioning needs at least one prompt")
        self.encode_fn, self.encoder_id, self.prompts = encode_fn, encoder_id, prompts
        self.cache_dir, self.max_bytes, self.device = Path(cache_dir), int(max_bytes), torch.device(device)
        self._recent: OrderedDict[int, Conditioning] = OrderedDict()  # row -> its [1]-row conditioning (CPU)
        self.encoded = 0  # rows fetched from the encoder or the disk cache (not from memory), for tests and logs

    @property
    def batch_size(self) -> int:
        return len(self.prompts)

    def __len__(self) -> int:
        return self.batch_size

    def to(self, device: torch.device | str | None = None) -> StreamedConditioning:
        """This conditioning answering on ``device`` (rows move when indexed); ``self``, changed."""
        if device is not None:
            self.device = torch.device(device)
        return self

    def index(self, idx: torch.Tensor | Sequence[int]) -> Conditioning:
        """Rows ``idx`` (``[R]`` int64, repeats allowed) as a :class:`Conditioning` on :attr:`device`; each distinct
        row from memory, else from the disk cache, else encoded (and cached).

        Raises:
            IndexError: a row outside ``0..N-1``.
        """
        idx = torch.as_tensor(idx, dtype=torch.long).flatten()
        if idx.numel() and not (0 <= int(idx.min()) and int(idx.max()) < self.batch_size):
            raise IndexError(f"rows {idx.tolist()} are outside 0..{self.batch_size - 1}")
        distinct, inverse = torch.unique(idx, return_inverse=True)
        rows = Conditioning.cat([self._row(i) for i in distinct.tolist()])
        return rows.index(inverse).to(self.device)

    def _row(self, i: int) -> Conditioning:
        if i in self._recent:
            self._recent.move_to_end(i)
            return self._recent[i]
        row = encode_cached(self.encode_fn, self.encoder_id, [self.prompts[i]], self.cache_dir, batch_size=1)
        self.encoded += 1
        self._recent[i] = row
        keep = max(1, self.max_bytes // max(_nbytes(row), 1))
        while len(self._recent) > keep:
            self._recent.popitem(last=False)
        return row


def _nbytes(cond: Conditioning) -> int:
    fields = (cond.prompt_embeds, cond.pooled, cond.mask, cond.image)
    own = sum(t.numel() * t.element_size() for t in fields if t is not None)
    return own + (_nbytes(cond.negative) if cond.negative is not None else 0)


def encode_run_prompts(adapter: Any, records: Mapping[str, Sequence[Any]], cache_dir: str | Path,
                       device: torch.device) -> dict[str, Conditioning | StreamedConditioning]:
    """A run's prompt sets (``{name: records}``, each a PromptSet or a list of records) encoded by ``adapter``
    (``encode`` / ``encoder_id``) through the cache in ``cache_dir``, on ``device``: up to :data:`STREAM_ABOVE`
    prompts at once, a longer set per step (:func:`encode_prompts`). The text encoder is released when nothing
    streams; otherwise it stays loaded for the steps (logged)."""
    out: dict[str, Conditioning | StreamedConditioning] = {}
    for name, rows in records.items():
        prompts = getattr(rows, "prompts", None) or [r.prompt for r in rows]
        out[name] = encode_prompts(adapter.encode, adapter.encoder_id, prompts, Path(cache_dir)).to(device)
    streamed = [name for name, cond in out.items() if isinstance(cond, StreamedConditioning)]
    if streamed:
        logging.getLogger("flowforge").info("%s prompts are encoded per step (more than %d)", " and ".join(streamed),
                                            STREAM_ABOVE)
    else:
        adapter.release_text_encoder()
    return out
