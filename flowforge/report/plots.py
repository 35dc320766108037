"""Curves for ``report.html``: panels of metrics over steps (and samples seen), optional smoothing, embedded PNGs.

Smoothing is TensorBoard's debiased exponential moving average (TensorBoard ``scalars`` dashboard, "smoothing"):

.. math::

    m_n = a\\,m_{n-1} + (1 - a)\\,x_n, \\quad m_0 = 0, \\qquad s_n = m_n / (1 - a^{c_n})

=========  =====================================================================
``a``      smoothing weight in [0, 1): 0 = raw values, 0.9 = heavy smoothing
``x_n``    the n-th finite value of the series (NaN points are skipped, kept NaN)
``c_n``    number of finite values seen up to ``n`` (the debiasing count)
=========  =====================================================================

With smoothing the raw series is drawn faintly under the smoothed one. The x-axis is the step; when the samples per
step are known (``data.prompts_per_step x data.group_size``) a second axis on top counts samples seen.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from matplotlib.figure import Figure

Row = dict[str, float]
_PANEL_W, _PANEL_H, _DPI = 4.2, 3.1, 90


def series(rows: Sequence[Row], key: str) -> tuple[list[float], list[float]]:
    """``(steps, values)`` of ``key`` over the rows that hold it."""
    pairs = [(row["step"], row[key]) for row in rows if key in row]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def is_constant_zero(rows: Sequence[Row], key: str) -> bool:
    """True when every finite value of ``key`` is exactly 0 and there is at least one (an all-NaN series is not)."""
    finite = [v for v in series(rows, key)[1] if math.isfinite(v)]
    return bool(finite) and all(v == 0.0 for v in finite)


def smooth(values: Sequence[float], weight: float) -> list[float]:
    """Debiased exponential moving average of ``values`` (module docstring); NaN / inf points stay NaN and do not
    enter the average.

    Raises:
        ValueError: ``weight`` is not in [0, 1).
    """
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    out, m, count = [], 0.0, 0
    for v in values:
        if not math.isfinite(v):
            out.append(math.nan)
            continue
        m, count = weight * m + (1.0 - weight) * v, count + 1
        out.append(m / (1.0 - weight**count))
    return out


def _figure(n_panels: int, ncols: int) -> tuple[Figure, list[Any]]:
    ncols = max(1, min(ncols, n_panels))
    nrows = math.ceil(n_panels / ncols)
    width, height = _PANEL_W * ncols, _PANEL_H * nrows
    # Figure directly (not pyplot): no global state, Agg canvas, safe headless. Fixed margins in inches instead of a
    # layout engine, which would draw every figure twice.
    fig = Figure(figsize=(width, height), dpi=_DPI)
    fig.subplots_adjust(left=0.8 / width, right=1 - 0.15 / width, bottom=0.5 / height, top=1 - 0.6 / height,
                        wspace=0.95 / (_PANEL_W - 0.95), hspace=1.1 / (_PANEL_H - 1.1))
    axes = list(fig.subplots(nrows, ncols, squeeze=False).ravel())
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    return fig, axes[:n_panels]


def _offset_to_label(ax: Any) -> None:
    """Keep the y axis's offset text off the title: matplotlib draws it (``1e-5+5.152e-1``) above the axes'
    top-left corner, where the title is. Tick labels are written in full instead of relative to an offset, and a
    remaining multiplier (``1e-6``, for values below 1e-5) moves into the y label. Read from the final view limits
    without drawing."""
    formatter = ax.yaxis.get_major_formatter()
    if not hasattr(formatter, "set_useOffset"):
        return
    formatter.set_useOffset(False)
    formatter.set_locs(ax.yaxis.get_majorticklocs())
    text = formatter.get_offset()
    if text:
        ax.yaxis.get_offset_text().set_visible(False)
        ax.set_ylabel(f"× {text}", fontsize=7)


def _style(ax: Any, title: str, per_step: int | None) -> None:
    _offset_to_label(ax)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(True, alpha=0.3)
    if per_step:
        top = ax.secondary_xaxis("top", functions=(lambda s: s * per_step, lambda n: n / per_step))
        top.set_xlabel("samples seen", fontsize=7)
        top.tick_params(labelsize=7)


def _band(ax: Any, rows: Sequence[Row], key: str, std_key: str) -> None:
    steps, mean, std = [], [], []
    for row in rows:
        if key in row and std_key in row:
            steps.append(row["step"])
            mean.append(row[key])
            std.append(row[std_key])
    ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], color="C0",
                    alpha=0.2, linewidth=0, label="± std")
    ax.legend(fontsize=7, loc="best")


def plot_panels(rows: Sequence[Row], keys: Sequence[str], *, bands: Mapping[str, str] | None = None,
                markers: bool = False, ncols: int = 3, per_step: int | None = None,
                smoothing: float = 0.0, empty: Mapping[str, str] | None = None) -> Figure:
    """One panel per key over the step (plus a samples-seen axis when ``per_step`` is given); ``bands`` maps a key
    to the key of its std (a ± std band); ``smoothing`` in [0, 1) draws the smoothed curve over the faint raw one;
    ``empty`` maps a key to the text its panel shows when it has no finite value (default "no finite values")."""
    fig, axes = _figure(len(keys), ncols)
    for ax, key in zip(axes, keys):
        steps, values = series(rows, key)
        marker = "o" if markers else None
        if smoothing > 0:
            ax.plot(steps, values, marker=marker, markersize=2, linewidth=0.8, color="C0", alpha=0.3)
            ax.plot(steps, smooth(values, smoothing), linewidth=1.4, color="C0")
        else:
            ax.plot(steps, values, marker=marker, markersize=3, linewidth=1.3, color="C0")
        std_key = (bands or {}).get(key)
        if std_key is not None:
            _band(ax, rows, key, std_key)
        if values and not any(math.isfinite(v) for v in values):
            ax.text(0.5, 0.5, (empty or {}).get(key, "no finite values"), transform=ax.transAxes, ha="center",
                    va="center", fontsize=9)
        _style(ax, key, per_step)
    return fig


def img_tag(png: bytes, alt: str, css_class: str = "plot") -> str:
    """``<img>`` with ``png`` embedded as a base64 data URI (the page stays one self-contained file)."""
    data = base64.b64encode(png).decode("ascii")
    return f'<img class="{css_class}" alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def render_png(fig: Figure) -> bytes:
    """``fig`` drawn by matplotlib's Agg canvas, as PNG bytes (about three quarters of a report's time)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def figure_tag(fig: Figure, alt: str) -> str:
    """``fig`` rendered to PNG (:func:`render_png`) and embedded (:func:`img_tag`)."""
    return img_tag(render_png(fig), alt)


