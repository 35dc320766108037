"""The ``rollout`` config section: where the rollout runs (in the trainer, or in worker processes) and how the
workers receive the policy's weights.

==================  ===========================================================================================
key                 meaning
==================  ===========================================================================================
``engine``          ``local`` (the trainer rolls out itself; the default) | ``workers`` (separate processes)
``num_workers``     worker processes per trainer rank (``engine: workers``)
``backend``         ``process`` (``torch.multiprocessing``, spawn) | ``ray`` (Ray actors, ``flowforge[ray]``)
``weight_sync``     ``auto`` (follows ``lora.trainable``) | ``adapter`` (LoRA tensors only: ``lora``) | ``full``
                    (every trained tensor: the whole transformer, ``lora.modules`` under ``module``, those
                    submodules and the LoRA tensors under ``module+lora``)
``sync_bucket_mb``  size of one streamed weight-sync bucket, MiB
``threads``         torch CPU threads of each worker (set deliberately: oversubscribed threads are slow)
``max_retries``     times a failed weight sync or a lost worker is retried (rebuilding the worker) per step
==================  ===========================================================================================

The engine is a systems choice: a worker runs the same rollout code on the same weights, so a run computes the
same numbers with either engine (see :mod:`flowforge.rollout.engine`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from flowforge.settings.schema import Checks, Section

ENGINES = ("local", "workers")
"""``rollout.engine`` values."""
BACKENDS = ("process", "ray")
"""``rollout.backend`` values: ``process`` = ``torch.multiprocessing`` (spawn), ``ray`` = Ray actors."""
SYNC_MODES = ("auto", "adapter", "full")
"""``rollout.weight_sync`` values; ``auto`` resolves to ``adapter`` under LoRA and ``full`` otherwise (full
fine-tuning, or ``module``: the trained submodules in full)."""


@dataclass(frozen=True)
class RolloutConfig(Section):
    """Where the rollout runs; see the module docstring for the keys."""

    section_name = "rollout"

    engine: str = "local"
    num_workers: int = 1
    backend: str = "process"
    weight_sync: str = "auto"
    sync_bucket_mb: float = 64.0
    threads: int = 1
    max_retries: int = 1

    def problems(self) -> list[str]:
        c = Checks(self)
        c.choice("engine", ENGINES)
        c.choice("backend", BACKENDS)
        c.choice("weight_sync", SYNC_MODES)
        c.positive("num_workers", "sync_bucket_mb", "threads")
        c.positive("max_retries", allow_zero=True)
        return c.problems

    def sync_mode(self, trainable: str) -> str:
        """The weight-sync mode for ``lora.trainable`` = ``trainable``: ``adapter`` under ``lora``, ``full`` under
        ``full`` / ``module`` / ``module+lora`` (``weight_sync: auto``), or the mode set explicitly."""
        if self.weight_sync != "auto":
            return self.weight_sync
        return "adapter" if trainable == "lora" else "full"

    def cross_problems(self, trainable: str) -> list[str]:
        """Rules across sections (called by :func:`flowforge.train.preflight.preflight`): a sync mode that
        contradicts ``lora.trainable`` = ``trainable``, and the Ray backend without Ray installed."""
        if self.engine == "local":
            return []
        problems = []
        expected = "adapter" if trainable == "lora" else "full"
        if self.weight_sync not in ("auto", expected):
            what = {"lora": "the workers hold LoRA layers and receive only the LoRA tensors",
                    "module+lora": "the workers receive every trained tensor: the submodules and the LoRA tensors"
                    }.get(trainable, "the workers hold no LoRA layers; every trainable tensor is sent")
            problems.append(f"rollout.weight_sync={self.weight_sync!r} contradicts lora.trainable={trainable!r} "
                            f"({what}); set rollout.weight_sync to 'auto' or {expected!r}")
        if self.backend == "ray" and importlib.util.find_spec("ray") is None:
            problems.append("rollout.backend='ray' but Ray is not installed; pip install 'flowforge[ray]', or use "
                            "rollout.backend='process'")
        return problems
