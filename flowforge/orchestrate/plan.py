"""What the pipeline owns in its stages' run configs, and how many steps, conditions and audited groups a pipeline
config gives each stage -- computed from the config alone, so :func:`flowforge.orchestrate.config.check_pipeline`
refuses a plan the condition ledger cannot serve before anything runs.

``stages.a_overrides`` / ``stages.c_overrides`` may change any run key of their stage except those in
:data:`PROTECTED` (refused by :func:`override_problems`, called by ``load_pipeline``): the teacher's endpoint and
budget live in ``teacher``, the rewards are the teacher's and the student's, and the stage directories, the prompt
file and where a stage resumes are the pipeline's.

==========  =====================================================================================================
stage       trainer steps (:func:`stage_steps`)
==========  =====================================================================================================
A           ``budget_A // M_A`` (``budget_A``: ``stages.n_a``, plus its extensions), at most ``train.steps`` of
            ``a_overrides`` when it sets one
C           ``budget_C // M_C`` after A's last step, at most ``stages.c_steps``, and at most up to ``train.steps``
            of ``c_overrides`` (C's run numbers its steps after A's)
==========  =====================================================================================================

``M_A`` / ``M_C`` is ``data.prompts_per_step`` with the stage's override; a stage draws ``steps x M`` conditions, so
the steps above never ask the ledger for more than the stage's budget; a ``train.steps`` override beyond that is a
problem of :func:`capacity_problems` that names the largest one that fits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from flowforge.settings.schema import Replace, parse_overrides

PROTECTED: dict[tuple[str, ...], str] = {
    ("reward", "weights"): "the reward is the teacher's in A and the student's in C",
    ("reward", "options"): "the judge's endpoint, model, token and budget come from the teacher section "
                           "(teacher.url / model / api_key_env / max_requests / judge)",
    ("reward", "required"): "the reward is the teacher's in A and the student's in C",
    ("train", "resume"): "A resumes its own checkpoints, C starts from A's last one",
    ("run", "output_dir"): "the stage's run directory is <pipeline>/A or <pipeline>/C",
    ("run", "name"): "the stage's run directory is <pipeline>/A or <pipeline>/C",
    ("data", "prompts"): "both stages draw their conditions from the one condition ledger over data.prompts",
}
"""Run keys (and everything under them) that a stage override may not set, with why: the pipeline sets them."""

OVERRIDABLE = ("every other run key: e.g. train.lr, train.steps (at most what the ledger serves), "
               "data.prompts_per_step, sampler.*, the algorithm's section, eval.*, checkpoint.*")


def _leaves(path: tuple[str, ...], value: Any) -> list[tuple[tuple[str, ...], bool]]:
    """``(key path, whole)`` for every key an override value sets: a merged mapping sets its keys, anything else
    (a ``!{...}`` replacement included) the whole path."""
    if isinstance(value, Mapping) and not isinstance(value, Replace) and value:
        return [leaf for key, inner in value.items() for leaf in _leaves((*path, str(key)), inner)]
    return [(path, True)]


def override_problems(field: str, overrides: Sequence[str]) -> list[str]:
    """One problem per override of ``overrides`` (``stages.a_overrides`` / ``c_overrides``, named ``field``) that
    sets a :data:`PROTECTED` key, or a section holding one; overrides that do not parse are left to the stage
    config's own check."""
    problems = []
    for item in overrides:
        nested, bad = parse_overrides([str(item)])
        if bad:
            continue
        touched = []
        for path, whole in (leaf for key, value in nested.items() for leaf in _leaves((key,), value)):
            touched += [(key, why) for key, why in PROTECTED.items()
                        if path[:len(key)] == key or (whole and key[:len(path)] == path)]
        if touched:
            names = ", ".join(dict.fromkeys(".".join(k) for k, _ in touched))
            why = "; ".join(dict.fromkeys(w for _, w in touched))
            problems.append(f"{field}: '{item}' sets {names}, which the pipeline owns ({why}); an override may "
                            f"change {OVERRIDABLE}, not {', '.join('.'.join(k) for k in PROTECTED)}")
    return problems