def plot_reward_vs_judge(train_rows: Sequence[Row], eval_rows: Sequence[Row], judge: str, *,
                         reward: str = "reward/total_mean", diversity: str = "eval/diversity",
                         stop_step: int | None = None, per_step: int | None = None) -> Figure:
    """One panel over the step: the training reward (per step), the held-out ``judge`` (per evaluation) and the
    held-out within-prompt diversity (right axis: another scale). A policy exploiting its reward shows as the first
    rising while the other two fall; ``stop_step`` marks where the reward-hacking guard stopped the run."""
    width, height = 7.5, 3.9
    fig = Figure(figsize=(width, height), dpi=_DPI)
    fig.subplots_adjust(left=0.8 / width, right=1 - 0.8 / width, bottom=0.5 / height, top=1 - 0.95 / height)
    ax = fig.add_subplot(1, 1, 1)
    steps, values = series(train_rows, reward)
    ax.plot(steps, values, linewidth=1.0, color="C0", label=f"training {reward}")
    steps, values = series(eval_rows, judge)
    ax.plot(steps, values, marker="o", markersize=3, linewidth=1.4, color="C1", label=f"held-out {judge}")
    twin = ax.twinx()
    steps, values = series(eval_rows, diversity)
    twin.plot(steps, values, marker="s", markersize=3, linewidth=1.2, linestyle="--", color="C2",
              label=f"held-out {diversity} (right)")
    twin.tick_params(labelsize=8)
    if any(math.isfinite(v) for v in values):
        twin.set_ylim(bottom=0.0)  # diversity from 0: a small drop must not look like a collapse
    _offset_to_label(twin)  # its offset text would sit above the top-right corner, under the title's end
    if stop_step is not None:
        ax.axvline(stop_step, color="C3", linestyle=":", linewidth=1.5, label=f"guard stop (step {stop_step})")
    handles = ax.get_legend_handles_labels()
    extra = twin.get_legend_handles_labels()
    ax.legend(handles[0] + extra[0], handles[1] + extra[1], fontsize=7, loc="best")
    _style(ax, "training reward vs held-out judge vs diversity", per_step)
    return fig


def plot_eval_curves(curves: Sequence[tuple[str, Sequence[float], Sequence[float], Mapping[int, float], str | None]],
                     *, per_step: int | None = None, from_zero: Collection[str] = ()) -> Figure:
    """Held-out curves side by side, one panel each, for the top of the report: ``(key, steps, values, se, empty)``
    with ``se`` = ``{step: standard error}`` drawn as ± 1 SE error bars where known, and ``empty`` the text of a
    panel without a finite value (None: "no finite values"). The y axis of a key in ``from_zero`` starts at 0 (its
    top stays automatic): a metric such as diversity, whose size matters relative to 0, then shows a small drop as
    small instead of filling the panel."""
    fig, axes = _figure(len(curves), len(curves))
    for ax, (key, steps, values, se, empty) in zip(axes, curves):
        errors = [se.get(int(s), math.nan) for s in steps]
        if any(math.isfinite(e) for e in errors):
            ax.errorbar(steps, values, yerr=[e if math.isfinite(e) else 0.0 for e in errors], marker="o",
                        markersize=3, linewidth=1.3, capsize=3, color="C1", label="± 1 standard error")
            ax.legend(fontsize=7, loc="best")
        else:
            ax.plot(steps, values, marker="o", markersize=3, linewidth=1.3, color="C1" if not empty else "C2")
        if not any(math.isfinite(v) for v in values):
            ax.text(0.5, 0.5, empty or "no finite values", transform=ax.transAxes, ha="center", va="center",
                    fontsize=9)
        elif key in from_zero:
            ax.set_ylim(bottom=0.0)
        _style(ax, key, per_step)
    return fig
