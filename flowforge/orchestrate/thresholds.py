"""Checks that a pipeline's gate and audit thresholds are ones a random student fails, at the number of groups they
are judged on (:mod:`flowforge.reward_model.null`), run by :func:`flowforge.orchestrate.config.check_pipeline`.

==========  =======================================================================================================
check       groups judged / rule
==========  =======================================================================================================
gate        the test groups stage B gets at ``stages.n_a`` (the first ``n_a`` conditions of the pass whose cluster
            the exact 80/10/10 cluster split puts in ``test``): a random student must pass ``student.gate``'s
            Spearman and pairwise thresholds with probability < ``student.gate.max_null_pass``; below the floors
            Spearman 0.5 / pairwise 0.7 a warning
audit       ``audit.pool_groups`` groups when audits are pooled, else ``data.prompts_per_step`` (one audited step),
            of ``data.group_size`` candidates: a random student must pass ``audit.min_spearman`` and
            ``audit.min_pairwise_accuracy`` with probability < ``audit.max_null_pass``; below the floors Spearman
            0.2 / pairwise 0.6 a warning; a pool of fewer groups than one step's is a problem
==========  =======================================================================================================
"""

from __future__ import annotations

from typing import Any

GATE_FLOORS = (0.5, 0.7)
"""(Spearman, pairwise accuracy) below which a gate is reported as too weak, whatever its null says."""
AUDIT_FLOORS = (0.2, 0.6)
"""The same for audits."""


def test_groups_at_budget(pcfg: Any, n_a: int | None = None) -> int:
    """How many of the first ``n_a`` (default ``stages.n_a``) conditions of the pass fall in the student's test
    split (:func:`flowforge.reward_model.data.split_clusters` over the pass's clusters)."""
    from flowforge.data.prompts import load_prompts
    from flowforge.demo.paths import resolve_demo_path
    from flowforge.orchestrate.ledger import conditions_from_records, pass_order
    from flowforge.reward_model.data import split_clusters

    conditions = conditions_from_records(load_prompts(resolve_demo_path(pcfg.data.prompts)))
    split = split_clusters([c.cluster for c in conditions], pcfg.student.split_seed, pcfg.student.split)
    first = pass_order(conditions, pcfg.stages.seed)[:pcfg.stages.n_a if n_a is None else n_a]
    return sum(split[c.cluster] == "test" for c in first)


def threshold_problems(pcfg: Any, test_groups: int | None = None) -> tuple[list[str], list[str]]:
    """``(problems, warnings)`` of the module table. ``test_groups``: the gate's group count (default:
    :func:`test_groups_at_budget`)."""
    from flowforge.reward_model.null import null_draws, pass_probability, untied_groups

    problems, warnings = [], []
    k = pcfg.data.group_size
    g, a = pcfg.student.gate, pcfg.audit
    n_test = test_groups_at_budget(pcfg) if test_groups is None else test_groups
    checks = (("student.gate", n_test, g.min_spearman, g.min_pairwise_accuracy, g.max_null_pass, GATE_FLOORS,
               "test groups at stages.n_a"),
              ("audit", a.pool_groups or pcfg.data.prompts_per_step, a.min_spearman, a.min_pairwise_accuracy,
               a.max_null_pass, AUDIT_FLOORS, "groups per audit verdict"))
    if 0 < a.pool_groups < pcfg.data.prompts_per_step:
        problems.append(f"audit.pool_groups={a.pool_groups} must be 0 or at least data.prompts_per_step="
                        f"{pcfg.data.prompts_per_step} (one audited step's groups)")
    for name, groups, rho, pairs, alpha, floors, what in checks:
        if k < 2 or groups < 1:
            problems.append(f"{name}: {groups} {what} of {k} candidates cannot be judged against a random student")
            continue
        p = pass_probability(null_draws(untied_groups(k, groups), seed=0), rho, pairs)
        if alpha < 1 and not p < alpha:  # max_null_pass 1: no null check (a test of the mechanics)
            problems.append(f"{name}: a random student passes min_spearman={rho:g} and min_pairwise_accuracy="
                            f"{pairs:g} on {groups} {what} (K={k}) with probability {p:.3g} >= max_null_pass="
                            f"{alpha:g}; raise the thresholds or judge more groups")
        if rho < floors[0] or pairs < floors[1]:
            warnings.append(f"{name}: min_spearman={rho:g} / min_pairwise_accuracy={pairs:g} are below the floors "
                            f"{floors[0]:g} / {floors[1]:g}")
    return problems, warnings
