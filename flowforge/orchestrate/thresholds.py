"""Checks that a pipeline's gate and audit thresholds are ones a random student fails, at the number of groups they
are judged on (:mod:`flowforge.reward_model.null`), run by :func:`flowforge.orchestrate.config.check_pipeline`.

==========  =======================================================================================================
check       groups judged / rule
==========  =======================================================================================================
gate        the test groups stage B gets at ``stages.n_a`` (the first ``n_a`` conditions of the pass whose cluster
            the exact 80/10/10 cluster split puts in ``test``): at least ``student.gate.min_groups``, and a random
            student must pass ``student.gate``'s Spearman and pairwise thresholds with probability <
            ``student.gate.max_null_pass``; the problem names the smallest ``stages.n_a`` that passes
            (:func:`smallest_passing_n_a`); below the floors Spearman 0.5 / pairwise 0.7 a warning
audit       ``audit.pool_groups`` groups when audits are pooled, else ``data.prompts_per_step`` (one audited step),
            of ``data.group_size`` candidates, simulated from the teacher's marks (:func:`audit_design`,
            :mod:`flowforge.reward_model.power`): a random student must pass ``audit.min_spearman`` and
            ``audit.min_pairwise_accuracy`` with probability < ``audit.max_null_pass`` (the size; 1: not checked),
            and a student at the gate's bar (``student.gate``'s thresholds met in expectation, no more) must be
            stopped with probability >= ``audit.min_power`` (the power; 0: not checked); below the floors
            Spearman 0.2 / pairwise 0.6 a warning; a pool of fewer groups than one step's is a problem
==========  =======================================================================================================

The audit simulation draws its groups from stage A's judged marks (``A/judge/ledger.sqlite``) once they exist, else
from the default mark model (:func:`flowforge.reward_model.power.default_marks`: ``K`` independent uniform marks).
"""

from __future__ import annotations

from typing import Any

GATE_FLOORS = (0.5, 0.7)
"""(Spearman, pairwise accuracy) below which a gate is reported as too weak, whatever its null says."""
AUDIT_FLOORS = (0.2, 0.6)
"""The same for audits."""


def test_groups_by_budget(pcfg: Any) -> list[int]:
    """``counts[n]``: how many of the first ``n`` conditions of the pass (``n`` = 0 .. all of them) fall in the
    student's test split (:func:`flowforge.reward_model.data.split_clusters` over the pass's clusters)."""
    from itertools import accumulate

    from flowforge.data.prompts import load_prompts
    from flowforge.demo.paths import resolve_demo_path
    from flowforge.orchestrate.ledger import conditions_from_records, pass_order
    from flowforge.reward_model.data import split_clusters

    conditions = conditions_from_records(load_prompts(resolve_demo_path(pcfg.data.prompts)))
    split = split_clusters([c.cluster for c in conditions], pcfg.student.split_seed, pcfg.student.split)
    return [0, *accumulate(split[c.cluster] == "test" for c in pass_order(conditions, pcfg.stages.seed))]


def test_groups_at_budget(pcfg: Any, n_a: int | None = None) -> int:
    """How many of the first ``n_a`` (default ``stages.n_a``) conditions of the pass fall in the student's test
    split (:func:`test_groups_by_budget`)."""
    counts = test_groups_by_budget(pcfg)
    return counts[min(pcfg.stages.n_a if n_a is None else n_a, len(counts) - 1)]


SIMULATED_GROUPS = 200
"""Above this many groups :func:`null_pass` uses the normal approximation instead of the permutation draws (whose
cost grows with the groups: 9 s at 1,000 groups on this machine)."""


def null_pass(k: int, groups: int, min_spearman: float, min_pairwise_accuracy: float) -> float:
    """The probability that a random student passes both thresholds on ``groups`` untied groups of ``k``
    (:mod:`flowforge.reward_model.null`, seed 0: the same number every call); 1.0 when nothing can be judged
    (``k < 2`` or no group). Above :data:`SIMULATED_GROUPS` groups: the normal approximation's bound, the smaller
    tail of the two thresholds (a random ranking's Spearman has mean 0 and variance ``1 / (k - 1)`` per group, its
    Kendall tau variance ``2 (2k + 5) / (9 k (k - 1))``; pairwise accuracy is ``(1 + tau) / 2``)."""
    from flowforge.reward_model.null import null_draws, pass_probability, untied_groups

    if k < 2 or groups < 1:
        return 1.0
    if groups > SIMULATED_GROUPS:
        rho_sd = (1.0 / ((k - 1) * groups)) ** 0.5
        pair_sd = (2 * (2 * k + 5) / (9 * k * (k - 1)) / 4 / groups) ** 0.5
        tail = min(_upper_tail(min_spearman / rho_sd), _upper_tail((min_pairwise_accuracy - 0.5) / pair_sd))
        return tail
    return pass_probability(null_draws(untied_groups(k, groups), seed=0), min_spearman, min_pairwise_accuracy)


