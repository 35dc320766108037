"""Model FLOP utilisation (MFU) of a run: the transformer's FLOPs per step against the device's peak.

FLOPs per sample and forward are counted once, by torch's own counter
(:class:`torch.utils.flop_counter.FlopCounterMode`), around the first forward of the transformer (a hook, so the
forward is one the run makes anyway, at the run's shapes). After that, hooks count the rows every forward sees::

    model FLOPs of a step = f_row * (rows without grad + 3 * rows with grad)

``f_row`` = counted FLOPs / rows of the first forward; a forward with grad is followed by its backward, counted as
twice the forward (the 6N-per-token convention of MFU, Kaplan et al. 2020 / PaLM, Chowdhery et al. 2022;
recomputation under activation checkpointing is not counted, by that convention; with LoRA the weight gradients of
the frozen layers are skipped, so 3x over-counts the update a little). The rollout (stage 2) and the update (stage 5)
are counted apart.

Peak: a table of known GPUs' dense bf16 / fp32 peaks (:data:`PEAK_TFLOPS`, vendor datasheets, no sparsity) for the
run's compute dtype; on the CPU, or on a GPU not in the table, a peak measured at start-up by a short matrix product
(:func:`measured_peak`), and the log says so. On the CPU the run's thread count is measured against one thread at
start-up (:func:`set_cpu_threads`: on a busy machine more threads can be many times slower; a warning with both
numbers, or with ``run.num_threads: auto`` the faster count). Metrics per step:

=======================  ============================================================================================
``perf/tflops``          model TFLOP/s over the step's stages (rollout + update FLOPs / the stages' wall time)
``perf/mfu``             ``perf/tflops`` / the peak
``perf/mfu_rollout``     the rollout's FLOPs / its wall time (stage ``sample``) / the peak
``perf/mfu_update``      the update's FLOPs / its wall time (stage ``optimize``) / the peak
``perf/peak_tflops``     the peak used (constant over a run)
=======================  ============================================================================================
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger("flowforge")

PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    # name fragment of torch.cuda.get_device_name() -> (dense bf16/fp16 tensor-core TFLOP/s, fp32 TFLOP/s);
    # the first fragment found in the name wins, so the more specific ones come first
    "H200 NVL": (835.5, 60.0),
    "H200": (989.4, 66.9),
    "H100 NVL": (835.5, 60.0),
    "H100 PCIe": (756.5, 51.2),
    "H100": (989.4, 66.9),  # SXM5 (the device name of an SXM card says "H100 80GB HBM3")
    "A100": (312.0, 19.5),
    "L40S": (362.1, 91.6),
    "L40": (181.0, 90.5),
    "L4": (121.0, 30.3),
    "A10": (125.0, 31.2),
    "RTX 4090": (165.2, 82.6),
    "RTX 3090": (71.0, 35.6),
    "V100": (125.0, 15.7),  # fp16 tensor cores (no bf16)
    "T4": (65.0, 8.1),  # fp16 tensor cores (no bf16)
}
"""Known GPUs' dense peaks (NVIDIA datasheets; the sparsity figures halved)."""

_MEASURED: dict[tuple[str, torch.dtype, int], float] = {}


@dataclass(frozen=True)
class Peak:
    """A device's peak: ``flops`` per second and where the number comes from (``source``, for the log)."""

    flops: float
    source: str


def measured_peak(device: torch.device, dtype: torch.dtype, seconds: float = 0.1) -> float:
    """FLOP/s of a square matrix product on ``device`` in ``dtype`` (the best of repeated runs for about
    ``seconds``; 512 rows on the CPU, 4096 on a GPU), measured once per process, device, dtype and CPU thread count.
    No random numbers are drawn (the global generator is left as it was)."""
    key = (str(device), dtype, torch.get_num_threads())
    if key in _MEASURED:
        return _MEASURED[key]
    n = 512 if device.type == "cpu" else 4096
    a = (torch.arange(n * n, device=device) % 7).to(dtype).view(n, n) / 7
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    a @ a  # warm-up
    sync()
    best, deadline = math.inf, time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == math.inf:
        start = time.perf_counter()
        a @ a
        sync()
        best = min(best, time.perf_counter() - start)
    _MEASURED[key] = 2 * n**3 / best
    return _MEASURED[key]


def device_peak(device: torch.device, dtype: torch.dtype) -> Peak:
    """The peak FLOP/s of ``device`` for compute in ``dtype``: the table's for a known GPU, else measured."""
    tensor_core = dtype in (torch.bfloat16, torch.float16)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, (low, fp32) in PEAK_TFLOPS.items():
            if fragment in name:
                return Peak((low if tensor_core else fp32) * 1e12,
                            f"{name}, {'bf16/fp16' if tensor_core else 'fp32'} datasheet peak")
    flops = measured_peak(device, dtype)
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    return Peak(flops, f"{what}: measured by a {str(dtype).removeprefix('torch.')} matrix product at start-up, "
                       "not a datasheet number")


