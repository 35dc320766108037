"""One self-contained HTML page per run that answers first: the verdict, the summary, then samples, curves, config.

``write_report(run_dir)`` reads the run directory (``runs/<name>/``, docs/guides/runs.md) and writes
``<run_dir>/report.html``; every image is embedded as a base64 PNG, so the file can be mailed or archived alone.
Also ``python -m flowforge.report.run RUN_DIR [--smooth A]`` and ``flowforge report RUN_DIR``.

=========================  ===========================================================================================
section                    read from, shown as
=========================  ===========================================================================================
Verdict                    the headline eval metric start → end with its standard error (from every eval sample's
                           score, kept in the grid sidecars) and whether the change exceeds 2 standard errors;
                           diversity start → end or why it was not measured; the held-out curve beside it, ± 1 SE
                           (:mod:`flowforge.report.verdict`)
Summary                    final / best / first held-out eval, training reward, steps, samples seen, wall time,
                           committed checkpoints, and the ``flowforge export`` / ``flowforge sample`` commands
                           (:mod:`flowforge.report.summary`)
First and last samples     the first and the last ``samples/step_*.png`` side by side, each image cropped out and
                           captioned with its prompt and scores from the grid's sidecar
                           (:mod:`flowforge.report.grids`); a video labelled per frame (a world model's actions)
                           as one column per frame: the generated frame upscaled (nearest neighbour) to at least
                           128 px wide, the commanded action under it, the real frame of the recorded clip under
                           that (:mod:`flowforge.report.world_strips`)
Evaluation                 training reward vs held-out judge vs diversity on one panel (with where and why the
                           reward-hacking guard stopped the run, :mod:`flowforge.train.guard`); ``eval.jsonl``: the
                           headline eval metric beside ``eval/diversity``, every other ``eval/*`` (the guard's
                           ``eval/guard_*`` entries aside), a first / last / min / max table
Training                   ``metrics.jsonl``: reward mean per training component (± std band), ``train/loss``,
                           ``train/clip_fraction``, ``train/approx_kl``, ``train/diversity``, then one figure per
                           namespace; eval-only scorers (``eval.scorers`` without a reward weight) and metrics that
                           are 0 at every step are folded away (``<details>``)
Samples                    every grid in step order, captioned with that step's eval values (folded)
Config                     ``config.yaml`` as a diff against the defaults, the full file folded
                           (:mod:`flowforge.report.config`)
Provenance                 ``provenance.json``: torch / diffusers / transformers / peft versions first
=========================  ===========================================================================================

Curves have the step on the x-axis and samples seen (``data.prompts_per_step x data.group_size`` per step) on a
second axis on top; a y axis's offset / multiplier (``1e-4``) is written in its label, never over the title;
``smoothing`` draws TensorBoard's debiased moving average over the raw training curves
(:mod:`flowforge.report.plots`). Missing files are reported in the page, never an error. JSONL reading
tolerates what killed and resumed runs leave behind (see :func:`read_jsonl`). All text from the run directory is
HTML-escaped. The page's style is :mod:`flowforge.report.page`'s, shared with the pipeline report.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flowforge.report.config import config_section, provenance_section
from flowforge.report.grids import read_grid_cells
from flowforge.report.plots import (figure_tag, img_tag, is_constant_zero, plot_panels, plot_reward_vs_judge,
                                    series)
from flowforge.report.page import render_page
from flowforge.report.summary import (GROUP_KEYS, GUARD_PREFIX, RunInfo, esc, first_last_section, fmt, guard_event,
                                      guard_key, headline_key, missing_reason, note, read_run_info, summary_section)
from flowforge.report.verdict import eval_points, headline_change, verdict_section
from flowforge.runtime.durable import atomic_write
from flowforge.runtime.errors import UserError
from flowforge.runtime.run_dir import EVAL_FILE, METRICS_FILE, RUN_FILES, SAMPLES_DIR, existing_run

REPORT_FILE = "report.html"
TRAIN_KEYS = ("train/loss", "train/clip_fraction", "train/approx_kl", "train/diversity")
EVAL_HEADLINE_KEYS = ("eval/digit_eval", "eval/diversity")
"""The embedded default's headline pair (other runs lead with their own headline metric beside ``eval/diversity``)."""
_GRID_NAME = re.compile(r"^step_(\d+)\.png$")