def stage_override(pcfg: Any, stage: str, *path: str) -> Any:
    """The value ``stages.<stage>_overrides`` sets at ``path`` (e.g. ``"train", "steps"``), or None."""
    raw = pcfg.stages.a_overrides if stage == "A" else pcfg.stages.c_overrides
    node: Any = parse_overrides([str(o) for o in raw])[0]
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def prompts_per_step(pcfg: Any, stage: str) -> int:
    """``M`` of ``stage``: ``data.prompts_per_step`` with the stage's override (the stage config refuses a bad
    one; here a bad one counts as the pipeline's)."""
    m = _int(stage_override(pcfg, stage, "data", "prompts_per_step"))
    return m if m is not None and m >= 1 else pcfg.data.prompts_per_step


def _served_steps(pcfg: Any, stage: str, budget: int) -> int:
    """The most steps ``budget`` conditions serve ``stage`` (C: at most ``stages.c_steps``), before any
    ``train.steps`` override."""
    steps = budget // prompts_per_step(pcfg, stage)
    return min(steps, pcfg.stages.c_steps) if stage == "C" and pcfg.stages.c_steps else steps


def stage_steps(pcfg: Any, stage: str, budget: int, *, start: int = 0) -> int:
    """The trainer steps of ``stage`` on ``budget`` conditions, its first step being ``start`` (A: 0; C: A's steps),
    per the module table: never more than the budget serves."""
    steps = _served_steps(pcfg, stage, budget)
    end = _int(stage_override(pcfg, stage, "train", "steps"))
    return max(0, min(steps, end - start)) if end is not None else steps


def capacity_problems(pcfg: Any, total: int) -> list[str]:
    """Problems of a plan the condition ledger (``total`` conditions, ``stages.n_a`` for A) cannot serve: a
    ``train.steps`` override that draws more conditions than the stage's budget (with the largest that fits), and a
    stage A without a step."""
    problems = []
    n_a = pcfg.stages.n_a
    start = 0
    for stage, budget in (("A", n_a), ("C", total - n_a)):
        m, fits = prompts_per_step(pcfg, stage), _served_steps(pcfg, stage, budget)
        field = f"stages.{stage.lower()}_overrides"
        end = _int(stage_override(pcfg, stage, "train", "steps"))
        served = f"stages.n_a={n_a}" if stage == "A" else f"the {budget} conditions after stages.n_a={n_a}"
        if end is not None and end - start > fits:
            problems.append(f"{field}: train.steps={end} has stage {stage} draw {end - start} steps x {m} "
                            f"conditions = {(end - start) * m}, but the condition ledger serves it {served}"
                            + (f" (stages.c_steps={pcfg.stages.c_steps})" if stage == "C" and pcfg.stages.c_steps
                               else "") + f"; the largest train.steps that fits is {start + fits}")
        elif end is not None and end <= start:
            problems.append(f"{field}: train.steps={end} leaves stage {stage} no step (it starts at step {start}); "
                            f"give {start + 1} .. {start + fits}")
        elif stage == "A" and fits == 0:
            problems.append(f"stage A gets no step: stages.n_a={n_a} conditions are fewer than its "
                            f"data.prompts_per_step={m}")
        if stage == "A":
            start = stage_steps(pcfg, "A", n_a)
    return problems


def audited_groups(pcfg: Any, total: int) -> tuple[int, str]:
    """``(groups, how)``: how many groups stage C's audits see at ``stages.n_a`` from their first-groups and periodic
    schedule alone (its steps by :func:`stage_steps`, audited by the one schedule :meth:`AuditConfig.due
    <flowforge.orchestrate.config.AuditConfig.due>` with ``closing`` off): a larger pool fills, if at all, only in
    the closing window, so no audit could stop C before it. ``how``: the plan in words, with the closing window's
    groups."""
    a = pcfg.audit
    start = stage_steps(pcfg, "A", pcfg.stages.n_a)
    steps = stage_steps(pcfg, "C", total - pcfg.stages.n_a, start=start)
    m = prompts_per_step(pcfg, "C")
    during = dataclasses.replace(a, closing=False)
    audited = sum(during.due(s, first=start, end=start + steps, m=m) for s in range(start, start + steps))
    closing = sum(a.due(s, first=start, end=start + steps, m=m) for s in range(start, start + steps)) - audited
    how = (f"{steps} steps of {m} conditions from step {start}: the first {a.first_groups} groups"
           + (f", then every {a.every}th step" if a.every else "") + f": {audited * m} groups"
           + (f", and {closing * m} more of C's last steps for the closing verdict" if a.closing_steps(m) else ""))
    return audited * m, how