SLOWER_THAN_ONE = 0.8
"""More CPU threads whose measured peak is below this fraction of one thread's are reported: on a busy machine
threads wait on each other (measured: 0.015 TFLOP/s at 2 threads against 0.10 at 1, steps ~10x slower)."""


@dataclass(frozen=True)
class ThreadChoice:
    """What :func:`choose_threads` decided: run on ``threads`` CPU threads; ``message`` (or None) is one log line,
    a warning when ``warn``."""

    threads: int
    message: str | None = None
    warn: bool = False


def choose_threads(rates: dict[int, float], current: int, *, auto: bool) -> ThreadChoice:
    """The thread count to run with, from measured peaks (pure: no measuring, no torch state).

    Args:
        rates: CPU thread count -> measured FLOP/s; holds ``current`` and ``1``.
        current: the thread count configured (``run.num_threads``, or torch's default for 0).
        auto: ``run.num_threads: auto``: pick the faster measured count (a tie keeps fewer threads) and say which.
            Otherwise keep ``current`` and warn when it measured below :data:`SLOWER_THAN_ONE` x one thread's rate.

    Raises:
        KeyError: ``rates`` lacks ``current`` or ``1``.
    """
    many, one = rates[current], rates[1]
    measured = f"measured {one / 1e12:.3g} TFLOP/s at 1 thread, {many / 1e12:.3g} at {current}"
    if auto:
        best = current if many > one else 1
        return ThreadChoice(best, f"run.num_threads=auto: {best} CPU thread{'s' * (best != 1)} ({measured})")
    if many < SLOWER_THAN_ONE * one:
        return ThreadChoice(current, f"{current} CPU threads measured slower than 1 ({measured}): the machine is "
                                     "busy and the threads wait on each other; steps may take many times longer. "
                                     "Set run.num_threads=1 (or run.num_threads=auto to pick the faster)", warn=True)
    return ThreadChoice(current)


THREAD_CHECK_ENV = "FLOWFORGE_THREAD_CHECK"
"""Set to ``0`` to skip :func:`set_cpu_threads`'s start-up comparison of thread counts."""


def set_cpu_threads(configured: int | str, device: torch.device | str = "cpu") -> dict[str, object]:
    """Apply ``run.num_threads`` (``n`` > 0: ``torch.set_num_threads(n)``; 0: torch's default; ``"auto"``), and on
    the CPU with more than one thread compare the measured fp32 peak (:func:`measured_peak`, ~0.1 s each) against
    one thread's: log :func:`choose_threads`'s line (a warning, or the auto choice, applied here).
    ``FLOWFORGE_THREAD_CHECK=0`` in the environment skips the comparison (the test suite sets it: its two worker
    processes share the cores on purpose, so every measurement there would warn).

    Returns:
        JSON-ready record for the run's provenance: ``configured``, ``threads`` (used) and, when measured,
        ``peak_tflops`` (thread count as a string -> TFLOP/s).
    """
    auto = configured == "auto"
    if not auto and int(configured) > 0:
        torch.set_num_threads(int(configured))
    current = torch.get_num_threads()
    record: dict[str, object] = {"configured": configured, "threads": current}
    if torch.device(device).type != "cpu" or current == 1 or os.environ.get(THREAD_CHECK_ENV, "1") == "0":
        return record
    rates = {current: measured_peak(torch.device("cpu"), torch.float32)}
    torch.set_num_threads(1)
    try:
        rates[1] = measured_peak(torch.device("cpu"), torch.float32)
    finally:
        torch.set_num_threads(current)
    choice = choose_threads(rates, current, auto=auto)
    if choice.message:
        (log.warning if choice.warn else log.info)(choice.message)
    torch.set_num_threads(choice.threads)
    record.update(threads=choice.threads, peak_tflops={str(n): r / 1e12 for n, r in sorted(rates.items())})
    return record


def compute_dtype(adapter, distributed, dist) -> torch.dtype:
    """The dtype the transformer computes in: FSDP's ``distributed.param_dtype`` under FSDP, else its parameters'
    (full fine-tuning trains in fp32 whatever ``model.dtype`` says)."""
    if dist.enabled and distributed.strategy == "fsdp":
        from flowforge.runtime.dtypes import resolve_dtype

        return resolve_dtype(distributed.param_dtype, key="distributed.param_dtype")
    return getattr(adapter, "dtype", None) or next(adapter.transformer.parameters()).dtype


def _rows(args: tuple, kwargs: dict) -> int:
    """The batch size of a transformer call: ``hidden_states``' first dimension, else the first tensor argument's."""
    first = kwargs.get("hidden_states")
    if not isinstance(first, torch.Tensor):
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    return int(first.shape[0]) if first is not None and first.dim() else 1


