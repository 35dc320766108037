"""``compare.png`` of ``flowforge compare``: sample efficiency first, wall time second.

=============================  ==========================================================================
panel                          what
=============================  ==========================================================================
main (top left, wide)          the held-out target metric against training samples generated, one line per
                               run (colour = arm, line style = seed), the target values as dashed lines
top right                      the same metric against wall time (the logged training-stage seconds of each
                               run, measured with the arms run one at a time)
bottom left                    the mean training reward against samples generated
bottom right                   samples to each target per arm: median over seeds, bar = min-max range, the
                               count of seeds that reached it
=============================  ==========================================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_STYLES = ("-", "--", ":", "-.")


def _draw_curves(ax_samples, ax_seconds, ax_reward, summaries: list[dict[str, Any]], colours: dict[str, str]) -> None:
    seeds: dict[str, int] = {}
    for s in summaries:
        k = seeds.setdefault(s["arm"], 0)
        seeds[s["arm"]] = k + 1
        style = dict(color=colours[s["arm"]], linestyle=_STYLES[k % len(_STYLES)], label=s["run"])
        samples, seconds, metric = zip(*s["curve"]) if s["curve"] else ((), (), ())
        ax_samples.plot(samples, metric, marker="o", markersize=3, **style)
        ax_seconds.plot(seconds, metric, marker="o", markersize=3, **style)
        r_samples, _, reward = zip(*s["reward"]) if s["reward"] else ((), (), ())
        ax_reward.plot(r_samples, reward, linewidth=1.0, **style)


def _draw_targets(ax, arms: dict[str, dict[str, Any]], values: tuple[float, ...], colours: dict[str, str]) -> None:
    width = 0.8 / max(1, len(arms))
    for j, (arm, a) in enumerate(arms.items()):
        for i, v in enumerate(values):
            t = a["targets"][v]
            x = i + (j - (len(arms) - 1) / 2) * width
            if t["median"] is None:
                ax.text(x, 0, "not\nreached", ha="center", va="bottom", fontsize=7, color=colours[arm])
                continue
            ax.bar(x, t["median"], width=width * 0.9, color=colours[arm], alpha=0.7, label=arm if i == 0 else None)
            ax.errorbar(x, t["median"], yerr=[[t["median"] - t["min"]], [t["max"] - t["median"]]], color="black",
                        capsize=3, linewidth=1)
            ax.text(x, t["max"], f"{t['n_reached']}/{a['n_seeds']}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(values)), [f"to {v:g}" for v in values])
    ax.set_xlim(-0.5, len(values) - 0.5)
    ax.set_ylabel("training samples (median, min-max over seeds)")


def write_plot(summaries: list[dict[str, Any]], arms: dict[str, dict[str, Any]], out_dir: Path, target_metric: str,
               target_values: tuple[float, ...]) -> Path:
    """Write ``out_dir/compare.png`` (module docstring) and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    colours = {arm: f"C{i}" for i, arm in enumerate(arms)}
    fig, axes = plt.subplots(2, 2, figsize=(13, 8), gridspec_kw={"width_ratios": [3, 2]})
    (main, seconds), (reward, bars) = axes
    _draw_curves(main, seconds, reward, summaries, colours)
    _draw_targets(bars, arms, target_values, colours)
    for ax in (main, seconds):
        for v in target_values:
            ax.axhline(v, color="gray", linestyle="--", linewidth=1)
        ax.set_ylabel(target_metric)
    main.set_title(f"{target_metric} against training samples (sample efficiency)", fontsize=10)
    seconds.set_title("the same against wall time (arms run one at a time)", fontsize=10)
    main.set_xlabel("training samples generated")
    reward.set_xlabel("training samples generated")
    reward.set_ylabel("mean training reward")
    seconds.set_xlabel("wall time (s, training stages)")
    bars.set_title("samples to each target per arm", fontsize=10)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    png = out_dir / "compare.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
