"""Train a student reward model on judged groups, resumably: one atomic checkpoint per epoch; a rerun continues.

Output directory::

    out_dir/
      run.json                   the student config, the split (group keys per split) and their fingerprints
      checkpoints/step_000002/   after epoch 2: trainable.pt (the student's trainable weights), optimizer.pt,
                                 history.json (every epoch's metrics so far), best.pt (the trainable weights of
                                 the best epoch on validation so far and its number; absent while none is), then
                                 COMMITTED (written last; a directory without it is discarded)
      student/                   the selected student (:mod:`flowforge.reward_model.students`), COMMITTED last
      metrics.json               per-epoch history, the selected epoch, its ``val`` and ``test`` agreement

Epochs are chosen on validation: after every epoch the student is scored on the ``val`` split; the saved student is
the epoch with the highest validation Spearman (the earliest on a tie; pairwise accuracy when no validation group has
an order), never the last epoch by default. ``test`` is scored once, on the selected student, and selects nothing.
Without validation groups the last epoch is kept (``selected_by: "last"``).

Determinism: the groups are split by cluster (:func:`flowforge.reward_model.data.split_groups`); epoch ``e`` visits
the training groups sorted by ``sha256("<seed>:<e>:<group key>")`` and seeds torch with a hash of ``(seed, e)``
before it starts (LoRA dropout), so an epoch depends only on the state it starts from, and a checkpoint holds all
of that state: the weights, the optimizer's moments and step, the history (which epoch is best so far) and the
best epoch's weights. No generator state is saved because none carries over an epoch boundary (torch is re-seeded,
the order is a hash, numpy and ``random`` are not used, the learning rate is constant) and nothing a student
caches depends on which epoch filled it (:meth:`ScalarHeadStudent.embed
<flowforge.reward_model.scalar_head.ScalarHeadStudent.embed>` encodes each prompt alone). A run killed anywhere in
epoch ``e`` and rerun repeats epoch ``e`` from checkpoint ``e - 1`` and ends with the student, history and
metrics of an uninterrupted run, bit for bit. Rerunning a finished directory returns its result without training.
A rerun with another config or other groups is refused (``epochs`` may grow: training continues from the last
epoch).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from flowforge.reward_model.config import StudentConfig, student_config
from flowforge.reward_model.data import SPLITS, JudgedGroup, split_groups
from flowforge.reward_model.evaluate import evaluate
from flowforge.reward_model.students import create_student
from flowforge.runtime.durable import (atomic_write, remove_marked_dir, step_dir_name, step_dirs, torch_save,
                                       write_bytes)
from flowforge.settings.schema import to_dict

log = logging.getLogger(__name__)

COMMITTED = "COMMITTED"
BEST_FILE = "best.pt"  # in a checkpoint: {"epoch": e, "state": trainable weights of epoch e}


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What :func:`train_student` produced: the saved student, the per-epoch history, held-out metrics and the
    number of groups per split."""

    student_dir: Path
    history: list[dict[str, Any]]
    val: dict[str, float]
    test: dict[str, float]
    split_sizes: dict[str, int]
    best_epoch: int = 0
    splits: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # group keys per split


def _hash_int(*parts: Any) -> int:
    return int(hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:15], 16)


def _write_json(path: Path, data: Any) -> None:
    write_bytes(path, json.dumps(data, indent=1, default=float).encode("utf-8"))


def _run_record(cfg: StudentConfig, splits: dict[str, list[JudgedGroup]]) -> dict[str, Any]:
    config = to_dict(cfg)
    config.pop("epochs")  # more epochs continue a run; anything else is another run
    return {"config": config, "splits": {s: [g.key for g in splits[s]] for s in SPLITS}}


def _check_run(out_dir: Path, record: dict[str, Any]) -> None:
    """Write ``run.json`` on the first run; refuse a rerun whose config or split differs."""
    path = out_dir / "run.json"
    if not path.is_file():
        _write_json(path, record)
        return
    old = json.loads(path.read_text())
    if old != json.loads(json.dumps(record, default=float)):
        changed = [k for k in ("config", "splits") if old.get(k) != json.loads(json.dumps(record[k], default=float))]
        raise ValueError(f"{out_dir} holds a student run with another {' and '.join(changed)}; use a new directory")


