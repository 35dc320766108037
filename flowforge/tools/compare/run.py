"""``flowforge compare``: several algorithms (and seeds) on the same model, prompts, rewards and sample budget.

A compare file names a base run config, the arms (each a list of ``section.key=value`` overrides on the base, or
``{config: FILE, overrides: [...]}``: its own run config) and the seeds. Every (arm, seed) is an ordinary run
directory ``<output_dir>/<arm>-s<seed>/``, trained one after the other (never in parallel: two torch jobs on two cores slow each other down by an order of magnitude, and each arm's
wall time is measured alone). The budget is counted in generated training samples,
``steps * prompts_per_step * group_size``, so arms with different batch shapes see the same number of samples.

Sample efficiency is the number of training samples generated before the held-out metric first reaches each target
value (``target.values``); across seeds each arm reports the median, the range (min-max) and how many seeds got
there, and every arm's median relative to the first arm's (a ratio < 1 = fewer samples). The final metric is the
mean over seeds ± its standard error, and each arm's difference to the first arm's with Welch's SE and whether it
exceeds 2 SE (one seed: no SE, said so).

Outputs in ``<output_dir>/``: ``compare.png`` (the target metric against samples generated: the main panel; the same
against wall time; the training reward against samples; samples-to-target per arm with its range across seeds),
``compare.csv`` (one row per run) and ``compare.md`` (per arm, then per run).

Example (``examples/digits/compare.yaml``)::

    base: grpo.yaml               # relative to this file
    output_dir: runs/compare
    budget_samples: 4800
    target: {metric: eval/digit_eval, values: [0.8, 0.9]}
    seeds: [0, 1]
    arms:
      grpo: []
      nft: [train.algorithm=nft, forward.sigma_mode=full_schedule, train.lr=3e-4]
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from flowforge.config import ConfigError, load_config
from flowforge.report.summary import SUBSTAGE_TIMES
from flowforge.report.verdict import standard_error


@dataclass(frozen=True)
class CompareConfig:
    base: Path | None  # None when every arm names its own config
    arms: dict[str, tuple[str, ...]]  # arm -> its overrides, applied to its config (``base`` unless named)
    output_dir: Path
    budget_samples: int
    target_metric: str = "eval/digit_eval"
    target_values: tuple[float, ...] = (0.8, 0.9)  # ascending
    seeds: tuple[int, ...] = (0,)
    overrides: tuple[str, ...] = field(default_factory=tuple)  # applied to every arm
    arm_configs: dict[str, Path] = field(default_factory=dict)  # arm -> its own run config (else ``base``)
    diversity_metric: str = "eval/diversity"

    def config_of(self, arm: str) -> Path:
        """The run config ``arm`` starts from: its own, else ``base``."""
        config = self.arm_configs.get(arm, self.base)
        if config is None:
            raise KeyError(f"arm {arm!r} names no config and the compare file has no base")
        return config


REACH_TOLERANCE = 1e-6
"""A target counts as reached at ``metric >= target - REACH_TOLERANCE``: eval metrics are float32 means, whose
rounding (~6e-8 near 1) must not turn an exact hit into a miss."""


def _target_values(target: dict, problems: list[str]) -> tuple[float, ...]:
    """``target.values`` (or a single ``target.value``), finite numbers, sorted; the default (0.8, 0.9)."""
    if "value" in target and "values" in target:
        problems.append("target: give either value or values, not both")
    raw = target.get("values", [target["value"]] if "value" in target else [0.8, 0.9])
    if not isinstance(raw, list) or not raw or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in raw):
        problems.append(f"target.values: expected a non-empty list of numbers, got {raw!r}")
        return (0.8, 0.9)
    return tuple(sorted({float(v) for v in raw}))


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
    allowed = {"base", "arms", "output_dir", "budget_samples", "target", "seeds", "diversity_metric"}
    problems = [f"unknown key '{k}'; allowed: {sorted(allowed)}" for k in raw if k not in allowed]
    arms = raw.get("arms")
    if not isinstance(arms, dict) or not arms:
        problems.append("arms: a mapping of arm name -> list of overrides (or {config: FILE, overrides: [...]}) "
                        "is required")
        arms = {}
    overrides_of, arm_configs = {}, {}
    for name, spec in arms.items():
        ov = spec
        if isinstance(spec, dict):  # {config: its own run config, overrides: [...]}
            if set(spec) - {"config", "overrides"} or not isinstance(spec.get("config"), str):
                problems.append(f"arms.{name}: expected {{config: FILE, overrides: [...]}} (config required)")
                continue
            arm_configs[name] = path.parent / spec["config"]
            if not arm_configs[name].is_file():
                problems.append(f"arms.{name}.config: no run config at {arm_configs[name]}")
            ov = spec.get("overrides", [])
        if not isinstance(ov, list) or not all(isinstance(o, str) for o in ov):
            problems.append(f"arms.{name}: expected a list of 'section.key=value' strings")
            continue
        overrides_of[name] = tuple(ov)
    base = path.parent / str(raw.get("base", "")) if "base" in raw else None
    if ("base" in raw or len(arm_configs) < len(arms)) and not (base is not None and base.is_file()):
        problems.append(f"base: a run config file is required unless every arm names its config "
                        f"(got {raw.get('base')!r}, looked for {base})")
    budget = raw.get("budget_samples")
    if not isinstance(budget, int) or budget < 1:
        problems.append(f"budget_samples: expected an int >= 1, got {budget!r}")
    target = raw.get("target", {}) or {}
    if not isinstance(target, dict) or set(target) - {"metric", "value", "values"}:
        problems.append("target: expected {metric: eval/..., values: [numbers]} (or value: number)")
        target = {}
    values = _target_values(target, problems)
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds) \
            or len(set(seeds)) != len(seeds):
        problems.append(f"seeds: expected a non-empty list of distinct ints, got {seeds!r}")
    if problems:
        raise ConfigError(problems, header=f"invalid compare file {path}")
    return CompareConfig(base=base, arms=overrides_of, arm_configs=arm_configs,
                         output_dir=Path(raw.get("output_dir", "runs/compare")), budget_samples=budget,
                         target_metric=str(target.get("metric", "eval/digit_eval")), target_values=values,
                         seeds=tuple(seeds), overrides=tuple(overrides),
                         diversity_metric=str(raw.get("diversity_metric", "eval/diversity")))


def _run_config(cc: CompareConfig, arm: str, seed: int):
    """The run config of one (arm, seed): the arm's config (``base`` unless it names one) < arm overrides <
    command-line overrides < name / seed / budget."""
    probe = load_config(cc.config_of(arm), [*cc.arms[arm], *cc.overrides])
    per_step = probe.data.prompts_per_step * probe.data.group_size
    steps = max(1, cc.budget_samples // per_step)
    return load_config(cc.config_of(arm), [*cc.arms[arm], *cc.overrides, f"run.name={arm}-s{seed}",
                                 f"run.output_dir={cc.output_dir}", f"run.seed={seed}", f"train.steps={steps}"])


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(run_dir: Path, target_metric: str, target_values: tuple[float, ...], arm: str | None = None,
              diversity_metric: str = "eval/diversity") -> dict[str, Any]:
    """Curves and summary of one finished run directory.

    Samples generated after ``n`` steps are ``n * M * K`` (read from its config); wall time is the sum of the
    logged per-stage times (``time/*``, less the sub-stage ``SUBSTAGE_TIMES`` counted within them) of the steps so
    far, so evaluation time is not charged to the algorithm.

    Returns:
        ``run``, ``arm`` (default: the run name before ``-s<seed>``), ``algorithm``, ``seed``, ``curve`` ``[(samples,
        seconds, metric)]`` per evaluation, ``reward`` ``[(samples, seconds, reward/total_mean)]`` per step,
        ``samples_to`` / ``seconds_to`` ``{value: first evaluation reaching it, or None}``, ``final_metric``,
        ``final_reward``, ``samples``; ``best_metric`` (the highest evaluation after training began, within the
        budget), and the diversity metric at the first and the last evaluation that logged it: ``base_diversity``,
        ``final_diversity`` and ``diversity_ratio`` (last / first; NaN where the run logs no diversity).
    """
    cfg = load_config(run_dir / "config.yaml")
    per_step = cfg.data.prompts_per_step * cfg.data.group_size
    rows = _read(run_dir / "metrics.jsonl")
    evals = _read(run_dir / "eval.jsonl")
    elapsed, clock = {0: 0.0}, 0.0
    reward = []
    for r in rows:
        clock += sum(v for k, v in r.items()
                     if k.startswith("time/") and k not in SUBSTAGE_TIMES and isinstance(v, (int, float)))
        elapsed[r["step"]] = clock
        reward.append((r["step"] * per_step, clock, r.get("reward/total_mean", math.nan)))
    curve = [(e["step"] * per_step, elapsed.get(e["step"], math.nan),
              math.nan if e.get(target_metric) is None else e[target_metric]) for e in evals]
    # the logged metric is a float32 mean: 216 of 240 correct logs as 0.89999998, which must count as 0.9
    hits = {v: next(((s, t) for s, t, m in curve if m >= v - REACH_TOLERANCE), (None, None)) for v in target_values}
    trained = [m for s, _, m in curve if s > 0 and math.isfinite(m)]  # the base's own score is no algorithm's best
    diversity = [e[diversity_metric] for e in evals if isinstance(e.get(diversity_metric), (int, float))]
    base_div, final_div = (diversity[0], diversity[-1]) if diversity else (math.nan, math.nan)
    return {"run": run_dir.name, "arm": arm or run_dir.name.rsplit("-s", 1)[0], "algorithm": cfg.train.algorithm,
            "seed": cfg.run.seed, "curve": curve, "reward": reward,
            "samples_to": {v: h[0] for v, h in hits.items()}, "seconds_to": {v: h[1] for v, h in hits.items()},
            "final_metric": curve[-1][2] if curve else math.nan,
            "final_reward": reward[-1][2] if reward else math.nan,
            "samples": rows[-1]["step"] * per_step if rows else 0,
            "best_metric": max(trained) if trained else math.nan, "base_diversity": base_div,
            "final_diversity": final_div, "diversity_ratio": final_div / base_div if base_div else math.nan}


def aggregate(summaries: list[dict[str, Any]], target_values: tuple[float, ...]) -> dict[str, dict[str, Any]]:
    """Per arm (in first-seen order), across its seeds: for each target value ``n_reached`` / ``n_seeds`` and the
    ``median``, ``min``, ``max`` samples (and ``median_seconds``) over the seeds that reached it (None if none did),
    and ``ratio``: the arm's median samples over the first arm's (None when either is missing).

    The final metric: ``finals`` (one per seed, finite ones), ``final_mean``, ``final_se`` (the standard error of
    the mean, ``stdev / sqrt(n)``; None with fewer than 2 seeds: one seed says nothing about the spread) and
    ``vs_first``, the difference to the first arm's mean: ``{"diff", "se", "significant"}``, ``se`` Welch's
    ``sqrt(se_arm^2 + se_first^2)`` from the per-seed values and ``significant`` ``|diff| > 2 se`` (``se`` and
    ``significant`` None when either arm has fewer than 2 seeds); None for the first arm itself."""
    arms: dict[str, list[dict[str, Any]]] = {}
    for s in summaries:
        arms.setdefault(s["arm"], []).append(s)
    out: dict[str, dict[str, Any]] = {}
    for arm, runs in arms.items():
        entry: dict[str, Any] = {"n_seeds": len(runs), "targets": {}, "algorithm": runs[0].get("algorithm", "")}
        for key, name in (("best_metric", "best"), ("final_diversity", "diversity"),
                          ("diversity_ratio", "diversity_ratio")):
            entry[name] = _mean_se([r.get(key, math.nan) for r in runs])
        finals = [r["final_metric"] for r in runs if math.isfinite(r["final_metric"])]
        entry["finals"] = finals
        entry["final_mean"] = statistics.fmean(finals) if finals else math.nan
        entry["final_se"] = standard_error(finals) if len(finals) > 1 else None
        for v in target_values:
            got = [r["samples_to"][v] for r in runs if r["samples_to"][v] is not None]
            secs = [r["seconds_to"][v] for r in runs if r["seconds_to"][v] is not None]
            entry["targets"][v] = {"n_reached": len(got), "median": statistics.median(got) if got else None,
                                   "min": min(got) if got else None, "max": max(got) if got else None,
                                   "median_seconds": statistics.median(secs) if secs else None}
        out[arm] = entry
    first = next(iter(out.values()), None)
    for entry in out.values():
        for v, t in entry["targets"].items():
            ref = first["targets"][v]["median"]
            t["ratio"] = t["median"] / ref if t["median"] is not None and ref else None
        entry["vs_first"] = None if entry is first else _difference(entry, first)
    return out


def _mean_se(values: list[float]) -> tuple[float, float | None] | None:
    """``(mean, standard error)`` of the finite values (SE None for one value), None when there are none."""
    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not finite:
        return None
    return statistics.fmean(finite), standard_error(finite) if len(finite) > 1 else None


def _mean_se_cell(pair: tuple[float, float | None] | None, fmt: str = ".3f") -> str:
    if pair is None:
        return "-"
    mean, se = pair
    return f"{mean:{fmt}}" + ("" if se is None else f" ± {se:{fmt}}")


def _difference(arm: dict[str, Any], first: dict[str, Any]) -> dict[str, Any]:
    """``arm``'s final mean minus ``first``'s, with Welch's standard error of the difference (unequal variances:
    each arm's own SE) and whether it exceeds 2 SE."""
    diff = arm["final_mean"] - first["final_mean"]
    if arm["final_se"] is None or first["final_se"] is None:
        return {"diff": diff, "se": None, "significant": None}
    se = math.hypot(arm["final_se"], first["final_se"])
    return {"diff": diff, "se": se, "significant": abs(diff) > 2 * se if math.isfinite(diff) else None}


def final_cell(arm: dict[str, Any]) -> str:
    """The final metric of an :func:`aggregate` arm: ``mean ± SE (n=N)``, or ``mean (n=1, no SE)`` for one seed."""
    n = len(arm["finals"])
    if n == 0:
        return "no eval"
    if arm["final_se"] is None:
        return f"{arm['final_mean']:.4g} (n=1, no SE)"
    return f"{arm['final_mean']:.4g} ± {arm['final_se']:.2g} (n={n})"


def vs_first_cell(arm: dict[str, Any]) -> str:
    """The significance column of an :func:`aggregate` arm: ``baseline`` for the first arm; else the difference of
    the final means ``± SE`` and ``> 2 SE`` / ``< 2 SE``, or ``no SE`` when an arm has one seed."""
    d = arm["vs_first"]
    if d is None:
        return "baseline"
    if d["se"] is None:
        return f"{d['diff']:+.3g} (no SE: needs 2+ seeds per arm)"
    return f"{d['diff']:+.3g} ± {d['se']:.2g} ({'> 2 SE' if d['significant'] else '< 2 SE, not significant'})"


def _fmt(v: Any) -> str:
    if v is None:
        return "not reached"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def arm_table(arms: dict[str, dict[str, Any]], target_metric: str, target_values: tuple[float, ...]) -> list[str]:
    """The per-arm markdown table of :func:`aggregate`'s ``arms`` (a caption line, a blank line, the table)."""
    first = next(iter(arms), "")
    lines = [f"Samples generated until {target_metric} first reaches each target: median over seeds (min-max), "
             f"seeds that reached it; ratio = the arm's median / {first}'s. Final metric: mean over seeds ± its "
             f"standard error; vs {first}: the difference of the means ± Welch's SE (from the per-seed values), "
             "significant when over 2 SE. Wall seconds: the logged step times (evaluation excluded), median over "
             "the seeds that reached the target. Best, diversity at the end and its ratio to the step-0 evaluation's: "
             "mean over seeds ± SE.", "",
             "| arm | seeds | " + " | ".join(f"samples to {v:g}" for v in target_values)
             + " | " + " | ".join(f"ratio at {v:g}" for v in target_values) + f" | final metric | vs {first} | "
             + " | ".join(f"wall s to {v:g}" for v in target_values)
             + " | best in budget | diversity at the end | diversity / step 0's | algorithm |",
             "|" + "---|" * (8 + 3 * len(target_values))]
    for arm, a in arms.items():
        cells = []
        for v in target_values:
            t = a["targets"][v]
            cells.append("not reached" if t["median"] is None else
                         f"{t['median']:g} ({t['min']}-{t['max']}), {t['n_reached']}/{a['n_seeds']}")
        ratios = [_fmt(a["targets"][v]["ratio"]) if a["targets"][v]["ratio"] is not None else "-"
                  for v in target_values]
        seconds = [_fmt(a["targets"][v]["median_seconds"]) for v in target_values]
        lines.append(f"| {arm} | {a['n_seeds']} | " + " | ".join(cells) + " | " + " | ".join(ratios)
                     + f" | {final_cell(a)} | {vs_first_cell(a)} | " + " | ".join(seconds)
                     + f" | {_mean_se_cell(a.get('best'))} | {_mean_se_cell(a.get('diversity'))}"
                     + f" | {_mean_se_cell(a.get('diversity_ratio'), '.2f')} | {a.get('algorithm', '')} |")
    return lines


def write_tables(summaries: list[dict[str, Any]], arms: dict[str, dict[str, Any]], out_dir: Path,
                 target_metric: str, target_values: tuple[float, ...]) -> None:
    """``compare.csv`` (one row per run) and ``compare.md`` (per arm: samples to each target, median with the
    range across seeds, seeds that reached it, ratio to the first arm, the final metric ± SE and its difference to
    the first arm's (:func:`arm_table`); then per run)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    per_target = [f"{kind}_to_{v:g}" for v in target_values for kind in ("samples", "seconds")]
    header = ["run", "arm", "algorithm", "seed", "samples", *per_target, "final_metric", "final_reward", "best_metric",
              "base_diversity", "final_diversity", "diversity_ratio"]
    rows = []
    for s in summaries:
        cells = {f"{kind}_to_{v:g}": s[f"{kind}_to"][v] for v in target_values for kind in ("samples", "seconds")}
        rows.append({**{h: s.get(h) for h in header}, **cells})
    with open(out_dir / "compare.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for row in rows:
            w.writerow(["" if row[h] is None else row[h] for h in header])
    lines = arm_table(arms, target_metric, target_values)
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(r[h]) for h in header) + " |" for r in rows]
    (out_dir / "compare.md").write_text("\n".join(lines) + "\n")


SAME_JOB_KEYS = ("model.adapter", "model.path", "model.height", "model.width", "data.prompts", "data.eval_prompts",
                 "eval.every", "eval.samples_per_prompt", "eval.max_prompts", "eval.seed", "eval.scorers")
"""Settings every arm must share: the model it starts from and the prompts and evaluation it is measured on (an
arm's own config may change anything else: its algorithm, sampler, rewards, batch shape)."""


def comparability_problems(configs: dict[str, Any]) -> list[str]:
    """One line per :data:`SAME_JOB_KEYS` key on which the arms' run configs (``{arm: Config}``) differ."""
    problems = []
    for key in SAME_JOB_KEYS:
        section, name = key.split(".")
        values = {arm: getattr(getattr(cfg, section), name, None) for arm, cfg in configs.items()}
        if len({repr(v) for v in values.values()}) > 1:
            problems.append(f"{key} differs between arms ({', '.join(f'{a}: {v!r}' for a, v in values.items())}); "
                            "every arm must start from the same model and be evaluated alike")
    return problems


def run_compare(cc: CompareConfig, *, progress: bool = True) -> Path:
    """Train every (arm, seed) one after the other (skipping finished runs), then write the comparison."""
    from flowforge.tools.compare.plot import write_plot
    from flowforge.train.preflight import preflight
    from flowforge.train.trainer import Trainer

    configs = {(arm, seed): _run_config(cc, arm, seed) for arm in cc.arms for seed in cc.seeds}
    problems = comparability_problems({arm: configs[arm, cc.seeds[0]] for arm in cc.arms})
    if problems:
        raise ConfigError(problems, header="the arms would not be compared on the same job")
    for cfg in configs.values():  # every arm validated before any model loads
        preflight(cfg)
    summaries = []
    for (arm, _), cfg in configs.items():
        run_dir = Path(cfg.run.output_dir) / cfg.run.name
        if (run_dir / "config.yaml").is_file():
            if load_config(run_dir / "config.yaml") != cfg:
                raise ConfigError([f"{run_dir} holds a run with a different config; remove it or change "
                                   "output_dir"], header="compare cannot reuse a run directory")
        if not (run_dir / "report.html").is_file():
            Trainer(cfg, progress=progress).train()
        summaries.append(summarize(run_dir, cc.target_metric, cc.target_values, arm=arm,
                                   diversity_metric=cc.diversity_metric))
    arms = aggregate(summaries, cc.target_values)
    write_tables(summaries, arms, cc.output_dir, cc.target_metric, cc.target_values)
    return write_plot(summaries, arms, cc.output_dir, cc.target_metric, cc.target_values)
