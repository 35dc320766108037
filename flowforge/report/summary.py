"""The parts of ``report.html`` that answer first.

* :func:`summary_section`: final and best held-out eval, wall time, samples seen, checkpoints, and the commands that
  export the run and sample from it.
* :func:`first_last_section`: the first and the last eval grid side by side, each image captioned with its prompt
  and scores (from the grid's sidecar, :mod:`flowforge.report.grids`; a grid without one is shown whole).

The headline eval metric is ``eval/<s>`` for the first of ``eval.scorers`` that was logged, else the first logged
``eval/<c>`` of a reward component, else the first other ``eval/*`` metric except ``eval/diversity``. Scores are
higher-is-better (the scorer protocol, :class:`flowforge.rewards.base.RewardScorer`), so "best" is the maximum.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from PIL import Image

from flowforge.config import load_config
from flowforge.data.prompts import IMAGE_TASKS
from flowforge.report.grids import read_grid_cells
from flowforge.report.page import esc, note  # noqa: F401  (re-exported: config.py, run.py)
from flowforge.report.plots import img_tag, series
from flowforge.report.world_strips import crop_png, strip_html
from flowforge.runtime.durable import step_dir_name
from flowforge.runtime.run_dir import (CHECKPOINTS_DIR, CONFIG_FILE, EVAL_FILE, METRICS_FILE, PROVENANCE_FILE,
                                       committed_checkpoints)

Row = dict[str, float]


def fmt(value: float) -> str:
    """4 significant digits; ``nan`` / ``inf`` as such."""
    return f"{value:.4g}" if math.isfinite(value) else str(value)


@dataclass(frozen=True)
class RunInfo:
    """What the report needs from the run's ``config.yaml`` (``None`` / empty when it is absent or unreadable)."""

    raw: dict | None  # config.yaml as parsed YAML
    cfg: Any  # the loaded flowforge Config, or None
    per_step: int | None  # samples per training step: data.prompts_per_step x data.group_size
    eval_scorers: tuple[str, ...]  # eval.scorers
    reward_names: tuple[str, ...]  # reward.weights keys


def read_run_info(run_dir: Path) -> RunInfo:
    """Parse ``run_dir/config.yaml``; never raises (a config that no longer loads still shows as text)."""
    path = run_dir / CONFIG_FILE
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8", errors="replace")) if path.is_file() else None
    except yaml.YAMLError:
        raw = None
    cfg = None
    if isinstance(raw, dict):
        try:
            cfg = load_config(path)
        except (ValueError, OSError, TypeError):  # ConfigError is a ValueError; a run of an older schema
            cfg = None
    if cfg is None:
        return RunInfo(raw if isinstance(raw, dict) else None, None, None, (), ())
    return RunInfo(raw, cfg, cfg.data.prompts_per_step * cfg.data.group_size, tuple(cfg.eval.scorers),
                   tuple(cfg.reward.weights))


GUARD_PREFIX = "eval/guard_"
"""Keys the reward-hacking guard logs with the evaluation that stopped a run (:mod:`flowforge.train.guard`)."""
BILLED_PREFIX = "eval/billed/"
"""``eval/billed/<name>``: requests a paid scorer billed in one evaluation (a count, never a headline score)."""


def guard_key(eval_rows: Sequence[Row] | None, info: RunInfo) -> str | None:
    """The held-out judge the guard watched (``guard.judge``, else the first of ``eval.scorers``), else the
    headline metric."""
    if info.cfg is not None and info.cfg.guard.judge is not None:
        return info.cfg.guard.judge
    return headline_key(eval_rows, info)


def guard_event(eval_rows: Sequence[Row] | None, judge: str | None) -> tuple[int, str] | None:
    """``(step, what the reward-hacking guard did)`` when it stopped the run, from ``eval.jsonl``; else None."""
    row = next((r for r in eval_rows or [] if r.get(GUARD_PREFIX + "stop") == 1.0), None)
    if row is None:
        return None
    step, patience = int(row["step"]), int(row.get(GUARD_PREFIX + "patience", 0))
    window = [r for r in eval_rows if r["step"] <= step and judge in r][-(patience + 1):] if judge else []
    falls = " → ".join(f"{fmt(r[judge])} (step {int(r['step'])})" for r in window)
    text = (f"stopped the run at step {step}: held-out {judge} fell at {patience} consecutive evaluations ({falls}) "
            "while the training reward rose (reward hacking)")
    if row.get(GUARD_PREFIX + "rolled_back") == 1.0:
        text += (f"; rolled back to the weights of step {int(row[GUARD_PREFIX + 'best_step'])} ({judge} "
                 f"{fmt(row[GUARD_PREFIX + 'best'])}): the final checkpoint holds them")
    return step, text