def _latest_checkpoint(root: Path) -> tuple[int, Path | None]:
    """``(epochs done, directory)`` of the newest committed checkpoint; uncommitted ones are removed."""
    best: tuple[int, Path | None] = (0, None)
    for epoch, path in step_dirs(root):
        if (path / COMMITTED).is_file():
            best = (epoch, path)
        else:
            log.warning("discarding the uncommitted student checkpoint %s", path)
            shutil.rmtree(path)
    return best


def _save_checkpoint(root: Path, epoch: int, student: Any, optimizer: torch.optim.Optimizer,
                     history: list[dict], best: dict[str, Any] | None, keep: int) -> None:
    """Commit ``checkpoints/step_<epoch>/`` (module docstring): each file written atomically, ``COMMITTED`` last;
    ``best`` is ``{"epoch", "state"}`` of the best epoch on validation so far (None: none yet). Only the newest
    ``keep`` committed checkpoints are kept."""
    path = root / step_dir_name(epoch)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    atomic_write(path / "trainable.pt", lambda tmp: torch_save(student.trainable_state(), tmp))
    atomic_write(path / "optimizer.pt", lambda tmp: torch_save(optimizer.state_dict(), tmp))
    _write_json(path / "history.json", history)
    if best is not None:
        atomic_write(path / BEST_FILE, lambda tmp: torch_save(best, tmp))
    write_bytes(path / COMMITTED, b"")
    committed = [p for _, p in step_dirs(root) if (p / COMMITTED).is_file()]
    for old in committed[:-keep]:
        remove_marked_dir(old, COMMITTED)


