"""One self-contained HTML page per run: curves, sample grids, resolved config, provenance.

``write_report(run_dir)`` reads the run directory (DESIGN §6) and writes ``<run_dir>/report.html``; every image is
embedded as a base64 PNG, so the file can be mailed or archived alone. Also ``python -m flowforge.train.report RUN_DIR``.

==================================  ====================================================================================
read from                           shown as
==================================  ====================================================================================
``metrics.jsonl``                   reward mean per component (``reward/<c>_mean``, ± ``reward/<c>_std`` band);
                                    ``train/loss``, ``train/clip_fraction``, ``train/approx_kl``, ``train/diversity``;
                                    every other key, one figure per namespace (``perf/``, ``time/``, ...)
``eval.jsonl``                      ``eval/digit_eval`` and ``eval/diversity`` side by side, then every other ``eval/*``
``samples/step_*.png``              the grids in step order, captioned with the step and that step's eval values
``config.yaml``                     verbatim
``provenance.json``                 a table (written by :func:`flowforge.train.metrics.write_provenance`)
==================================  ====================================================================================

Missing files are reported in the page, never an error. JSONL reading tolerates what killed and resumed runs leave
behind (see :func:`read_jsonl`). All text from the run directory is HTML-escaped.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from flowforge.runtime.durable import atomic_write
from flowforge.train.metrics import (
    CONFIG_FILE,
    EVAL_FILE,
    METRICS_FILE,
    PROVENANCE_FILE,
    SAMPLES_DIR,
)

REPORT_FILE = "report.html"
TRAIN_KEYS = ("train/loss", "train/clip_fraction", "train/approx_kl", "train/diversity")
EVAL_HEADLINE_KEYS = ("eval/digit_eval", "eval/diversity")
_GRID_NAME = re.compile(r"^step_(\d+)\.png$")
_PANEL_W, _PANEL_H, _DPI = 4.2, 2.9, 90

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


def _series(rows: Sequence[Row], key: str) -> tuple[list[float], list[float]]:
    pairs = [(row["step"], row[key]) for row in rows if key in row]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _keys(rows: Sequence[Row]) -> list[str]:
    seen: dict[str, None] = {}
    for row in rows:
        for key in row:
            if key != "step":
                seen.setdefault(key, None)
    return sorted(seen)


# --------------------------------------------------------------------------------------------------------------------
# figures


def _figure(n_panels: int, ncols: int = 3) -> tuple[Figure, list[Any]]:
    ncols = max(1, min(ncols, n_panels))
    nrows = math.ceil(n_panels / ncols)
    width, height = _PANEL_W * ncols, _PANEL_H * nrows
    # Figure directly (not pyplot): no global state, Agg canvas, safe headless. Fixed margins in inches instead of a
    # layout engine, which would draw every figure twice.
    fig = Figure(figsize=(width, height), dpi=_DPI)
    fig.subplots_adjust(left=0.8 / width, right=1 - 0.15 / width, bottom=0.5 / height, top=1 - 0.3 / height,
                        wspace=0.95 / (_PANEL_W - 0.95), hspace=0.8 / (_PANEL_H - 0.8))
    axes = list(fig.subplots(nrows, ncols, squeeze=False).ravel())
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    return fig, axes[:n_panels]


def _style(ax: Any, title: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(True, alpha=0.3)


def _plot_panels(rows: Sequence[Row], keys: Sequence[str], *, bands: Mapping[str, str] | None = None,
                 markers: bool = False, ncols: int = 3) -> Figure:
    fig, axes = _figure(len(keys), ncols)
    for ax, key in zip(axes, keys):
        steps, values = _series(rows, key)
        ax.plot(steps, values, marker="o" if markers else None, markersize=3, linewidth=1.3, color="C0")
        std_key = (bands or {}).get(key)
        if std_key is not None:
            band_steps, band_mean, band_std = [], [], []
            for row in rows:
                if key in row and std_key in row:
                    band_steps.append(row["step"])
                    band_mean.append(row[key])
                    band_std.append(row[std_key])
            ax.fill_between(band_steps, [m - s for m, s in zip(band_mean, band_std)],
                            [m + s for m, s in zip(band_mean, band_std)], color="C0", alpha=0.2, linewidth=0,
                            label="± std")
            ax.legend(fontsize=7, loc="best")
        if values and not any(math.isfinite(v) for v in values):
            ax.text(0.5, 0.5, "no finite values", transform=ax.transAxes, ha="center", va="center", fontsize=9)
        _style(ax, key)
    return fig


def _img_tag(png: bytes, alt: str, css_class: str = "plot") -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img class="{css_class}" alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _figure_tag(fig: Figure, alt: str) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return _img_tag(buffer.getvalue(), alt)


# --------------------------------------------------------------------------------------------------------------------
# sections


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _note(text: str) -> str:
    return f'<p class="note">{_esc(text)}</p>'


def _fmt(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def _train_section(rows: list[Row] | None, problems: list[str]) -> str:
    parts = ['<h2 id="training">Training</h2>']
    if rows is None:
        return "".join(parts) + _note(f"No {METRICS_FILE} in this run directory: no training curves.")
    if not rows:
        return "".join(parts) + _note(f"{METRICS_FILE} holds no readable lines.")
    keys = _keys(rows)
    used: set[str] = set()

    parts.append("<h3>Reward (training batches)</h3>")
    means = [k for k in keys if k.startswith("reward/") and k.endswith("_mean")]
    if means:
        bands = {m: m[: -len("_mean")] + "_std" for m in means if m[: -len("_mean")] + "_std" in keys}
        parts.append(_figure_tag(_plot_panels(rows, means, bands=bands), "training reward mean per component"))
        used.update(means, bands.values())
    else:
        parts.append(_note("No reward/*_mean metrics logged."))

    parts.append("<h3>Optimisation and diversity</h3>")
    present = [k for k in TRAIN_KEYS if k in keys]
    if present:
        parts.append(_figure_tag(_plot_panels(rows, present), "training loss, clip fraction, approx KL, diversity"))
        used.update(present)
    missing = [k for k in TRAIN_KEYS if k not in keys]
    if missing:
        parts.append(_note("Not logged: " + ", ".join(missing) + "."))

    rest = [k for k in keys if k not in used]
    if rest:
        parts.append("<h3>Other metrics</h3>")
        by_namespace: dict[str, list[str]] = {}
        for key in rest:
            by_namespace.setdefault(key.split("/", 1)[0] if "/" in key else "(no namespace)", []).append(key)
        for namespace, group in by_namespace.items():
            parts.append(f"<h4>{_esc(namespace)}</h4>")
            parts.append(_figure_tag(_plot_panels(rows, group, ncols=4), f"{namespace} metrics"))
    parts.extend(_note(p) for p in problems)
    return "".join(parts)


def _eval_section(rows: list[Row] | None, problems: list[str]) -> str:
    parts = ['<h2 id="evaluation">Evaluation</h2>']
    if rows is None:
        return "".join(parts) + _note(f"No {EVAL_FILE} in this run directory: no evaluation was logged.")
    if not rows:
        return "".join(parts) + _note(f"{EVAL_FILE} holds no readable lines.")
    keys = _keys(rows)
    headline = [k for k in EVAL_HEADLINE_KEYS if k in keys]
    if headline:
        # DigitEval and diversity next to each other: a reward gain bought by collapse shows as one rising while the
        # other falls.
        parts.append(_figure_tag(_plot_panels(rows, headline, markers=True, ncols=2), "DigitEval and eval diversity"))
    missing = [k for k in EVAL_HEADLINE_KEYS if k not in keys]
    if missing:
        parts.append(_note("Not logged: " + ", ".join(missing) + "."))
    rest = [k for k in keys if k not in headline]
    if rest:
        parts.append(_figure_tag(_plot_panels(rows, rest, markers=True), "other evaluation metrics"))
    parts.append("<table><tr><th>metric</th><th>first</th><th>last</th><th>min</th><th>max</th></tr>")
    for key in keys:
        _, values = _series(rows, key)
        finite = [v for v in values if math.isfinite(v)]
        lo, hi = (_fmt(min(finite)), _fmt(max(finite))) if finite else ("–", "–")
        parts.append(f"<tr><td>{_esc(key)}</td><td>{_esc(_fmt(values[0]))}</td><td>{_esc(_fmt(values[-1]))}</td>"
                     f"<td>{_esc(lo)}</td><td>{_esc(hi)}</td></tr>")
    parts.append("</table>")
    parts.extend(_note(p) for p in problems)
    return "".join(parts)


def _samples_section(run_dir: Path, eval_rows: list[Row] | None) -> str:
    parts = ['<h2 id="samples">Samples</h2>']
    folder = run_dir / SAMPLES_DIR
    grids = []
    if folder.is_dir():
        for path in folder.iterdir():
            match = _GRID_NAME.match(path.name)
            if match and path.is_file():
                grids.append((int(match.group(1)), path))
    if not grids:
        return "".join(parts) + _note(f"No sample grids ({SAMPLES_DIR}/step_*.png) in this run directory.")
    by_step = {int(row["step"]): row for row in eval_rows or []}
    parts.append('<div class="grids">')
    for step, path in sorted(grids):
        row = by_step.get(step)
        if row is None:
            caption = f"step {step} — no eval logged at this step"
        else:
            values = " · ".join(f"{k} {_fmt(v)}" for k, v in row.items() if k != "step")
            caption = f"step {step} — {values}"
        parts.append(f'<figure>{_img_tag(path.read_bytes(), f"samples at step {step}", "grid")}'
                     f"<figcaption>{_esc(caption)}</figcaption></figure>")
    parts.append("</div>")
    return "".join(parts)


def _config_section(run_dir: Path) -> str:
    path = run_dir / CONFIG_FILE
    head = '<h2 id="config">Config</h2>'
    if not path.is_file():
        return head + _note(f"No {CONFIG_FILE} in this run directory.")
    text = path.read_text(encoding="utf-8", errors="replace")
    return head + f"<pre>{_esc(text)}</pre>"


def _provenance_section(run_dir: Path) -> str:
    path = run_dir / PROVENANCE_FILE
    head = '<h2 id="provenance">Provenance</h2>'
    if not path.is_file():
        return head + _note(f"No {PROVENANCE_FILE} in this run directory.")
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return head + _note(f"{PROVENANCE_FILE} is not valid JSON; shown verbatim.") + f"<pre>{_esc(text)}</pre>"
    if not isinstance(data, dict):
        return head + f"<pre>{_esc(json.dumps(data, indent=2))}</pre>"
    body = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v if isinstance(v, str) else json.dumps(v))}</td></tr>"
                   for k, v in data.items())
    return head + f'<table class="kv">{body}</table>'


_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 1320px; margin: 1.5em auto;
       padding: 0 1em; color: #222; line-height: 1.4; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
nav a { margin-right: 1em; } .note { color: #666; font-style: italic; }
img.plot { max-width: 100%; display: block; margin: 0.5em 0; }
img.grid { image-rendering: pixelated; max-width: 100%; border: 1px solid #ccc; }
.grids { display: flex; flex-wrap: wrap; gap: 1em; } figure { margin: 0; } figcaption { font-size: 0.85em; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
table { border-collapse: collapse; font-size: 0.9em; margin: 0.5em 0; }
td, th { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; }
"""


