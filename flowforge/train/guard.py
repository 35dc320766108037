"""Reward-hacking guard: stop a run (or roll it back) when the held-out judge falls while the training reward rises.

What
    A policy that exploits its reward model keeps raising the training reward while an *independent* judge on
    held-out prompts gets worse (the embedded default's samples grow a dotted texture that fools the reward CNN but
    not the DigitEval classifier). The guard watches both curves and ends the run at the first evaluation where

    * the held-out judge ``J`` (an eval metric of another model than the reward, ``guard.judge``; default the first
      of ``eval.scorers``) fell at each of the last ``p = guard.patience`` evaluations:
      ``J_{k-p} > J_{k-p+1} > ... > J_k``, each fall larger than ``guard.min_delta``; and
    * the training reward ``R`` (``guard.reward``, the logged ``reward/total_mean`` by default) rose over the same
      steps: the least-squares slope of the per-step ``R`` over the steps ``s_{k-p} .. s_k`` is > 0.

    ``guard.action: stop`` ends the run there (final checkpoint, report); ``rollback`` first restores the weights
    (live, old, EMA) of the evaluation with the best judge so far, so the final checkpoint is the best model seen.
    Either way the log says so, ``eval.jsonl`` records it at that step (``eval/guard_stop`` = 1,
    ``eval/guard_best_step``, ``eval/guard_best``, ``eval/guard_rolled_back``, ``eval/guard_patience``) and the report
    shows it. ``guard.patience: 0`` (the default) turns the guard off.

Why one-sided and consecutive
    Held-out scores are noisy (240 images move DigitEval by ~0.02); ``p`` consecutive falls plus a rising reward is
    the reward-hacking signature, whereas a plateau or a falling reward is not (the run is just not learning).

Where it runs
    Rank 0 evaluates, so rank 0 decides (:meth:`RewardHackingGuard.observe_eval`); :meth:`RewardHackingGuard.sync`,
    called by every rank after each step, shares the decision (one ``all_reduce``) and snapshots / restores the
    weights on every rank (a collective under FSDP). A resumed run re-reads the curves of the steps before the resume
    from ``eval.jsonl`` / ``metrics.jsonl``. With ``action: rollback`` rank 0 also writes the weights of each new best
    evaluation to ``guard_best.safetensors`` in the run directory (atomically; the step and judge value in its
    metadata), so a resumed run rolls back to the best evaluation of the *whole* run: when the file holds the best
    step of the logged curve every rank reads it back; when it does not (the killed run wrote a later best that the
    resume does not reach), the log says so and the target is the best evaluation since the resume.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from flowforge.report.run import read_jsonl
from flowforge.runtime.distributed import all_reduce_processes
from flowforge.runtime.durable import atomic_write
from flowforge.runtime.errors import UserError
from flowforge.runtime.run_dir import EVAL_FILE, EVAL_PREFIX, GUARD_BEST_FILE, METRICS_FILE

log = logging.getLogger("flowforge")


@dataclass(frozen=True)
class Verdict:
    """Why the guard fired: the judge at the ``patience + 1`` evaluations of the window and the reward's slope."""

    judge: tuple[tuple[int, float], ...]  # (step, judge value) from the start of the window to the evaluation now
    reward_slope: float  # least-squares slope of the training reward per step over the window's steps

    def describe(self, judge_key: str, reward_key: str) -> str:
        falls = " -> ".join(f"{v:.4f} (step {s})" for s, v in self.judge)
        return (f"held-out {judge_key} fell at {len(self.judge) - 1} consecutive evaluations ({falls}) while "
                f"{reward_key} rose (slope {self.reward_slope:+.2e} per step)")


def slope(points: Sequence[tuple[int, float]]) -> float:
    """Least-squares slope of ``(step, value)`` points (NaN values left out); NaN with fewer than 2 steps."""
    pts = [(float(s), float(v)) for s, v in points if math.isfinite(v)]
    if len({s for s, _ in pts}) < 2:
        return math.nan
    ms = sum(s for s, _ in pts) / len(pts)
    mv = sum(v for _, v in pts) / len(pts)
    return sum((s - ms) * (v - mv) for s, v in pts) / sum((s - ms) ** 2 for s, _ in pts)