def _load_best(checkpoint: Path, out: Path, history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ``{"epoch", "state"}`` of the best epoch so far as of ``checkpoint`` (None when no epoch is best yet).
    A checkpoint of an older flowforge has no ``best.pt``; the run directory's ``best.pt`` is used then, if it holds
    that epoch.

    Raises:
        RuntimeError: no saved weights of the epoch the history selects.
    """
    want = _best_so_far(history)
    for path in (checkpoint / BEST_FILE, out / BEST_FILE):
        if path.is_file():
            best = torch.load(path, weights_only=True)
            if best["epoch"] == want:
                return best
    if want:
        raise RuntimeError(f"{checkpoint} selects epoch {want} on validation but holds no {BEST_FILE} of it")
    return None


def _selection_value(val: dict[str, float]) -> float:
    """What validation selects epochs by: Spearman, else pairwise accuracy, else -inf (nothing to measure)."""
    for metric in ("spearman", "pairwise_accuracy"):
        value = float(val.get(metric, math.nan))
        if not math.isnan(value):
            return value
    return -math.inf


def _best_so_far(history: list[dict[str, Any]]) -> int:
    """The epoch of ``history`` with the highest :func:`_selection_value` of its ``val`` (the earliest on a tie)."""
    best, value = 0, -math.inf
    for record in history:
        v = _selection_value(record.get("val") or {})
        if v > value:
            best, value = record["epoch"], v
    return best


def _run_epoch(student: Any, optimizer: torch.optim.Optimizer, cfg: StudentConfig, groups: list[JudgedGroup],
               epoch: int) -> dict[str, float]:
    order = sorted(groups, key=lambda g: hashlib.sha256(f"{cfg.seed}:{epoch}:{g.key}".encode()).hexdigest())
    torch.manual_seed(_hash_int(cfg.seed, epoch))
    student.train()
    sums: dict[str, float] = {}
    batches = 0
    for start in range(0, len(order), cfg.batch_size):
        optimizer.zero_grad(set_to_none=True)
        metrics = student.backward(order[start:start + cfg.batch_size])
        if cfg.grad_clip > 0:
            metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(student.trainable_parameters(),
                                                                        cfg.grad_clip))
        optimizer.step()
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v
        batches += 1
    student.eval()
    return {k: v / max(batches, 1) for k, v in sums.items()}


def train_student(cfg_section: StudentConfig | dict | None, groups: Sequence[JudgedGroup], out_dir: str | Path, *,
                  clusters: Sequence[str] | None = None,
                  on_epoch: Callable[[int, dict[str, Any]], None] | None = None) -> TrainResult:
    """Train a student of ``cfg_section.kind`` on the train split of ``groups`` for ``epochs`` epochs, keep the epoch
    that is best on validation (module docstring), save it to ``out_dir/student`` and score it on ``test``.

    Args:
        cfg_section: the ``student`` section (a :class:`StudentConfig`, its mapping, or None for the defaults).
        groups: the judged groups (:func:`flowforge.reward_model.data.read_judged_groups`).
        out_dir: the run directory (created; a rerun continues it).
        clusters: every cluster that may be judged (the condition ledger's), for the exact cluster split
            (:func:`flowforge.reward_model.data.split_groups`); None: a hash per cluster.
        on_epoch: called as ``on_epoch(epoch, record)`` after each epoch's checkpoint is committed.

    Raises:
        ValueError: no training groups; a rerun with another config or other groups.
        flowforge.settings.schema.ConfigError: a bad config section.
    """
    cfg = student_config(cfg_section)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits = split_groups(groups, cfg.split_seed, cfg.split, clusters)
    if not splits["train"]:
        raise ValueError(f"no training groups among {len(groups)} judged groups (split {cfg.split})")
    _check_run(out, _run_record(cfg, splits))
    sizes = {s: len(splits[s]) for s in SPLITS}
    keys = {s: [g.key for g in splits[s]] for s in SPLITS}
    final, metrics_file = out / "student", out / "metrics.json"
    if (final / COMMITTED).is_file() and metrics_file.is_file():
        done = json.loads(metrics_file.read_text())
        if len(done["history"]) == cfg.epochs:
            return TrainResult(final, done["history"], done["val"], done["test"], sizes, done["best_epoch"], keys)
    student = create_student(cfg)
    optimizer = torch.optim.AdamW(student.trainable_parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    root = out / "checkpoints"
    start, latest = _latest_checkpoint(root)
    history: list[dict[str, Any]] = []
    best_state: dict[str, Any] | None = None  # {"epoch", "state"} of the best epoch on validation so far
    if latest is not None:
        student.load_trainable_state(torch.load(latest / "trainable.pt", weights_only=True))
        optimizer.load_state_dict(torch.load(latest / "optimizer.pt", weights_only=True))
        history = json.loads((latest / "history.json").read_text())
        best_state = _load_best(latest, out, history)
        log.info("student: resuming after epoch %d from %s", start, latest)
    if start > cfg.epochs:
        raise ValueError(f"{out} already trained {start} epochs; student.epochs={cfg.epochs} is fewer")
    for epoch in range(start + 1, cfg.epochs + 1):
        record = {"epoch": epoch, "train": _run_epoch(student, optimizer, cfg, splits["train"], epoch)}
        record["val"] = evaluate(student, splits["val"], cfg.gate.tie_margin) if splits["val"] else {}
        history.append(record)
        if _best_so_far(history) == epoch:
            best_state = {"epoch": epoch, "state": student.trainable_state()}
        _save_checkpoint(root, epoch, student, optimizer, history, best_state, cfg.keep_checkpoints)
        if on_epoch is not None:
            on_epoch(epoch, record)
    best = _best_so_far(history) if splits["val"] else 0
    if best and best != len(history):
        if best_state is None or best_state["epoch"] != best:  # a bug, not a user error: the two are kept together
            raise RuntimeError(f"the best student state is epoch {best_state and best_state['epoch']}, but "
                               f"validation selects epoch {best}")
        student.load_trainable_state(best_state["state"])
    best = best or len(history)
    student.eval()
    test = evaluate(student, splits["test"], cfg.gate.tie_margin) if splits["test"] else {}
    val = history[best - 1]["val"] if history else {}
    if final.exists():  # an earlier, shorter run's student (or a half-written one): replaced
        remove_marked_dir(final, COMMITTED)
    student.save(final)
    write_bytes(final / COMMITTED, b"")
    _write_json(metrics_file, {"history": history, "best_epoch": best,
                               "selected_by": "val" if splits["val"] else "last", "val": val, "test": test,
                               "split_sizes": sizes})
    log.info("student: epoch %d of %d selected on validation (%s)", best, len(history), val)
    return TrainResult(final, history, val, test, sizes, best, keys)