def headline_key(eval_rows: Sequence[Row] | None, info: RunInfo) -> str | None:
    """The eval metric the summary leads with (module docstring), or ``None`` when none was logged."""
    keys = {k for row in eval_rows or [] for k in row if k != "step"}
    for name in (*info.eval_scorers, *info.reward_names):
        if f"eval/{name}" in keys:
            return f"eval/{name}"
    rest = sorted(k for k in keys if k not in ("eval/diversity", "eval/sample_change")
                  and not k.startswith((GUARD_PREFIX, BILLED_PREFIX)))
    return rest[0] if rest else None


SUBSTAGE_TIMES = ("time/reward_wait",)
"""``time/*`` keys that are parts of a stage's time (``time/reward_wait`` lies within ``time/reward``), not summed."""


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h} h {m:02d} min" if h else (f"{m} min {s:02d} s" if m else f"{s} s")


def _wall_time(run_dir: Path, train_rows: Sequence[Row] | None) -> str:
    """Elapsed time from the (last) start, read from ``provenance.json``, to the last log line; and the training
    stages' own time summed over the logged steps (``time/*``: covers resumed sessions, excludes evals)."""
    parts = []
    stage = sum(v for row in train_rows or [] for k, v in row.items()
                if k.startswith("time/") and k not in SUBSTAGE_TIMES and math.isfinite(v))
    logs = [run_dir / f for f in (METRICS_FILE, EVAL_FILE) if (run_dir / f).is_file()]
    try:
        start = _dt.datetime.fromisoformat(json.loads((run_dir / PROVENANCE_FILE).read_text())["time_utc"])
        elapsed = max(p.stat().st_mtime for p in logs) - start.timestamp() if logs else math.nan
    except (OSError, ValueError, KeyError, TypeError):
        elapsed = math.nan
    if math.isfinite(elapsed) and elapsed >= 0:
        parts.append(f"{_duration(elapsed)} (start to last log line)")
    if stage > 0:
        parts.append(f"{_duration(stage)} in training stages (summed over steps, evals excluded)")
    return "; ".join(parts) or "unknown"