def detect_reward_hacking(judge: Sequence[tuple[int, float]], reward: Sequence[tuple[int, float]], *,
                          patience: int, min_delta: float = 0.0) -> Verdict | None:
    """The guard's rule (module docstring) on recorded curves, at the last evaluation of ``judge``.

    Args:
        judge: ``(step, value)`` of the held-out judge at each evaluation so far, in step order.
        reward: ``(step, value)`` of the training reward at each training step so far (step = steps completed).
        patience: ``p >= 1`` consecutive falls needed. min_delta: ``>= 0``, a fall must exceed it.
    Returns:
        the :class:`Verdict` when the rule fires, else None (also with fewer than ``p + 1`` evaluations, a NaN judge
        in the window, or fewer than 2 reward steps in it).
    Raises:
        ValueError: ``patience < 1`` or ``min_delta < 0``.
    """
    if patience < 1 or not min_delta >= 0:
        raise ValueError(f"patience must be >= 1 and min_delta >= 0, got {patience} and {min_delta}")
    if len(judge) < patience + 1:
        return None
    window = list(judge[-(patience + 1):])
    values = [v for _, v in window]
    if not all(math.isfinite(v) for v in values):
        return None
    if not all(b < a - min_delta for a, b in zip(values, values[1:])):
        return None
    start, end = window[0][0], window[-1][0]
    rise = slope([(s, v) for s, v in reward if start <= s <= end])
    if not rise > 0:
        return None
    return Verdict(judge=tuple((int(s), float(v)) for s, v in window), reward_slope=rise)


def judge_key(guard, eval_scorers: Sequence[str]) -> str | None:
    """The eval metric the guard watches: ``guard.judge``, else ``eval/<first of eval.scorers>``; None if neither."""
    if guard.judge is not None:
        return guard.judge
    return f"{EVAL_PREFIX}{eval_scorers[0]}" if eval_scorers else None


def guard_problems(cfg) -> tuple[list[str], list[str]]:
    """``(problems, warnings)`` of the ``guard`` section against the rest of a root config (for preflight): the
    guard needs periodic evaluation and a judge that the evaluation logs; a judge that is a training reward
    component cannot catch that reward's exploitation (a warning)."""
    g, e = cfg.guard, cfg.eval
    if g.patience == 0:
        return [], []
    problems, warnings = [], []
    if e.every == 0:
        problems.append(f"guard.patience={g.patience} needs periodic held-out evaluations: set eval.every > 0")
    key = judge_key(g, e.scorers)
    logged = {f"{EVAL_PREFIX}{n}" for n in (*cfg.reward.weights, *e.scorers)} | {f"{EVAL_PREFIX}diversity"}
    if key is None:
        problems.append(f"guard.patience={g.patience} needs a held-out judge: set guard.judge (e.g. "
                        "eval/digit_eval) or list an independent scorer in eval.scorers")
    elif key not in logged:
        problems.append(f"guard.judge={key!r} is not logged by the evaluation; allowed: {sorted(logged)}")
    rewards = {"reward/total_mean"} | {f"reward/{n}_mean" for n in cfg.reward.weights}
    if g.reward not in rewards:  # an unlogged key would read NaN every step: the guard would never fire
        problems.append(f"guard.reward={g.reward!r} is not a logged training reward; allowed: {sorted(rewards)}")
    if key is not None and key in logged and key[len(EVAL_PREFIX):] in cfg.reward.weights:
        warnings.append(f"guard.judge={key!r} is a training reward component: the guard cannot see that reward "
                        "being exploited; use an independent scorer (eval.scorers)")
    return problems, warnings


def guard_stop_step(run_dir: Path) -> int | None:
    """The step at which the guard stopped the run in ``run_dir`` (its ``eval/guard_stop`` row), or None. Torn lines
    of a killed run and rows superseded by a resume are skipped (:func:`~flowforge.report.run.read_jsonl`)."""
    for row in _rows(Path(run_dir) / EVAL_FILE):
        if row.get(f"{EVAL_PREFIX}guard_stop", 0.0) > 0:
            return int(row["step"])
    return None


