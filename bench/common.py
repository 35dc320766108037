"""Shared set-up of the benchmarks: the embedded default's adapter and a scored batch, timing helpers."""

from __future__ import annotations

import statistics
import subprocess
import threading
import time
from pathlib import Path

import torch


def start_announced(cmd: list[str], env: dict[str, str], cwd: Path, what: str) -> tuple[subprocess.Popen, str]:
    """Start a server ``cmd`` that prints ``serving ... at URL`` once it listens; returns ``(process, URL)``.

    Raises:
        SystemExit: no such line within 120 s (the process is killed), naming ``what``.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=cwd, env=env)
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(120)
    if not line or " at http://" not in line[0]:
        proc.kill()
        raise SystemExit(f"the {what} did not start: {line!r}")
    return proc, line[0].split(" at ", 1)[1].strip()


def build(extra=()):
    """A Trainer on the embedded default (demo base when shipped), eval disabled; returns it."""
    from flowforge.config import load_config
    from flowforge.train.trainer import Trainer

    cfg = load_config("examples/digits/grpo.yaml", ["run.output_dir=/tmp/flowforge-bench", "run.name=bench",
                                                    "eval.every=0", *extra])
    return Trainer(cfg, progress=False)


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def report(name: str, ours: list[float], bare: list[float]) -> None:
    mo, mb = statistics.median(ours), statistics.median(bare)
    print(f"{name}: flowforge {mo * 1e3:.1f} ms, bare loop {mb * 1e3:.1f} ms (median of {len(ours)}), "
          f"ratio {mo / mb:.3f}")


def interleave(a, b, repeats: int):
    """Run two arms alternately (one warm-up each), so drift on a shared machine hits both alike."""
    a(), b()
    ta, tb = [], []
    for _ in range(repeats):
        ta += timed(a, 1)
        tb += timed(b, 1)
    return ta, tb


torch.set_num_threads(2)