def _upper_tail(z: float) -> float:
    """``P(Z >= z)`` of a standard normal."""
    import math

    return 0.5 * math.erfc(z / math.sqrt(2.0))


def gate_reachable(pcfg: Any, groups: int) -> bool:
    """Whether ``groups`` test groups can pass ``student.gate``: at least ``min_groups`` of them, and a random
    student passes its thresholds with probability < ``max_null_pass`` (always, with ``max_null_pass`` 1)."""
    g = pcfg.student.gate
    if groups < max(g.min_groups, 1) or pcfg.data.group_size < 2:
        return False
    return g.max_null_pass >= 1 or null_pass(pcfg.data.group_size, groups, g.min_spearman,
                                             g.min_pairwise_accuracy) < g.max_null_pass


def smallest_passing_n_a(pcfg: Any, counts: list[int] | None = None) -> tuple[int, int] | None:
    """``(n_a, test groups)``: the smallest ``stages.n_a`` (a multiple of ``data.prompts_per_step``, at most all
    conditions) whose test groups pass :func:`gate_reachable`, found by bisection over the test-group counts
    (more groups never make the null easier to pass); None when no ``n_a`` does. ``counts``: from
    :func:`test_groups_by_budget` (computed when not given)."""
    counts = test_groups_by_budget(pcfg) if counts is None else counts
    m = pcfg.data.prompts_per_step
    budgets = list(range(m, len(counts), m))
    lo, hi = 0, len(budgets)  # invariant: budgets[hi:] pass (hi == len: none known to)
    while lo < hi:
        mid = (lo + hi) // 2
        if gate_reachable(pcfg, counts[budgets[mid]]):
            hi = mid
        else:
            lo = mid + 1
    return (budgets[lo], counts[budgets[lo]]) if lo < len(budgets) else None


def _gate_hint(pcfg: Any) -> str:
    """What ``stages.n_a`` would give a reachable gate, in words."""
    counts = test_groups_by_budget(pcfg)
    found = smallest_passing_n_a(pcfg, counts)
    if found is None:
        return (f"; no stages.n_a up to all {len(counts) - 1} conditions passes (min_groups and the null check): "
                "change student.gate")
    return f"; the smallest stages.n_a that passes is {found[0]} ({found[1]} test groups)"


A_MARKS = "the teacher's marks of stage A's"
"""How :func:`teacher_marks` names its source when the marks are stage A's real ones."""


def teacher_marks(pcfg: Any) -> tuple[list[Any], str]:
    """``(marks, source in words)``: the teacher's mark vectors of stage A's answered groups (``[K]`` float64 tensors,
    in presented order, from ``A/judge/ledger.sqlite``) when that ledger has any, else the default mark model's
    (:func:`flowforge.reward_model.power.default_marks`)."""
    from pathlib import Path

    import torch

    from flowforge.reward_model.power import default_marks
    from flowforge.rewards.judge.ledger import RequestLedger

    path = Path(pcfg.run.output_dir) / pcfg.run.name / "A" / "judge" / "ledger.sqlite"  # the pipeline directory
    marks = []
    if path.is_file():
        ledger = RequestLedger(path)
        try:
            entries = [ledger.get(key) for key in ledger.keys()]
        finally:
            ledger.close()
        marks = [torch.tensor([float(e.scores[label]) for label in e.request["labels"]], dtype=torch.float64)
                 for e in entries if e is not None and e.status == "ok" and e.scores]
    if marks:
        return marks, f"{A_MARKS} {len(marks)} judged groups"
    return default_marks(pcfg.data.group_size), "the default mark model (K independent uniform marks)"


