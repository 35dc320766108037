"""The verdict that opens ``report.html``: did the headline eval metric change, by more than its uncertainty?

The held-out evaluation scores ``K = eval.samples_per_prompt`` samples of each of ``N`` held-out prompts with fixed
noise; the grid sidecars keep every sample's score (:func:`flowforge.report.grids.read_eval_scores`). The prompts
are the sampled units (the samples of one prompt are not independent of each other), so

.. math::

    m_i = \\operatorname{mean}_k s_{ik}, \\qquad
    \\mathrm{SE}(\\bar s) = \\operatorname{sd}(m_1 \\ldots m_N) / \\sqrt{N}

(``sd`` with ``N - 1``; prompts whose every sample is NaN left out). The change from the first to the last
evaluation is paired when both scored the same prompts (every eval does: fixed prompts, fixed noise):
``SE(change) = sd(m_i^{end} - m_i^{start}) / sqrt(N)``; otherwise ``sqrt(SE_start^2 + SE_end^2)``. The verdict
calls a change real when ``|change| > 2 SE`` (about 95 % two-sided under a normal approximation) and says so;
otherwise "within evaluation noise". A run whose sidecars predate per-sample scores gets the change without an
error bar, and the page says why.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flowforge.report.grids import read_eval_diversity, read_eval_scores, read_grid_cells
from flowforge.report.page import esc, verdict_block
from flowforge.report.plots import figure_tag, plot_eval_curves, series
from flowforge.report.summary import GROUP_KEYS, RunInfo, fmt, guard_event, guard_key, missing_reason

Row = dict[str, float]
SIGNIFICANCE = 2.0
"""A change counts as real above this many standard errors."""


@dataclass(frozen=True)
class EvalPoint:
    """One evaluation of the headline metric from its per-sample scores."""

    step: int
    mean: float  # mean over every finite sample (eval.jsonl's value)
    se: float  # standard error over prompts (module docstring); NaN with fewer than 2 scored prompts
    prompt_means: tuple[float, ...]  # [N] m_i, NaN for a prompt without a finite sample
    prompts: tuple[str, ...]  # [N] the prompts, in order (from the sidecar's cells)
    samples_per_prompt: int


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return math.fsum(finite) / len(finite) if finite else math.nan


def standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean of the finite ``values`` (``stdev / sqrt(n)``); NaN with fewer than 2."""
    finite = [v for v in values if math.isfinite(v)]
    return statistics.stdev(finite) / math.sqrt(len(finite)) if len(finite) >= 2 else math.nan