Row = dict[str, float]


# --------------------------------------------------------------------------------------------------------------------
# reading


def read_jsonl(path: Path) -> tuple[list[Row], list[str]]:
    """Read a metrics JSONL file into one merged row per step, sorted by step.

    Rules, so that killed and resumed runs read correctly:

    * lines that are not a JSON object with an integer ``"step"`` (e.g. a line cut off by a kill) are skipped and
      reported in the returned problems;
    * several lines of the same step are merged, later values winning;
    * when the step goes *back* (a run resumed from an earlier checkpoint), rows of every step ``>=`` the new step
      logged before it are dropped: the resumed run supersedes them;
    * ``null`` (how non-finite values are written) and non-numeric values read as NaN.

    Returns:
        ``(rows, problems)``: rows as ``{"step": float(n), key: value, ...}``; problems as human-readable strings.
    """
    rows: dict[int, Row] = {}
    problems: list[str] = []
    last_step: int | None = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                problems.append(f"{path.name}:{lineno}: not valid JSON (skipped)")
                continue
            step = record.get("step") if isinstance(record, dict) else None
            if isinstance(step, bool) or not isinstance(step, int):
                problems.append(f"{path.name}:{lineno}: no integer 'step' (skipped)")
                continue
            if last_step is not None and step < last_step:
                dropped = [s for s in rows if s >= step]
                for s in dropped:
                    del rows[s]
                problems.append(f"{path.name}:{lineno}: step went back from {last_step} to {step} (resumed run); "
                                f"{len(dropped)} earlier step(s) superseded")
            last_step = step
            row = rows.setdefault(step, {"step": float(step)})
            for key, value in record.items():
                if key != "step":
                    row[key] = _to_float(value)
    return [rows[s] for s in sorted(rows)], problems


