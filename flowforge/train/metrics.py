"""Metrics: scalar reduction, JSONL + tracker sinks, stage timing, group diversity, provenance.

What and why
------------
The loop (docs/architecture.md, "Data flow") produces detached 0-d tensors in its hot paths (losses return
``(loss, metrics)``; no ``.item()`` there). Once per step, :func:`to_scalars` turns the step's whole metric mapping into
Python floats with a single host transfer per device, and :class:`MetricsLogger` appends them to
``<run_dir>/metrics.jsonl`` and the trackers (:mod:`flowforge.train.trackers`). Evaluation results go to
``<run_dir>/eval.jsonl``. :mod:`flowforge.report.run` turns a run directory into ``report.html``.

Metric names are namespaced by the caller: ``train/…``, ``reward/…``, ``perf/…``, ``time/…``, ``eval/…``.

Group diversity
---------------
RL on a narrow reward collapses each group (the ``K`` candidates of one prompt) toward a single image. The collapse is
made visible by the mean pairwise RMS distance inside groups:

.. math::

    \\mathrm{div} = \\frac{1}{|P|} \\sum_{(i, j) \\in P} \\frac{\\lVert x_i - x_j \\rVert_2}{\\sqrt{D}},
    \\qquad P = \\{(i, j) : i < j,\\ g_i = g_j\\}

=========  ===================================================================
``x_i``    image ``i`` flattened to ``D`` elements, pixels in [0, 1]
``g_i``    group id of image ``i`` (same prompt → same id)
``D``      number of elements of one image (``C·H·W``, ``C·F·H·W`` for video)
``P``      all unordered same-group pairs of the batch, pooled over groups
=========  ===================================================================

Dividing by ``sqrt(D)`` makes it a root-mean-square per-element difference in pixel units: 0 for identical images,
``c`` for two images that differ by the constant ``c`` everywhere, at most 1; it does not depend on resolution.

Run-directory files (docs/architecture.md, "The run directory") are named once, in :mod:`flowforge.runtime.run_dir`,
so the writers here and the readers (:mod:`flowforge.report`) agree.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import math
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from flowforge import __version__
from flowforge.report.grids import read_grid_cells
from flowforge.runtime.durable import atomic_write
from flowforge.runtime.run_dir import EVAL_FILE, EVAL_PREFIX, METRICS_FILE, PROVENANCE_FILE
from flowforge.settings.sections import WandbSettings
from flowforge.train.trackers import build_trackers


# --------------------------------------------------------------------------------------------------------------------
# scalars


def to_scalars(metrics: Mapping[str, Tensor | float | int]) -> dict[str, float]:
    """Turn a step's metrics into Python floats: the one place where tensors leave the device.

    All tensor values on one device are stacked and copied to the host together (one synchronisation per device per
    call), so call this once per step, not inside hot loops.

    Args:
        metrics: name → 0-d tensor (any dtype, any device, detached or not) or Python ``float`` / ``int`` / ``bool``.
            NaN and ±inf are kept as they are.

    Returns:
        name → ``float``, in the order of ``metrics``.

    Raises:
        ValueError: a key is not a ``str``, a tensor is not 0-d (the message names the key and its shape), or a value
            is neither a tensor nor a real number.
    """
    out: dict[str, float] = {}
    by_device: dict[torch.device, list[tuple[str, Tensor]]] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise ValueError(f"metric names must be str, got {type(key).__name__} {key!r}")
        if isinstance(value, Tensor):
            if value.dim() != 0:
                raise ValueError(f"metric '{key}' must be a 0-d tensor, got shape {list(value.shape)} "
                                 "(reduce it first, e.g. .mean())")
            out[key] = math.nan  # placeholder keeps the caller's key order
            by_device.setdefault(value.device, []).append((key, value))
        elif isinstance(value, (int, float)):  # bool is an int
            out[key] = float(value)
        elif hasattr(value, "__float__") and not isinstance(value, (str, bytes)):  # numpy scalars
            out[key] = float(value)
        else:
            raise ValueError(f"metric '{key}' must be a 0-d tensor or a real number, got {type(value).__name__}")
    for device, items in by_device.items():
        # float64 keeps integer counters exact; MPS has no float64.
        dtype = torch.float32 if device.type == "mps" else torch.float64
        values = torch.stack([t.detach().to(dtype) for _, t in items]).cpu().tolist()
        for (key, _), v in zip(items, values):
            out[key] = float(v)
    return out


def _json_value(value: float) -> float | None:
    # Strict JSON has no NaN / Infinity; they are written as null (TensorBoard still receives the real value).
    return value if math.isfinite(value) else None


def _check_scalars(scalars: Mapping[str, float], *, prefix: str | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in scalars.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"metric names must be non-empty str, got {key!r}")
        if key == "step":
            raise ValueError("'step' is reserved for the step number; pass it as the step argument")
        if prefix is not None and not key.startswith(prefix):
            raise ValueError(f"eval metric '{key}' must start with '{prefix}' (the caller namespaces its names)")
        if isinstance(value, Tensor) or isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
            raise ValueError(f"metric '{key}' must be a float (use to_scalars for tensors), got {type(value).__name__}")
        out[key] = float(value)
    return out


class MetricsLogger:
    """Append-only sinks for one run: ``metrics.jsonl``, ``eval.jsonl`` (always) and the trackers of
    :mod:`flowforge.train.trackers` (TensorBoard under ``tb/``, W&B).

    Each :meth:`log` / :meth:`log_eval` call writes one line ``{"step": n, "name": value, ...}`` and flushes it (and
    the TensorBoard writer), so a killed run keeps everything logged before the kill. Files are opened in append
    mode: a resumed run continues the same files, and readers (:func:`flowforge.report.run.read_jsonl`) let later lines
    of a repeated step win. Non-finite values are written to JSONL as ``null`` (strict JSON); TensorBoard gets the
    real value. :meth:`log_grid` sends an eval grid and :meth:`log_config` the resolved config to the trackers.

    Only one process per run should own a logger (rank 0 under ``torchrun``).

    Args:
        run_dir: the run directory; created if missing.
        tensorboard: also write TensorBoard event files to ``<run_dir>/tb/`` (read only when ``trackers`` is None).
        trackers: ``metrics.trackers`` names (``jsonl``, ``tensorboard``, ``wandb``); ``None`` = TensorBoard as
            ``tensorboard`` says. JSONL is written either way.
        run_name: the run's name at the trackers that show one (W&B); default the run directory's name.
        wandb: ``metrics.wandb`` (project, name, tags, ... of the W&B run; None: W&B's environment variables).
        purge_step: a resumed run's first step logged again: TensorBoard hides the old events of steps
            ``>= purge_step`` (``SummaryWriter(purge_step=...)``); ``None`` for a new run. W&B continues its run id.

    Raises:
        ValueError / ImportError: as :func:`flowforge.train.trackers.build_trackers`.

    Usage::

        with MetricsLogger(run_dir) as logger:
            logger.log(step, to_scalars(metrics) | timer.scalars())
            logger.log_eval(step, {"eval/digit_eval": 0.9, "eval/diversity": 0.21})
    """

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, trackers: Sequence[str] | None = None,
                 run_name: str | None = None, wandb: WandbSettings | None = None,
                 purge_step: int | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / METRICS_FILE
        self.eval_path = self.run_dir / EVAL_FILE
        self._files: dict[Path, Any] = {}
        names = (("tensorboard",) if tensorboard else ()) if trackers is None else tuple(trackers)
        self._trackers = build_trackers(names, self.run_dir, run_name=run_name or self.run_dir.name, wandb=wandb,
                                        purge_step=purge_step)
        self._closed = False

    def log_grid(self, step: int, png: Path) -> None:
        """Send the eval grid ``png`` of ``step`` to the trackers, captioned from its sidecar
        (:func:`flowforge.report.grids.read_grid_cells`; uncaptioned without one).

        Raises:
            RuntimeError: the logger is closed.
        """
        if self._closed:
            raise RuntimeError("MetricsLogger is closed")
        cells = read_grid_cells(png)
        for tracker in self._trackers:
            tracker.log_grid(step, Path(png), cells)

    def log_config(self, config: Mapping[str, Any], yaml_text: str) -> None:
        """Send the resolved config (nested ``config`` and its YAML ``yaml_text``) to the trackers.

        Raises:
            RuntimeError: the logger is closed.
        """
        if self._closed:
            raise RuntimeError("MetricsLogger is closed")
        for tracker in self._trackers:
            tracker.log_config(config, yaml_text)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """Append ``{"step": step, **scalars}`` to ``metrics.jsonl`` and send each scalar to the trackers.

        Raises:
            ValueError: ``step`` is not a non-negative int, a name is ``"step"`` / empty / not a str, or a value is
                not a real number (tensors go through :func:`to_scalars` first).
            RuntimeError: the logger is closed.
        """
        self._write(self.metrics_path, step, _check_scalars(scalars, prefix=None))

    def log_eval(self, step: int, scalars: Mapping[str, float]) -> None:
        """Append ``{"step": step, **scalars}`` to ``eval.jsonl`` and to TensorBoard.

        Every name must already carry the ``eval/`` prefix (it is used as the TensorBoard tag as is).

        Raises:
            ValueError: as :meth:`log`, or a name without the ``eval/`` prefix.
            RuntimeError: the logger is closed.
        """
        self._write(self.eval_path, step, _check_scalars(scalars, prefix=EVAL_PREFIX))

    def _write(self, path: Path, step: int, scalars: dict[str, float]) -> None:
        if self._closed:
            raise RuntimeError("MetricsLogger is closed")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        record = {"step": step, **{k: _json_value(v) for k, v in scalars.items()}}
        line = json.dumps(record, allow_nan=False)
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = open(path, "a", encoding="utf-8")
        f.write(line + "\n")
        f.flush()
        for tracker in self._trackers:
            tracker.log_scalars(step, scalars)

    def close(self) -> None:
        """Flush and close every sink. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for f in self._files.values():
            f.close()
        self._files.clear()
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------------------------
# timing


class StageTimer:
    """Accumulate wall-clock seconds per named stage.

    ``with timer("sample"): ...`` adds the block's duration to stage ``"sample"`` (repeated blocks of one stage add
    up). :meth:`scalars` returns ``{"time/sample": seconds, ...}`` and resets.

    On an asynchronous device (CUDA) host wall time only measures kernel launches unless the device is synchronised;
    pass ``sync=torch.cuda.synchronize`` to synchronise at each block's start and end (this costs throughput, so it
    is opt-in).

    Args:
        sync: called at the start and end of each timed block, or ``None``.
        clock: seconds as a float, monotonic (tests pass a fake clock).
    """

    def __init__(self, *, sync: Callable[[], None] | None = None, clock: Callable[[], float] = time.perf_counter):
        self._sync = sync
        self._clock = clock
        self._totals: dict[str, float] = {}
        self._active: set[str] = set()

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        if not isinstance(stage, str) or not stage:
            raise ValueError(f"stage must be a non-empty str, got {stage!r}")
        if stage in self._active:
            raise ValueError(f"stage '{stage}' is already being timed (nested blocks of one stage would count twice)")
        self._active.add(stage)
        if self._sync is not None:
            self._sync()
        start = self._clock()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            self._totals[stage] = self._totals.get(stage, 0.0) + (self._clock() - start)
            self._active.discard(stage)

    def scalars(self) -> dict[str, float]:
        """``{"time/<stage>": seconds}`` accumulated since the last call, in first-use order; then reset."""
        out = {f"time/{stage}": seconds for stage, seconds in self._totals.items()}
        self._totals = {}
        return out


# --------------------------------------------------------------------------------------------------------------------
# diversity


def within_group_diversity(images: Tensor, group_ids: Tensor) -> Tensor:
    """Mean pairwise RMS distance between images of the same group (see the module docstring for the formula).

    ``||x_i - x_j||_2 / sqrt(D)`` over flattened images, averaged over every unordered same-group pair of the batch
    (pairs pooled: a group of size ``n`` contributes ``n(n-1)/2`` pairs). Groups of size 1 contribute nothing; group
    sizes may differ. One exact ``torch.cdist`` over the batch (``B x B`` distances, cross-group pairs masked out), no
    Python loop; computed in float32 without gradient. Under data parallelism, pass images whose groups are complete
    (gathered, or groups that never span ranks).

    Args:
        images: ``[B, ...]`` (``[B, 3, H, W]`` images, ``[B, 3, F, H, W]`` video), pixels in [0, 1] (not checked: a
            range check would synchronise the device), any float dtype, any device.
        group_ids: ``[B]`` integer (int64) group id per image, same prompt → same id; ids need not be contiguous.

    Returns:
        0-d float32 on ``images``' device, in pixel units: 0 for identical images, ``c`` for images differing by the
        constant ``c`` everywhere, at most 1. NaN when no group has two images.

    Raises:
        ValueError: ``images`` has fewer than 2 dims or a non-float dtype; ``group_ids`` is not ``[B]`` integer.
    """
    if images.dim() < 2:
        raise ValueError(f"images must be [B, ...] with at least 2 dims, got shape {list(images.shape)}")
    if not images.is_floating_point():
        raise ValueError(f"images must be a float tensor with pixels in [0, 1], got {images.dtype}")
    b = images.shape[0]
    if group_ids.dim() != 1 or group_ids.shape[0] != b:
        raise ValueError(f"group_ids must be [B] = [{b}], got shape {list(group_ids.shape)}")
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor (int64), got {group_ids.dtype}")
    with torch.no_grad():
        flat = images.detach().reshape(b, -1).float()
        d = flat.shape[1]
        # The matmul form of cdist (||x||² + ||y||² - 2x·y) loses precision by cancellation: identical images would
        # get a small positive distance. The direct form is exact enough that collapse reads as 0.
        dist = torch.cdist(flat, flat, compute_mode="donot_use_mm_for_euclid_dist")  # [B, B]
        ids = group_ids.to(flat.device)
        same = ids[:, None] == ids[None, :]
        pairs = same & torch.ones_like(same).triu(diagonal=1)  # each unordered pair once
        total = (dist * pairs).sum()
        count = pairs.sum()
        # count == 0 gives 0/0 = NaN without a host sync: "no pairs" must not read as "collapsed".
        return (total / count.to(total.dtype) / math.sqrt(d)).to(torch.float32)


def group_diversities(images: Tensor, group_ids: Tensor) -> Tensor:
    """:func:`within_group_diversity` of each group alone: ``[G]`` float32 on the CPU, groups in order of their
    first image; NaN for a group of one image. With equal group sizes their mean is the pooled
    :func:`within_group_diversity`; the report takes their standard error over groups (prompts) for its error bars.

    Raises:
        ValueError: as :func:`within_group_diversity`.
    """
    if group_ids.dim() != 1 or group_ids.shape[0] != images.shape[0]:
        raise ValueError(f"group_ids must be [B] = [{images.shape[0]}], got shape {list(group_ids.shape)}")
    order = dict.fromkeys(group_ids.tolist())  # first-seen order, as the eval's prompt-major layout
    return torch.stack([within_group_diversity(images[group_ids == g], group_ids[group_ids == g]).cpu()
                        for g in order]) if order else torch.zeros(0)


# --------------------------------------------------------------------------------------------------------------------
# provenance


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    repo = Path(__file__).resolve().parent
    try:
        result = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10,
                                check=False)
    except (OSError, subprocess.SubprocessError):  # git missing, not executable, hung
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def run_provenance() -> dict[str, Any]:
    """Where and with what a run was made; never raises for missing git or packages (those fields are ``None``).

    Returns:
        JSON-serialisable dict: ``flowforge``, ``torch``, ``diffusers``, ``transformers``, ``peft`` versions
        (the last three read from package metadata, not imported), ``python``, ``platform``, ``git_commit`` of the
        working tree holding this package (``None`` outside a git checkout), ``git_dirty`` (uncommitted changes to
        tracked files, or ``None``), ``hostname``, ``time_utc`` (ISO 8601), ``argv``, ``cuda`` (torch's CUDA
        version or ``None``), ``devices`` (GPU names).
    """
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit is not None else None
    devices = []
    if torch.cuda.is_available():
        devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "flowforge": __version__,
        "torch": torch.__version__,
        "diffusers": _package_version("diffusers"),
        "transformers": _package_version("transformers"),
        "peft": _package_version("peft"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": commit,
        "git_dirty": None if status is None else bool(status),
        "hostname": socket.gethostname(),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(sys.argv),
        "cuda": torch.version.cuda,
        "devices": devices,
    }


def write_provenance(run_dir: Path, extra: dict[str, Any] | None = None) -> Path:
    """Write :func:`run_provenance` plus ``extra`` (JSON-ready, e.g. ``cpu_threads``: the thread count used and the
    peaks it was chosen from) to ``<run_dir>/provenance.json`` (atomically) and return the path."""
    path = Path(run_dir) / PROVENANCE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(run_provenance() | (extra or {}), indent=2, sort_keys=True) + "\n"
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return path