def eval_points(grids: Sequence[tuple[int, Path]], key: str) -> dict[int, EvalPoint]:
    """``{step: EvalPoint}`` of eval metric ``key`` (``eval/<scorer>``) for every grid whose sidecar holds the
    scorer's per-sample scores; empty for a metric that is not a per-sample score (``eval/diversity``)."""
    name = key.removeprefix("eval/")
    out = {}
    for step, png in grids:
        got = read_eval_scores(png)
        if got is None or name not in got[1]:
            continue
        k, scores = got
        values = scores[name]
        means = [_mean(values[i * k:(i + 1) * k]) for i in range(len(values) // k)]
        cells = read_grid_cells(png) or []
        prompts = tuple(c["prompt"] for c in cells) if len(cells) == len(means) else ()
        out[step] = EvalPoint(step, _mean(values), standard_error(means), tuple(means), prompts, k)
    return out


def diversity_se(grids: Sequence[tuple[int, Path]]) -> dict[int, float]:
    """``{step: standard error of eval/diversity over prompts}`` from the grid sidecars that keep each prompt's
    within-prompt diversity (``sd / sqrt(N)``, as the headline metric's; steps whose sidecar lacks it are left out)."""
    out = {}
    for step, png in grids:
        per_prompt = read_eval_diversity(png)
        if per_prompt is not None:
            out[step] = standard_error(per_prompt)
    return out


def change_se(start: EvalPoint, end: EvalPoint) -> tuple[float, bool]:
    """``(SE of end.mean - start.mean, paired)`` (module docstring)."""
    if start.prompts and start.prompts == end.prompts:
        diffs = [b - a for a, b in zip(start.prompt_means, end.prompt_means)]
        return standard_error(diffs), True
    return math.sqrt(start.se**2 + end.se**2), False


def _pm(mean: float, se: float) -> str:
    return f"{fmt(mean)} ± {fmt(se)}" if math.isfinite(se) else fmt(mean)


def _change_words(delta: float, se: float) -> tuple[str, str]:
    """``(css class, words)`` for a change of ``delta`` with standard error ``se``."""
    if not math.isfinite(se):
        return "flat", "no standard error (fewer than 2 scored prompts)"
    if se == 0.0:  # every prompt changed by exactly delta (a scorer of few levels: often 0 on every prompt)
        if delta == 0.0:
            return "flat", "no change: every held-out prompt scored the same at both evaluations"
        return ("good" if delta > 0 else "bad"), "every held-out prompt changed by exactly this amount (SE 0)"
    ratio = delta / se
    if abs(ratio) > SIGNIFICANCE:
        better = "an improvement" if delta > 0 else "a decline"
        return ("good" if delta > 0 else "bad"), (f"{abs(ratio):.1f} standard errors: {better} beyond evaluation "
                                                  f"noise (|change| > {SIGNIFICANCE:g} SE)")
    return "flat", (f"{abs(ratio):.1f} standard errors: within evaluation noise (|change| <= {SIGNIFICANCE:g} SE), "
                    "not a measured change")


def headline_change(key: str, rows: Sequence[Row], points: dict[int, EvalPoint]) -> tuple[str, list[str]]:
    """The headline sentence (HTML) and its supporting facts for eval metric ``key`` of the eval ``rows``, which
    hold a finite value of it; ``points`` from :func:`eval_points` (may be empty: no standard error)."""
    steps, values = series(rows, key)
    finite = [(int(s), v) for s, v in zip(steps, values) if math.isfinite(v)]
    (s0, v0), (s1, v1) = finite[0], finite[-1]
    p0, p1 = points.get(s0), points.get(s1)
    facts = []
    if s0 == s1:
        se = p0.se if p0 else math.nan
        return (f"held-out <strong>{esc(key)}</strong> {esc(_pm(v0, se))} at step {s0} (one evaluation: no change to "
                "judge)"), facts
    delta = v1 - v0
    if p0 is not None and p1 is not None:
        se, paired = change_se(p0, p1)
        css, words = _change_words(delta, se)
        change = f"{delta:+.4g} ± {fmt(se)}" if math.isfinite(se) else f"{delta:+.4g}"
        head = (f"held-out <strong>{esc(key)}</strong> {esc(fmt(v0))} → {esc(fmt(v1))} (step {s0} → {s1}): "
                f'<span class="{css}">{esc(change)}</span>')
        n = sum(math.isfinite(m) for m in p1.prompt_means)
        facts.append(f'<span class="{css}">{esc(words)}</span>')
        facts.append(esc(f"start {_pm(v0, p0.se)}, end {_pm(v1, p1.se)}: standard errors over {n} held-out prompts "
                         f"x {p1.samples_per_prompt} samples" + (", the change paired by prompt" if paired else "")))
    else:
        head = (f"held-out <strong>{esc(key)}</strong> {esc(fmt(v0))} → {esc(fmt(v1))} (step {s0} → {s1}): "
                f'<span class="flat">{esc(f"{delta:+.4g}")}</span>')
        facts.append(esc("no standard error: this run's eval grids keep no per-sample scores (written by an older "
                         "flowforge); rerun `flowforge train` to get them"))
    best = max(finite, key=lambda sv: sv[1])
    if best[0] != s1:
        facts.append(esc(f"best {fmt(best[1])} at step {best[0]}"
                         + (f" (± {fmt(points[best[0]].se)})" if best[0] in points else "")))
    return head, facts


def _single_sample(info: RunInfo) -> bool:
    return info.cfg is not None and info.cfg.eval.samples_per_prompt < 2


def verdict_section(info: RunInfo, train_rows: list[Row] | None, eval_rows: list[Row] | None,
                    grids: Sequence[tuple[int, Path]], headline: str | None) -> str:
    """The verdict block (module docstring) with the held-out curve beside it."""
    rows = eval_rows or []
    has_finite = headline is not None and any(math.isfinite(v) for v in series(rows, headline)[1])
    points = eval_points(grids, headline) if has_finite else {}
    if not has_finite:
        head = ("no held-out evaluation logged" if headline is None
                else f"held-out <strong>{esc(headline)}</strong>: {esc(missing_reason(headline, info))}")
        facts = [] if rows else [esc("set eval.every > 0 (or keep eval at the start and end) to measure the run")]
    else:
        head, facts = headline_change(headline, rows, points)
    if rows and headline != "eval/diversity":
        _, div = series(rows, "eval/diversity")
        finite = [v for v in div if math.isfinite(v)]
        if div and finite:
            facts.append(esc(f"within-prompt diversity (eval/diversity) {fmt(finite[0])} → {fmt(finite[-1])}"))
        elif div:
            facts.append(esc(f"eval/diversity {missing_reason('eval/diversity', info)}"))
    event = guard_event(rows, guard_key(rows, info))
    if event is not None:
        facts.append(f'<span class="bad">{esc("reward-hacking guard " + event[1])}</span>')
    if train_rows and any("reward/total_mean" in r for r in train_rows):
        _, total = series(train_rows, "reward/total_mean")
        facts.append(esc(f"training reward (batch mean, reward/total_mean) {fmt(total[0])} → {fmt(total[-1])}"))
    if train_rows:
        planned = f" of {info.cfg.train.steps}" if info.cfg is not None else ""
        facts.append(esc(f"{int(train_rows[-1]['step'])}{planned} steps"))
    figure = ""
    if has_finite:
        curves = [(headline, *series(rows, headline), {s: p.se for s, p in points.items()}, None)]
        if headline != "eval/diversity" and any("eval/diversity" in r for r in rows):
            curves.append(("eval/diversity", *series(rows, "eval/diversity"), diversity_se(grids),
                           "not measured:\nneeds eval.samples_per_prompt >= 2" if _single_sample(info) else None))
        elif headline == "eval/diversity":
            curves[0] = (*curves[0][:3], diversity_se(grids), None)
        # diversity's axis from 0: auto-scaled, a 9 % drop would fill the panel and read as a collapse
        figure = figure_tag(plot_eval_curves(curves, per_step=info.per_step, from_zero=("eval/diversity",)),
                            f"held-out {headline} over steps")
    return verdict_block(head, facts, figure)


__all__ = ["EvalPoint", "GROUP_KEYS", "SIGNIFICANCE", "change_se", "diversity_se", "eval_points", "headline_change",
           "verdict_section"]