def _mfu_line(train_rows: Sequence[Row]) -> str:
    """Median ``perf/mfu`` (and of the rollout and update alone) and ``perf/tflops`` over the steps, and the peak
    (:mod:`flowforge.train.perf`; ``train.log`` says where the peak comes from)."""
    def median(key: str) -> float:
        values = sorted(v for r in train_rows if math.isfinite(v := r.get(key, math.nan)))
        return values[len(values) // 2] if values else math.nan

    return (f"MFU {median('perf/mfu'):.2%} (rollout {median('perf/mfu_rollout'):.2%}, update "
            f"{median('perf/mfu_update'):.2%}), {median('perf/tflops'):.4g} TFLOP/s, median over steps, of a peak "
            f"of {median('perf/peak_tflops'):.4g} TFLOP/s (train.log says whether measured or from the datasheet)")


def billed_line(train_rows: Sequence[Row] | None, eval_rows: Sequence[Row] | None, info: RunInfo) -> str | None:
    """Every billed request of the run per scorer: the training steps' ``reward/<name>_billed`` plus the
    evaluations' ``eval/billed/<name>`` (each a count of its own step or evaluation), beside the scorer's
    ``max_billed`` and ``eval.teacher_groups``; None when no scorer counts billed requests."""
    def total(rows: Sequence[Row] | None, key: str) -> int:
        return int(sum(v for r in rows or [] if math.isfinite(v := r.get(key, math.nan))))

    names = dict.fromkeys([k[len("reward/"):-len("_billed")] for r in train_rows or [] for k in r
                           if k.startswith("reward/") and k.endswith("_billed")]
                          + [k[len(BILLED_PREFIX):] for r in eval_rows or [] for k in r if k.startswith(BILLED_PREFIX)])
    if not names:
        return None
    cfg, parts = info.cfg, []
    for name in names:
        train, evals = total(train_rows, f"reward/{name}_billed"), total(eval_rows, BILLED_PREFIX + name)
        cap = cfg.reward.options.get(name, {}).get("max_billed") if cfg is not None else None
        parts.append(f"{name}: {train + evals} billed requests ({train} in training, {evals} in evaluation)"
                     + (f" of max_billed {cap}" if cap else " (no max_billed cap)" if cap == 0 else ""))
    groups = f"; eval.teacher_groups={cfg.eval.teacher_groups}" if cfg is not None else ""
    return "; ".join(parts) + groups


def _checkpoints(run_dir: Path) -> str:
    steps = []
    for path in committed_checkpoints(run_dir):
        try:
            steps.append(int(path.name.rsplit("_", 1)[-1]))
        except ValueError:
            continue
    if not steps:
        return "none committed (nothing to export or sample from)"
    return f"{len(steps)} committed, steps {', '.join(map(str, steps))} (newest: {CHECKPOINTS_DIR}/" \
           f"{step_dir_name(steps[-1])})"


GROUP_KEYS = ("eval/diversity", "eval/group_diversity")
"""Eval metrics that compare the samples of one prompt with each other: NaN with ``eval.samples_per_prompt`` 1."""


def missing_reason(key: str, info: RunInfo) -> str:
    """Why the eval metric ``key`` has no finite value, in words a user can act on."""
    k = info.cfg.eval.samples_per_prompt if info.cfg is not None else None
    if key in GROUP_KEYS:
        needs = f"{key} compares samples of the same prompt, so it needs eval.samples_per_prompt >= 2"
        if k is not None and k < 2:
            return f"not measured: {needs} (this run: {k})"
        return f"no finite values ({needs}; this run: {k if k is not None else 'unknown'})"
    return "no finite values (every held-out sample scored NaN)"


def _eval_line(eval_rows: Sequence[Row], key: str, with_best: bool = True, info: RunInfo | None = None) -> str:
    steps, values = series(eval_rows, key)
    finite = [(s, v) for s, v in zip(steps, values) if math.isfinite(v)]
    if not finite:
        return esc(missing_reason(key, info)) if info is not None else "no finite values"
    text = f"final <strong>{esc(fmt(finite[-1][1]))}</strong> (step {int(finite[-1][0])})"
    if with_best:
        best = max(finite, key=lambda sv: sv[1])
        text += f" · best <strong>{esc(fmt(best[1]))}</strong> (step {int(best[0])})"
    return text + f" · start {esc(fmt(finite[0][1]))} (step {int(finite[0][0])})"


def _commands(run_dir: Path, name: str, prompt: str, prompt_file: str | None = None) -> str:
    """The export and sample commands; ``prompt_file`` (an image task's eval prompts: its prompts need their
    condition image, a world model's its first frame) replaces ``--prompt``."""
    run, out = shlex.quote(str(run_dir)), shlex.quote(f"exports/{name}")
    given = f"--prompt {shlex.quote(prompt)}" if prompt_file is None else f"--prompt-file {shlex.quote(prompt_file)}"
    lines = [f"flowforge export {run} {out} --form merged --verify",
             f"flowforge sample {out} {given} --out grid.png",
             f"flowforge sample {run} {given} --num 4 --seed 0 --out grid.png"]
    return f"<pre class=\"cmd\">{esc(chr(10).join(lines))}</pre>"


def summary_section(run_dir: Path, info: RunInfo, train_rows: list[Row] | None, eval_rows: list[Row] | None,
                    grids: Sequence[tuple[int, Path]]) -> str:
    """The answer first: a key-value table and the export / sample commands."""
    rows: list[tuple[str, str]] = []
    key = headline_key(eval_rows, info)
    if key is not None:
        rows.append((f"held-out {esc(key)}", _eval_line(eval_rows, key, info=info)))
        if key != "eval/diversity" and any("eval/diversity" in r for r in eval_rows):
            # not a score: higher is not better, so no "best"
            rows.append(("held-out eval/diversity", _eval_line(eval_rows, "eval/diversity", False, info)))
    else:
        rows.append(("held-out eval", "none logged"))
    event = guard_event(eval_rows, guard_key(eval_rows, info))
    if event is not None:
        rows.append(("reward-hacking guard", esc(event[1])))
    if train_rows and any("reward/total_mean" in r for r in train_rows):
        _, total = series(train_rows, "reward/total_mean")
        rows.append(("training reward (batch mean)", f"{esc(fmt(total[0]))} → {esc(fmt(total[-1]))}"))
    last = int(train_rows[-1]["step"]) if train_rows else 0
    planned = f" of {info.cfg.train.steps}" if info.cfg is not None else ""
    rows.append(("steps", f"{last}{planned}"))
    seen = f"{last * info.per_step:,} ({info.cfg.data.prompts_per_step} prompts × {info.cfg.data.group_size} " \
           "candidates per step)" if info.per_step else "unknown (no readable config.yaml)"
    rows.append(("samples seen", esc(seen)))
    rows.append(("wall time", esc(_wall_time(run_dir, train_rows))))
    if train_rows and any("perf/mfu" in r for r in train_rows):
        rows.append(("compute (perf/mfu)", esc(_mfu_line(train_rows))))
    rows.append(("checkpoints", esc(_checkpoints(run_dir))))
    billed = billed_line(train_rows, eval_rows, info)
    if billed is not None:
        rows.append(("budget: billed requests", esc(billed)))
    if info.cfg is not None:
        c = info.cfg
        reward = " + ".join(f"{w:g} {name}" for name, w in c.reward.weights.items())
        rows.append(("run", esc(f"{c.train.algorithm} on {c.model.adapter} {c.model.path} ({c.lora.trainable}); "
                                f"reward {reward}")))
    prompt = next((cells[0]["prompt"] for cells in (read_grid_cells(p) for _, p in grids[-1:]) if cells), "...")
    body = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    name = info.cfg.run.name if info.cfg is not None else run_dir.resolve().name
    image_task = info.cfg is not None and info.cfg.model.task in IMAGE_TASKS
    prompt_file = info.cfg.data.eval_prompts if image_task else None
    return (f'<h2 id="summary">Summary</h2><table class="kv summary">{body}</table>'
            f"<p>Export the trained model and generate with it:</p>{_commands(run_dir, name, prompt, prompt_file)}")


def _scores_text(scores: dict, first: str | None) -> str:
    names = sorted(scores, key=lambda n: (n != first, n))
    return " · ".join(f"{n} {fmt(v) if isinstance(v, (int, float)) else 'nan'}" for n, v in
                      ((n, scores[n]) for n in names))


def _grid_column(step: int, path: Path, eval_rows: list[Row] | None, headline: str | None) -> str:
    row = {int(r["step"]): r for r in eval_rows or []}.get(step)
    title = f"step {step}"
    if row is not None and headline in row:
        title += f" — {headline} {fmt(row[headline])}"
    cells = read_grid_cells(path)
    parts = [f'<div class="column"><h3>{esc(title)}</h3>']
    if cells is None:
        parts.append(img_tag(path.read_bytes(), f"eval grid at step {step}", "compare"))
        parts.append(note("No per-image prompts and scores were saved with this grid."))
        return "".join(parts) + "</div>"
    first = headline.removeprefix("eval/") if headline else None
    with Image.open(path) as grid:
        grid.load()
        parts.append('<div class="cells">')
        for cell in cells:
            if "frames" in cell:  # a video labelled per frame: generated frame, action, real frame per column
                parts.append(strip_html(grid, path, step, cell, _scores_text(cell["scores"], first)))
                continue
            caption = f"{cell['prompt']} — {_scores_text(cell['scores'], first)}"
            image = img_tag(crop_png(grid, cell["box"]), f"step {step}: {cell['prompt']}", "cell")
            parts.append(f'<div class="cell">{image}<div class="cap">{esc(caption)}</div></div>')
        parts.append("</div>")
    return "".join(parts) + "</div>"


def first_last_section(grids: Sequence[tuple[int, Path]], eval_rows: list[Row] | None, headline: str | None) -> str:
    """The first and the last eval grid side by side (one grid when there is only one)."""
    head = '<h2 id="first-last">First and last eval samples</h2>'
    if not grids:
        return head + note("No eval sample grids in this run directory.")
    chosen = [grids[0]] if len(grids) == 1 else [grids[0], grids[-1]]
    columns = "".join(_grid_column(step, path, eval_rows, headline) for step, path in chosen)
    videos = any("frames" in cell for cell in read_grid_cells(chosen[0][1]) or [])
    # enlarged frame strips need the page's width: the first grid above the last instead of beside it
    return head + f'<div class="first-last{" stacked" if videos else ""}">{columns}</div>'