def write_report(run_dir: Path) -> Path:
    """Write ``<run_dir>/report.html`` (atomically) from the run directory's files and return its path.

    Raises:
        FileNotFoundError: ``run_dir`` is not a directory. Missing files inside it are noted in the page instead.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    train_rows = train_problems = eval_rows = eval_problems = None
    if (run_dir / METRICS_FILE).is_file():
        train_rows, train_problems = read_jsonl(run_dir / METRICS_FILE)
    if (run_dir / EVAL_FILE).is_file():
        eval_rows, eval_problems = read_jsonl(run_dir / EVAL_FILE)
    steps = f"{len(train_rows)} steps logged" if train_rows else "no training steps logged"
    if train_rows:
        steps += f" ({int(train_rows[0]['step'])}–{int(train_rows[-1]['step'])})"
    page = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>flowforge report — {_esc(run_dir.resolve().name)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>flowforge report — {_esc(run_dir.resolve().name)}</h1>",
        f'<p class="note">{_esc(str(run_dir.resolve()))} · {_esc(steps)}</p>',
        '<nav><a href="#training">Training</a><a href="#evaluation">Evaluation</a><a href="#samples">Samples</a>'
        '<a href="#config">Config</a><a href="#provenance">Provenance</a></nav>',
        _train_section(train_rows, train_problems or []),
        _eval_section(eval_rows, eval_problems or []),
        _samples_section(run_dir, eval_rows),
        _config_section(run_dir),
        _provenance_section(run_dir),
        "</body></html>\n",
    ]
    path = run_dir / REPORT_FILE
    text = "\n".join(page)
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m flowforge.train.report RUN_DIR``: write the report and print its path."""
    parser = argparse.ArgumentParser(prog="python -m flowforge.train.report", description=__doc__.split("\n", 1)[0])
    parser.add_argument("run_dir", type=Path, help="a run directory (holding metrics.jsonl, config.yaml, ...)")
    args = parser.parse_args(argv)
    try:
        path = write_report(args.run_dir)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