class FlopMeter:
    """Counts the transformer's forward rows and, once, its FLOPs per row (module docstring).

    The hooks are process-wide module hooks that act only on the module ``target()`` returns at the time of a call:
    a policy bank may swap another module in as ``adapter.transformer`` (a frozen copy for the old or reference
    policy under full fine-tuning), and those forwards count too. Call :meth:`remove` when done.

    Args:
        target: returns the module whose forwards are counted (e.g. ``lambda: adapter.transformer``).
    """

    def __init__(self, target: Callable[[], nn.Module]) -> None:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.utils.flop_counter import FlopCounterMode

        self._mode_cls = FlopCounterMode
        self.target = target
        self.flops_per_row: float | None = None
        self._mode: object | None = None
        self.rows = {"grad": 0, "no_grad": 0}
        self._handles = [register_module_forward_pre_hook(self._pre),
                         register_module_forward_hook(self._post, with_kwargs=True, always_call=True)]

    def _pre(self, module, args):
        if self.flops_per_row is None and self._mode is None and module is self.target():
            self._mode = self._mode_cls(display=False)
            self._mode.__enter__()

    def _post(self, module, args, kwargs, output):
        if module is not self.target():
            return
        rows = _rows(args, kwargs)
        self.rows["grad" if torch.is_grad_enabled() else "no_grad"] += rows
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
            self.flops_per_row = mode.get_total_flops() / max(rows, 1)

    def take(self) -> float:
        """Model FLOPs of the forwards since the last call (``f_row * (no-grad rows + 3 * grad rows)``, NaN before
        the first forward has been counted), then reset the row counts."""
        rows, self.rows = self.rows, {"grad": 0, "no_grad": 0}
        if self.flops_per_row is None:
            return math.nan if rows["grad"] or rows["no_grad"] else 0.0
        return self.flops_per_row * (rows["no_grad"] + 3 * rows["grad"])

    def remove(self) -> None:
        if self._mode is not None:  # a forward that raised before its hook ran: leave torch's mode stack clean
            self._mode.__exit__(None, None, None)
            self._mode = None
        for handle in self._handles:
            handle.remove()


class PerfMeter:
    """MFU of a run's steps (module docstring). The peak is found (or measured) when the meter is built; forwards are
    counted inside :meth:`counting`. Per step: :meth:`begin_step` before stage 1, :meth:`end_rollout` after stage 2,
    :meth:`metrics` after stage 5, with the step's stage times.

    Args:
        target: returns the transformer (``lambda: adapter.transformer``). device: the run device. dtype: the
            compute dtype (bf16 / fp16 use the tensor-core peak). rollout_elsewhere: the rollout runs in worker
            processes (its FLOPs are not seen here: ``perf/mfu_rollout`` is NaN and ``perf/mfu`` counts the update).
    """

    def __init__(self, target: Callable[[], nn.Module], device: torch.device, dtype: torch.dtype, *,
                 rollout_elsewhere: bool = False) -> None:
        self.target = target
        self.peak = device_peak(device, dtype)
        self.rollout_elsewhere = rollout_elsewhere
        self.meter: FlopMeter | None = None
        self._rollout = self._update = 0.0

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count the transformer's forwards inside the block (the hooks are removed after it); logs the peak."""
        log.info("perf/mfu against a peak of %.4g TFLOP/s (%s)%s", self.peak.flops / 1e12, self.peak.source,
                 "; the rollout runs in worker processes: its FLOPs are not counted" if self.rollout_elsewhere else "")
        self.meter = FlopMeter(self.target)
        try:
            yield
        finally:
            self.meter.remove()
            self.meter = None

    def _take(self) -> float:
        return self.meter.take() if self.meter is not None else math.nan

    def begin_step(self) -> None:
        self._take()  # forwards outside the step's stages (evaluation) are not the step's

    def end_rollout(self) -> None:
        self._rollout = math.nan if self.rollout_elsewhere else self._take()

    def metrics(self, times: dict[str, float]) -> dict[str, float]:
        """After stage 5 (the forwards since :meth:`end_rollout` are the update's): ``perf/tflops``, ``perf/mfu``,
        ``perf/mfu_rollout``, ``perf/mfu_update``, ``perf/peak_tflops`` of the step; ``times`` are its stage times
        (``time/<stage>`` seconds)."""
        self._update = self._take()
        def rate(flops: float, seconds: float) -> float:
            return flops / seconds if seconds > 0 else math.nan

        counted = (0.0 if math.isnan(self._rollout) else self._rollout) + self._update
        flops = rate(counted, sum(times.values()))
        return {"perf/tflops": flops / 1e12, "perf/mfu": flops / self.peak.flops,
                "perf/mfu_rollout": rate(self._rollout, times.get("time/sample", 0.0)) / self.peak.flops,
                "perf/mfu_update": rate(self._update, times.get("time/optimize", 0.0)) / self.peak.flops,
                "perf/peak_tflops": self.peak.flops / 1e12}