def _to_float(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else math.nan  # null (non-finite) and odd values → NaN


def _keys(rows: Sequence[Row]) -> list[str]:
    seen: dict[str, None] = {}
    for row in rows:
        for key in row:
            if key != "step":
                seen.setdefault(key, None)
    return sorted(seen)


def find_grids(run_dir: Path) -> list[tuple[int, Path]]:
    """``[(step, samples/step_<n>.png)]`` sorted by step (numerically; other files ignored)."""
    folder = run_dir / SAMPLES_DIR
    grids = []
    if folder.is_dir():
        for path in folder.iterdir():
            match = _GRID_NAME.match(path.name)
            if match and path.is_file():
                grids.append((int(match.group(1)), path))
    return sorted(grids)


def eval_only_keys(keys: Sequence[str], info: RunInfo) -> list[str]:
    """The ``reward/<s>_*`` training metrics of scorers that are in ``eval.scorers`` but have no reward weight:
    scored on training batches, never trained on. A key belongs to the longest scorer name it starts with, so
    ``reward/digit_eval_mean`` is ``digit_eval``'s, not ``digit``'s."""
    eval_only = set(info.eval_scorers) - set(info.reward_names)
    names = sorted({*info.eval_scorers, *info.reward_names}, key=len, reverse=True)
    out = []
    for key in keys:
        if key.startswith("reward/"):
            owner = next((n for n in names if key[len("reward/"):].startswith(n + "_")), None)
            if owner in eval_only:
                out.append(key)
    return out


# --------------------------------------------------------------------------------------------------------------------
# sections


def _folded(title: str, figure: str) -> str:
    return f"<details><summary>{esc(title)}</summary>{figure}</details>"


def _train_section(rows: list[Row] | None, problems: list[str], info: RunInfo, smoothing: float) -> str:
    parts = ['<h2 id="training">Training</h2>']
    if rows is None:
        return "".join(parts) + note(f"No {METRICS_FILE} in this run directory: no training curves.")
    if not rows:
        return "".join(parts) + note(f"{METRICS_FILE} holds no readable lines.")
    keys = _keys(rows)
    plot = lambda ks, **kw: plot_panels(rows, ks, per_step=info.per_step, smoothing=smoothing, **kw)  # noqa: E731
    eval_only = eval_only_keys(keys, info)
    zero = [k for k in keys if k not in eval_only and is_constant_zero(rows, k)]
    used: set[str] = set(eval_only) | set(zero)

    parts.append("<h3>Reward (training batches)</h3>")
    means = [k for k in keys if k.startswith("reward/") and k.endswith("_mean") and k not in used]
    if means:
        bands = {m: m[: -len("_mean")] + "_std" for m in means if m[: -len("_mean")] + "_std" in keys}
        parts.append(figure_tag(plot(means, bands=bands), "training reward mean per component"))
        used.update(means, bands.values())
    else:
        parts.append(note("No reward/*_mean metrics logged."))

    parts.append("<h3>Optimisation and diversity</h3>")
    present = [k for k in TRAIN_KEYS if k in keys and k not in used]
    if present:
        parts.append(figure_tag(plot(present), "training loss, clip fraction, approx KL, diversity"))
        used.update(present)
    missing = [k for k in TRAIN_KEYS if k not in keys]
    if missing:
        parts.append(note("Not logged: " + ", ".join(missing) + "."))

    rest = [k for k in keys if k not in used]
    if rest:
        parts.append("<h3>Other metrics</h3>")
        by_namespace: dict[str, list[str]] = {}
        for key in rest:
            by_namespace.setdefault(key.split("/", 1)[0] if "/" in key else "(no namespace)", []).append(key)
        for namespace, group in by_namespace.items():
            parts.append(f"<h4>{esc(namespace)}</h4>")
            parts.append(figure_tag(plot(group, ncols=4), f"{namespace} metrics"))
    if eval_only:
        title = f"Eval-only scorers on training batches (not trained on): {', '.join(eval_only)}"
        parts.append(_folded(title, figure_tag(plot(eval_only, ncols=4), "eval-only scorers on training batches")))
    if zero:
        title = f"{len(zero)} metric(s) 0 at every step: {', '.join(zero)}"
        parts.append(_folded(title, figure_tag(plot(zero, ncols=4), "metrics that are 0 at every step")))
    parts.extend(note(p) for p in problems)
    return "".join(parts)


def _hacking_panel(train_rows: list[Row] | None, rows: list[Row], judge: str | None, per_step: int | None) -> str:
    """Training reward vs held-out judge vs diversity on one panel, and what the reward-hacking guard did."""
    if judge is None or not train_rows:
        return ""
    event = guard_event(rows, judge)
    fig = plot_reward_vs_judge(train_rows, rows, judge, stop_step=event[0] if event else None, per_step=per_step)
    text = f"Reward-hacking guard {event[1]}." if event else ""
    return figure_tag(fig, "training reward vs held-out judge vs diversity") + (
        f'<p class="guard"><b>{esc(text)}</b></p>' if text else "")


def _eval_section(rows: list[Row] | None, problems: list[str], headline: str | None,
                  train_rows: list[Row] | None = None, info: RunInfo | None = None) -> str:
    parts = ['<h2 id="evaluation">Evaluation</h2>']
    if rows is None:
        return "".join(parts) + note(f"No {EVAL_FILE} in this run directory: no evaluation was logged.")
    if not rows:
        return "".join(parts) + note(f"{EVAL_FILE} holds no readable lines.")
    if info is not None:
        parts.append(_hacking_panel(train_rows, rows, guard_key(rows, info), info.per_step))
    keys = [k for k in _keys(rows) if not k.startswith(GUARD_PREFIX)]  # the guard's event is told above
    pair = EVAL_HEADLINE_KEYS if headline in (None, EVAL_HEADLINE_KEYS[0]) else (headline, "eval/diversity")
    shown = [k for k in pair if k in keys]
    # a metric without a finite value says why on its panel and under it (diversity needs >= 2 samples a prompt)
    empty = {k: missing_reason(k, info).replace(": ", ":\n", 1) for k in keys
             if info is not None and k in GROUP_KEYS and not any(math.isfinite(v) for v in series(rows, k)[1])}
    if shown:
        # the eval score and diversity next to each other: a reward gain bought by collapse shows as one rising
        # while the other falls
        alt = "DigitEval and eval diversity" if pair == EVAL_HEADLINE_KEYS else f"{headline} and eval diversity"
        parts.append(figure_tag(plot_panels(rows, shown, markers=True, ncols=2, empty=empty), alt))
    missing = [k for k in pair if k not in keys]
    if missing:
        parts.append(note("Not logged: " + ", ".join(missing) + "."))
    rest = [k for k in keys if k not in shown]
    if rest:
        parts.append(figure_tag(plot_panels(rows, rest, markers=True, empty=empty), "other evaluation metrics"))
    parts.extend(note(f"{k}: {missing_reason(k, info)}.") for k in empty)
    parts.append("<table><tr><th>metric</th><th>first</th><th>last</th><th>min</th><th>max</th></tr>")
    for key in keys:
        _, values = series(rows, key)
        finite = [v for v in values if math.isfinite(v)]
        lo, hi = (fmt(min(finite)), fmt(max(finite))) if finite else ("–", "–")
        parts.append(f"<tr><td>{esc(key)}</td><td>{esc(fmt(values[0]))}</td><td>{esc(fmt(values[-1]))}</td>"
                     f"<td>{esc(lo)}</td><td>{esc(hi)}</td></tr>")
    parts.append("</table>")
    parts.extend(note(p) for p in problems)
    return "".join(parts)


def _audio_tags(grid: Path) -> str:
    """An ``<audio>`` player (the WAV embedded as a data URI) per cell of ``grid`` that has a sound file (an
    audio-video model's eval samples, :func:`flowforge.report.grids.save_eval_grid`), labelled with its prompt;
    "" when none has one."""
    players = []
    for cell in read_grid_cells(grid) or []:
        name = cell.get("audio")
        wav = grid.with_name(name) if isinstance(name, str) and "/" not in name else None
        if wav is None or not wav.is_file():
            continue
        data = base64.b64encode(wav.read_bytes()).decode("ascii")
        players.append(f'<div class="audio"><span>{esc(cell["prompt"])}</span> '
                       f'<audio controls preload="none" src="data:audio/wav;base64,{data}"></audio></div>')
    return "".join(players)


def _samples_section(grids: list[tuple[int, Path]], eval_rows: list[Row] | None) -> str:
    parts = ['<h2 id="samples">Samples</h2>']
    if not grids:
        return "".join(parts) + note(f"No sample grids ({SAMPLES_DIR}/step_*.png) in this run directory.")
    by_step = {int(row["step"]): row for row in eval_rows or []}
    parts.append(f"<details><summary>All {len(grids)} eval grids in step order (first sample of each held-out "
                 'prompt)</summary><div class="grids">')
    for step, path in grids:
        row = by_step.get(step)
        if row is None:
            caption = f"step {step} — no eval logged at this step"
        else:
            values = " · ".join(f"{k} {fmt(v)}" for k, v in row.items() if k != "step")
            caption = f"step {step} — {values}"
        parts.append(f'<figure>{img_tag(path.read_bytes(), f"samples at step {step}", "grid")}'
                     f"<figcaption>{esc(caption)}</figcaption>{_audio_tags(path)}</figure>")
    parts.append("</div></details>")
    return "".join(parts)


def write_report(run_dir: Path, *, smoothing: float = 0.0) -> Path:
    """Write ``<run_dir>/report.html`` (atomically) from the run directory's files and return its path.

    Args:
        run_dir: the run directory.
        smoothing: weight in [0, 1) of the moving average drawn over the raw training curves; 0 = raw only.

    Raises:
        FileNotFoundError: ``run_dir`` is not a directory. Missing files inside it are noted in the page instead.
        UserError: ``run_dir`` holds none of the files a run writes (:data:`flowforge.runtime.run_dir.RUN_FILES`).
        ValueError: ``smoothing`` outside [0, 1).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    if not existing_run(run_dir):  # never drop a report.html into a directory flowforge did not write
        raise UserError(run_dir, f"is not a flowforge run directory (none of {list(RUN_FILES)} in it)",
                        "give the directory `flowforge train` wrote (runs/<name>)")
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    train_rows = train_problems = eval_rows = eval_problems = None
    if (run_dir / METRICS_FILE).is_file():
        train_rows, train_problems = read_jsonl(run_dir / METRICS_FILE)
    if (run_dir / EVAL_FILE).is_file():
        eval_rows, eval_problems = read_jsonl(run_dir / EVAL_FILE)
    info, grids = read_run_info(run_dir), find_grids(run_dir)
    headline = headline_key(eval_rows, info)
    steps = f"{len(train_rows)} steps logged" if train_rows else "no training steps logged"
    if train_rows:
        steps += f" ({int(train_rows[0]['step'])}–{int(train_rows[-1]['step'])})"
    name = run_dir.resolve().name
    sections = [
        verdict_section(info, train_rows, eval_rows, grids, headline),
        summary_section(run_dir, info, train_rows, eval_rows, grids),
        first_last_section(grids, eval_rows, headline),
        _eval_section(eval_rows, eval_problems or [], headline, train_rows, info),
        _train_section(train_rows, train_problems or [], info, smoothing),
        _samples_section(grids, eval_rows),
        config_section(run_dir),
        provenance_section(run_dir),
    ]
    nav = [("verdict", "Verdict"), ("summary", "Summary"), ("first-last", "First / last samples"),
           ("evaluation", "Evaluation"), ("training", "Training"), ("samples", "Samples"), ("config", "Config"),
           ("provenance", "Provenance")]
    text = render_page(f"flowforge report — {name}", f"{run_dir.resolve()} · {steps}", nav, sections)
    path = run_dir / REPORT_FILE
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return path


def run_headline(run_dir: Path) -> str | None:
    """One line of HTML for a run directory's headline eval metric -- ``key a → b (step s0 → s1): change ± SE`` as
    the verdict writes it -- for pages that link runs (the pipeline report); None when it logged no finite eval."""
    path = Path(run_dir) / EVAL_FILE
    if not path.is_file():
        return None
    rows, _ = read_jsonl(path)
    key = headline_key(rows, read_run_info(Path(run_dir)))
    if key is None or not any(math.isfinite(v) for v in series(rows, key)[1]):
        return None
    head, facts = headline_change(key, rows, eval_points(find_grids(Path(run_dir)), key))
    return head + (f" · {facts[0]}" if facts else "")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m flowforge.report.run RUN_DIR [--smooth A]``: write the report and print its path."""
    parser = argparse.ArgumentParser(prog="python -m flowforge.report.run", description=__doc__.split("\n", 1)[0])
    parser.add_argument("run_dir", type=Path, help="a run directory (holding metrics.jsonl, config.yaml, ...)")
    parser.add_argument("--smooth", type=float, default=0.0, metavar="A",
                        help="moving-average weight in [0, 1) drawn over the training curves (default 0: raw)")
    args = parser.parse_args(argv)
    try:
        path = write_report(args.run_dir, smoothing=args.smooth)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
