"""``flowforge compare``: several algorithms (and seeds) on the same model, prompts, rewards and sample budget.

A compare file names a base run config, the arms (each a list of ``section.key=value`` overrides on the base) and
the seeds. Every (arm, seed) is an ordinary run directory ``<output_dir>/<arm>-s<seed>/``, trained one after the
other (never in parallel: two torch jobs on two cores slow each other down by an order of magnitude). The budget is
counted in generated training samples, ``steps * prompts_per_step * group_size``, so arms with different batch
shapes still see the same number of samples.

Outputs in ``<output_dir>/``: ``compare.png`` (the target metric and the mean training reward against samples
generated and against wall time), ``compare.csv`` and ``compare.md`` (per run: samples and seconds to reach the
target, final metric and reward).

Example (``examples/digits/compare.yaml``)::

    base: grpo.yaml               # relative to this file
    output_dir: runs/compare
    budget_samples: 1920
    target: {metric: eval/digit_eval, value: 0.9}
    seeds: [0]
    arms:
      grpo: []
      nft: [train.algorithm=nft, train.lr=3e-4]
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from flowforge.config import ConfigError, load_config


@dataclass(frozen=True)
class CompareConfig:
    base: Path
    arms: dict[str, tuple[str, ...]]
    output_dir: Path
    budget_samples: int
    target_metric: str = "eval/digit_eval"
    target_value: float = 0.9
    seeds: tuple[int, ...] = (0,)
    overrides: tuple[str, ...] = field(default_factory=tuple)  # applied to every arm


def load_compare(path: str | Path, overrides: tuple[str, ...] = ()) -> CompareConfig:
    """Read and validate a compare file (every problem reported at once).

    Raises:
        ConfigError: unreadable file, unknown keys, missing base / arms / budget, bad values.
    """
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError([f"cannot read compare file {path}: {exc}"]) from None
    allowed = {"base", "arms", "output_dir", "budget_samples", "target", "seeds"}
    problems = [f"unknown key '{k}'; allowed: {sorted(allowed)}" for k in raw if k not in allowed]
    base = path.parent / str(raw.get("base", ""))
    if "base" not in raw or not base.is_file():
        problems.append(f"base: a run config file is required (got {raw.get('base')!r}, looked for {base})")
    arms = raw.get("arms")
    if not isinstance(arms, dict) or not arms:
        problems.append("arms: a mapping of arm name -> list of overrides is required")
        arms = {}
    for name, ov in arms.items():
        if not isinstance(ov, list) or not all(isinstance(o, str) for o in ov):
            problems.append(f"arms.{name}: expected a list of 'section.key=value' strings")
    budget = raw.get("budget_samples")
    if not isinstance(budget, int) or budget < 1:
        problems.append(f"budget_samples: expected an int >= 1, got {budget!r}")
    target = raw.get("target", {}) or {}
    if not isinstance(target, dict) or set(target) - {"metric", "value"}:
        problems.append("target: expected {metric: eval/..., value: number}")
        target = {}
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        problems.append(f"seeds: expected a non-empty list of ints, got {seeds!r}")
    if problems:
        raise ConfigError(problems, header=f"invalid compare file {path}")
    return CompareConfig(base=base, arms={k: tuple(v) for k, v in arms.items()},
                         output_dir=Path(raw.get("output_dir", "runs/compare")), budget_samples=budget,
                         target_metric=str(target.get("metric", "eval/digit_eval")),
                         target_value=float(target.get("value", 0.9)), seeds=tuple(seeds),
                         overrides=tuple(overrides))


def _run_config(cc: CompareConfig, arm: str, seed: int):
    """The run config of one (arm, seed): base < arm overrides < command-line overrides < name / seed / budget."""
    probe = load_config(cc.base, [*cc.arms[arm], *cc.overrides])
    per_step = probe.data.prompts_per_step * probe.data.group_size
    steps = max(1, cc.budget_samples // per_step)
    return load_config(cc.base, [*cc.arms[arm], *cc.overrides, f"run.name={arm}-s{seed}",
                                 f"run.output_dir={cc.output_dir}", f"run.seed={seed}", f"train.steps={steps}"])


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(run_dir: Path, target_metric: str, target_value: float) -> dict[str, Any]:
    """Curves and summary of one finished run directory.

    Samples generated after ``n`` steps are ``n * M * K`` (read from its config); wall time is the sum of the
    logged per-stage times (``time/*``) of the steps so far, so evaluation time is not charged to the algorithm.
    """
    cfg = load_config(run_dir / "config.yaml")
    per_step = cfg.data.prompts_per_step * cfg.data.group_size
    rows = _read(run_dir / "metrics.jsonl")
    evals = _read(run_dir / "eval.jsonl")
    elapsed, clock = {0: 0.0}, 0.0
    reward = []
    for r in rows:
        clock += sum(v for k, v in r.items() if k.startswith("time/") and isinstance(v, (int, float)))
        elapsed[r["step"]] = clock
        reward.append((r["step"] * per_step, clock, r.get("reward/total_mean", math.nan)))
    curve = [(e["step"] * per_step, elapsed.get(e["step"], math.nan), e.get(target_metric, math.nan))
             for e in evals]
    hit = next(((s, t) for s, t, v in curve if v is not None and v >= target_value), (None, None))
    return {"run": run_dir.name, "algorithm": cfg.train.algorithm, "seed": cfg.run.seed, "curve": curve,
            "reward": reward, "samples_to_target": hit[0], "seconds_to_target": hit[1],
            "final_metric": curve[-1][2] if curve else math.nan,
            "final_reward": reward[-1][2] if reward else math.nan, "samples": rows[-1]["step"] * per_step if rows else 0}


def write_outputs(summaries: list[dict[str, Any]], out_dir: Path, target_metric: str, target_value: float) -> Path:
    """``compare.png``, ``compare.csv``, ``compare.md`` in ``out_dir``; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for s in summaries:
        label = s["run"]
        samples, seconds, metric = zip(*s["curve"]) if s["curve"] else ((), (), ())
        axes[0][0].plot(samples, metric, marker="o", label=label)
        axes[0][1].plot(seconds, metric, marker="o", label=label)
        r_samples, r_seconds, reward = zip(*s["reward"]) if s["reward"] else ((), (), ())
        axes[1][0].plot(r_samples, reward, label=label)
        axes[1][1].plot(r_seconds, reward, label=label)
    for ax in axes[0]:
        ax.axhline(target_value, color="gray", linestyle="--", linewidth=1)
        ax.set_ylabel(target_metric)
    for ax in axes[1]:
        ax.set_ylabel("mean training reward")
    for ax in (axes[0][0], axes[1][0]):
        ax.set_xlabel("training samples generated")
    for ax in (axes[0][1], axes[1][1]):
        ax.set_xlabel("wall time (s, training stages)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    png = out_dir / "compare.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)

    header = ["run", "algorithm", "seed", "samples", "samples_to_target", "seconds_to_target", "final_metric",
              "final_reward"]
    with open(out_dir / "compare.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for s in summaries:
            w.writerow([s[h] for h in header])
    fmt = (lambda v: "not reached" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v)))
    lines = [f"Target: {target_metric} >= {target_value}", "", "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(s[h]) for h in header) + " |" for s in summaries]
    (out_dir / "compare.md").write_text("\n".join(lines) + "\n")
    return png


def run_compare(cc: CompareConfig, *, progress: bool = True) -> Path:
    """Train every (arm, seed) one after the other (skipping finished runs), then write the comparison."""
    from flowforge.train.preflight import preflight
    from flowforge.train.trainer import Trainer

    configs = {(arm, seed): _run_config(cc, arm, seed) for arm in cc.arms for seed in cc.seeds}
    for cfg in configs.values():  # every arm validated before any model loads
        preflight(cfg)
    summaries = []
    for cfg in configs.values():
        run_dir = Path(cfg.run.output_dir) / cfg.run.name
        if (run_dir / "config.yaml").is_file():
            if load_config(run_dir / "config.yaml") != cfg:
                raise ConfigError([f"{run_dir} holds a run with a different config; remove it or change "
                                   "output_dir"], header="compare cannot reuse a run directory")
        if not (run_dir / "report.html").is_file():
            Trainer(cfg, progress=progress).train()
        summaries.append(summarize(run_dir, cc.target_metric, cc.target_value))
    return write_outputs(summaries, cc.output_dir, cc.target_metric, cc.target_value)