def _rows(path: Path) -> list[dict[str, float]]:
    """The rows of a run's JSON-lines log (nothing when it does not exist yet), read the way the report reads them."""
    return read_jsonl(path)[0] if path.is_file() else []


class RewardHackingGuard:
    """The guard of one run (module docstring). ``section``: the ``guard`` config section; ``judge``: the eval
    metric watched (:func:`judge_key`); ``run_dir``: read on the first observation to recover the curves of the
    steps before a resume; ``is_main``: rank 0 (the one that evaluates and decides)."""

    def __init__(self, section, judge: str | None, *, run_dir: Path | None = None, is_main: bool = True):
        self.cfg, self.judge, self.is_main = section, judge, is_main
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.enabled = section.patience > 0 and judge is not None
        self.judge_curve: list[tuple[int, float]] = []
        self.reward_curve: list[tuple[int, float]] = []
        self.best: tuple[int, float] | None = None  # (step, judge) of the best evaluation whose weights are held
        self.stopped = False
        self.message: str | None = None
        # rank 0's decision since the last sync: [snapshot, stop, rollback, read the snapshot back from GUARD_BEST_FILE]
        self._pending = torch.zeros(4)
        self._snapshot: dict[str, dict[str, torch.Tensor]] | None = None
        self._loaded = False

    @classmethod
    def from_config(cls, cfg, run_dir: Path | None = None, *, is_main: bool = True) -> "RewardHackingGuard":
        """The guard of ``cfg``; call before anything is written to ``run_dir``.

        Raises:
            UserError: the run resumes (``train.resume``) in a directory whose ``eval.jsonl`` records that the guard
                stopped it: resuming would train on past the stop (and, after a rollback, from best-step weights
                with later optimizer state). ``guard.patience=0`` continues it deliberately.
        """
        guard = cls(cfg.guard, judge_key(cfg.guard, cfg.eval.scorers), run_dir=run_dir, is_main=is_main)
        stop = guard_stop_step(run_dir) if guard.enabled and run_dir is not None and cfg.train.resume else None
        if stop is not None:
            raise UserError(f"train.resume={cfg.train.resume!r}", f"the reward-hacking guard stopped this run at step "
                            f"{stop} ({Path(run_dir) / EVAL_FILE})", "start a new run, or continue it deliberately "
                            "with guard.patience=0")
        return guard

    def _load_history(self, before: int) -> None:
        """Curves of the steps ``< before`` a resumed run logged (rank 0); nothing for a new run."""
        self._loaded = True
        if self.run_dir is None or before <= 0:
            return
        for name, key, curve in ((EVAL_FILE, self.judge, self.judge_curve),
                                 (METRICS_FILE, self.cfg.reward, self.reward_curve)):
            by_step = {int(r["step"]): r[key] for r in _rows(self.run_dir / name)
                       if r["step"] < before and key in r and math.isfinite(r[key])}
            curve.extend(sorted(by_step.items()))
        if self.cfg.action == "rollback" and self.judge_curve:
            self._recover_best()

    def _recover_best(self) -> None:
        """Rank 0, on resume: the best logged evaluation becomes the rollback target if ``GUARD_BEST_FILE`` holds its
        weights (every rank reads them at the next :meth:`sync`); otherwise the log says the target restarts."""
        from safetensors import safe_open

        step, value = max(self.judge_curve, key=lambda p: (p[1], -p[0]))  # the first of equal bests, as in training
        path = self.run_dir / GUARD_BEST_FILE
        saved, why = None, "missing"
        if path.is_file():
            try:
                with safe_open(str(path), framework="pt") as f:
                    saved = int((f.metadata() or {})["step"])
                why = f"it holds step {saved}"
            except Exception as exc:  # noqa: BLE001 - a torn or foreign file: safetensors raises its own types
                why = f"unreadable: {type(exc).__name__}"
        if saved == step:
            self.best = (step, value)
            self._pending[3] = 1.0
            return
        log.warning("reward-hacking guard: the weights of the best evaluation before the resume (step %d, %s %.4f) "
                    "are not in %s (%s): the rollback target is the best evaluation from now on", step, self.judge,
                    value, path, why)

    def observe_step(self, step: int, scalars: Mapping[str, float]) -> None:
        """Record the training reward of the step just completed (``step`` = steps completed)."""
        if not (self.enabled and self.is_main):
            return
        if not self._loaded:
            self._load_history(step)
        self.reward_curve.append((step, float(scalars.get(self.cfg.reward, math.nan))))

    def observe_eval(self, step: int, scalars: Mapping[str, float]) -> dict[str, float]:
        """Rank 0, after the evaluation at ``step``: record the judge, decide. Returns the ``eval/guard_*`` entries
        to log with this evaluation (empty unless the guard fires)."""
        if not (self.enabled and self.is_main):
            return {}
        if not self._loaded:
            self._load_history(step)
        value = float(scalars.get(self.judge, math.nan))
        self.judge_curve.append((step, value))
        if math.isfinite(value) and (self.best is None or value > self.best[1]):
            self.best = (step, value)
            self._pending[0] = 1.0
        verdict = detect_reward_hacking(self.judge_curve, self.reward_curve, patience=self.cfg.patience,
                                        min_delta=self.cfg.min_delta)
        if verdict is None:
            return {}
        rollback = self.cfg.action == "rollback" and self.best is not None and self.best[0] != step
        self._pending[1:3] = torch.tensor([1.0, float(rollback)])
        best_step, best_value = self.best if self.best is not None else (step, value)
        self.message = (f"reward-hacking guard: {verdict.describe(self.judge, self.cfg.reward)}: stopping at step "
                        f"{step}" + (f", rolled back to the weights of step {best_step} ({self.judge} "
                                     f"{best_value:.4f})" if rollback else ""))
        return {f"{EVAL_PREFIX}guard_stop": 1.0, f"{EVAL_PREFIX}guard_best_step": float(best_step),
                f"{EVAL_PREFIX}guard_best": best_value, f"{EVAL_PREFIX}guard_rolled_back": float(rollback),
                f"{EVAL_PREFIX}guard_patience": float(self.cfg.patience)}

    def sync(self, policy) -> bool:
        """Every rank, after each step (and after the first evaluation): share rank 0's decision, snapshot the
        weights of a new best evaluation (``action: rollback`` only) or restore them, and say whether the run stops
        now (then :attr:`stopped` is True and :attr:`message`, on rank 0, says why)."""
        if not self.enabled:
            return False
        flags = all_reduce_processes(self._pending.clone(), "max")
        self._pending.zero_()
        snapshot, stop, rollback, recover = (bool(f) for f in flags.tolist())
        names = [n for n in ("live", "old", "ema") if policy.has(n)]
        if recover:
            self._snapshot = self._read_best(names)
        if snapshot and self.cfg.action == "rollback" and not stop:
            self._snapshot = {n: policy.named_weights(n) for n in names}
            if self.is_main and self.run_dir is not None:
                self._write_best()
        if rollback and self._snapshot is not None:
            for name, weights in self._snapshot.items():
                policy.load_named_weights(name, weights)
        if stop:
            self.stopped = True
            if self.message is not None:
                log.warning("%s", self.message)
        return stop

    def _write_best(self) -> None:
        """Rank 0: the snapshot of the best evaluation to ``GUARD_BEST_FILE`` (``<policy>/<key>`` tensors; step, judge key
        and value in the metadata), replacing the previous best atomically."""
        from safetensors.torch import save_file

        flat = {f"{n}/{k}": t.contiguous() for n, weights in self._snapshot.items() for k, t in weights.items()}
        meta = {"step": str(self.best[0]), "judge": str(self.judge), "value": repr(self.best[1])}
        atomic_write(self.run_dir / GUARD_BEST_FILE, lambda tmp: save_file(flat, str(tmp), metadata=meta))

    def _read_best(self, names: Sequence[str]) -> dict[str, dict[str, torch.Tensor]]:
        """Every rank: the snapshot written by :meth:`_write_best`, split back per policy (``names``)."""
        from safetensors.torch import load_file

        flat = load_file(str(self.run_dir / GUARD_BEST_FILE))
        return {n: {k[len(n) + 1:]: t for k, t in flat.items() if k.startswith(f"{n}/")} for n in names}