def audit_design(pcfg: Any) -> dict[str, Any]:
    """Size and power of one audit verdict of ``pcfg`` (:func:`flowforge.reward_model.power.size_and_power` on
    ``audit.pool_groups`` groups, else one step's ``data.prompts_per_step``, of ``data.group_size``, with
    ``audit.tie_margin``, the bar student at ``student.gate``'s thresholds, marks from :func:`teacher_marks`): its
    dict plus ``groups`` and ``source``.

    Raises:
        ValueError: the teacher's marks have no group it can order (no verdict can be taken), or ``K < 2``.
    """
    from flowforge.reward_model.power import DEFAULT_TRIALS, size_and_power

    a, g = pcfg.audit, pcfg.student.gate
    groups = a.pool_groups or pcfg.data.prompts_per_step
    marks, source = teacher_marks(pcfg)
    out = size_and_power(marks, pcfg.data.group_size, groups, min_spearman=a.min_spearman,
                         min_pairwise_accuracy=a.min_pairwise_accuracy, gate_spearman=g.min_spearman,
                         gate_pairwise_accuracy=g.min_pairwise_accuracy, tie_margin=a.tie_margin)
    return {**out, "groups": groups, "source": source, "trials": DEFAULT_TRIALS}


def design_line(design: dict[str, Any]) -> str:
    """What ``flowforge check`` prints of :func:`audit_design`."""
    return (f"audit: a random student passes {100 * design['size']:.2f} %; a student at the gate's bar is stopped "
            f"{100 * design['power']:.1f} % ({design['groups']} groups per verdict; {design['trials']} verdicts "
            f"simulated from {design['source']})")


def audit_problems(pcfg: Any, notes: list[str] | None = None, warnings: list[str] | None = None) -> list[str]:
    """The size and power problems of :func:`audit_design` (one line naming the fields); its line to ``notes``.

    Before stage A has judged anything the design is the default mark model's, and a miss is a problem (the config
    is refused before anything runs). Once A's ledger holds the teacher's real marks, the pipeline is under way and a
    miss goes to ``warnings`` instead (when given): stage C records the design in ``audit_design.json`` and warns, and
    refusing here would make a started pipeline impossible to resume or to run its control arms."""
    a, g = pcfg.audit, pcfg.student.gate
    if a.max_null_pass >= 1 and a.min_power <= 0:  # both opted out: nothing to simulate
        return []
    try:
        design = audit_design(pcfg)
    except ValueError as exc:
        return [f"audit: {exc} (audit.tie_margin={a.tie_margin:g})"]
    if notes is not None:
        notes.append(design_line(design))
    bad = []
    if a.max_null_pass < 1 and not design["size"] < a.max_null_pass:
        bad.append(f"a random student passes {100 * design['size']:.2f} % >= audit.max_null_pass="
                   f"{a.max_null_pass:g}")
    if a.min_power > 0 and not design["power"] >= a.min_power:
        bad.append(f"a student at the gate's bar (student.gate.min_spearman={g.min_spearman:g}, "
                   f"min_pairwise_accuracy={g.min_pairwise_accuracy:g}) is stopped {100 * design['power']:.1f} % < "
                   f"audit.min_power={a.min_power:g}")
    if not bad:
        return []
    line = (f"audit: on {design['groups']} groups per verdict (audit.pool_groups, K={pcfg.data.group_size}) "
            f"{' and '.join(bad)} at audit.min_spearman={a.min_spearman:g} / audit.min_pairwise_accuracy="
            f"{a.min_pairwise_accuracy:g}; move the thresholds or audit.pool_groups (opt out: audit.max_null_pass=1, "
            "audit.min_power=0)")
    if warnings is not None and design["source"].startswith(A_MARKS):
        warnings.append(f"{line} [simulated from {design['source']}: stage A has run, so this is recorded, not "
                        "refused]")
        return []
    return [line]


def threshold_problems(pcfg: Any, test_groups: int | None = None, audited: tuple[int, str] | None = None,
                       notes: list[str] | None = None) -> tuple[list[str], list[str]]:
    """``(problems, warnings)`` of the module table. ``test_groups``: the gate's group count (default:
    :func:`test_groups_at_budget`; then a gate problem names the smallest ``stages.n_a`` that passes,
    :func:`smallest_passing_n_a`). ``audited``: ``(groups, plan in words)`` stage C's audits see
    (:func:`flowforge.orchestrate.plan.audited_groups`): a larger ``audit.pool_groups`` never reaches a verdict.
    ``notes``: gets :func:`design_line` (what ``flowforge check`` prints)."""
    problems, warnings = [], []
    k = pcfg.data.group_size
    g, a = pcfg.student.gate, pcfg.audit
    n_test = test_groups_at_budget(pcfg) if test_groups is None else test_groups
    skip = ()
    if 0 < a.pool_groups < pcfg.data.prompts_per_step:
        problems.append(f"audit.pool_groups={a.pool_groups} must be 0 or at least data.prompts_per_step="
                        f"{pcfg.data.prompts_per_step} (one audited step's groups)")
    if audited is not None and a.pool_groups > audited[0] and (a.first_groups > 0 or a.every > 0):
        problems.append(f"audit.pool_groups={a.pool_groups} exceeds the {audited[0]} groups stage C audits "
                        f"({audited[1]}): no pooled verdict would be reached before C's closing window, so no audit "
                        f"could stop C before it; give at most {audited[0]}, or audit more (audit.first_groups, "
                        "audit.every)")
        skip = ("audit",)  # its null at a pool never reached says nothing (and costs time)
    gate_where = f"{n_test} test groups at stages.n_a={pcfg.stages.n_a} (K={k} candidates each)"
    checks = (("student.gate", n_test, g.min_spearman, g.min_pairwise_accuracy, g.max_null_pass, GATE_FLOORS,
               gate_where),
              ("audit", a.pool_groups or pcfg.data.prompts_per_step, a.min_spearman, a.min_pairwise_accuracy,
               a.max_null_pass, AUDIT_FLOORS, f"{a.pool_groups or pcfg.data.prompts_per_step} groups per audit "
                                              f"verdict (K={k})"))
    for name, groups, rho, pairs, alpha, floors, where in (c for c in checks if c[0] not in skip):
        hint = _gate_hint(pcfg) if name == "student.gate" and test_groups is None else ""
        if k < 2 or groups < 1:
            problems.append(f"{name}: {where} cannot be judged against a random student{hint}")
            continue
        if name == "student.gate" and groups < g.min_groups:
            problems.append(f"{name}: {where} are fewer than student.gate.min_groups={g.min_groups}{hint}")
            continue
        if name == "audit":  # its size (and power) simulated from the teacher's marks above
            alpha = 1.0
        p = null_pass(k, groups, rho, pairs) if alpha < 1 else 0.0
        if alpha < 1 and not p < alpha:  # max_null_pass 1: no null check (a test of the mechanics)
            problems.append(f"{name}: a random student passes min_spearman={rho:g} and min_pairwise_accuracy="
                            f"{pairs:g} on {where} with probability {p:.3g} >= max_null_pass={alpha:g}; raise the "
                            f"thresholds or judge more groups{hint}")
        if rho < floors[0] or pairs < floors[1]:
            warnings.append(f"{name}: min_spearman={rho:g} / min_pairwise_accuracy={pairs:g} are below the floors "
                            f"{floors[0]:g} / {floors[1]:g}")
    if "audit" not in skip and k >= 2:
        problems += audit_problems(pcfg, notes, warnings)
    return problems, warnings


AUDIT_DESIGN_FILE = "audit_design.json"


def record_audit_design(pcfg: Any, run_dir: Any) -> dict[str, Any] | None:
    """At stage C's start: the audits' size and power simulated from stage A's judged marks (:func:`audit_design`;
    ``flowforge check`` before A ran had only the default mark model), written to ``C/audit_design.json`` and
    logged; a warning when they miss ``audit.max_null_pass`` / ``audit.min_power`` (C still runs: the config passed
    its check, and the unaudited budget and the verdicts still stop a bad student). None when both checks are opted
    out, or when A's teacher ordered no group (a warning: every audited step will be unaudited)."""
    import json
    import logging

    from flowforge.runtime.durable import write_bytes

    log = logging.getLogger("flowforge")
    a = pcfg.audit
    if a.max_null_pass >= 1 and a.min_power <= 0:
        return None
    try:
        design = audit_design(pcfg)
    except ValueError as exc:  # A's teacher ordered no group at the audits' tie margin
        log.warning("stage C audits: %s (audit.tie_margin=%g): every audited step will be unaudited", exc,
                    a.tie_margin)
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    write_bytes(run_dir / AUDIT_DESIGN_FILE, json.dumps(design, indent=1, default=float).encode())
    log.info("stage C %s", design_line(design))
    if (a.max_null_pass < 1 and not design["size"] < a.max_null_pass) or (
            a.min_power > 0 and not design["power"] >= a.min_power):
        log.warning("stage C audits on stage A's marks miss their bounds (audit.max_null_pass=%g, audit.min_power="
                    "%g): %s", a.max_null_pass, a.min_power, design_line(design))
    return design
