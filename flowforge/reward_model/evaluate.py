"""Held-out agreement of a student with its teacher, and the quality gate that must pass before stage C.

Per held-out group with teacher scores ``t`` and student scores ``s`` (``[K]``, both on ``[0, 1]``):

==========================  =========================================================================================
metric                      definition
==========================  =========================================================================================
``spearman``                mean over groups of the Pearson correlation of the ranks of ``s`` and ``t`` (ties get
                            their average rank; Spearman 1904). A group whose teacher scores all tie has no order and
                            is left out (``groups_tied``); a student that ties every candidate of an ordered group
                            scores 0 there.
``pairwise_accuracy``       over all pairs ``i < j`` with ``t_i != t_j`` pooled across groups: the fraction with
                            ``sign(s_i - s_j) == sign(t_i - t_j)``; a student tie counts one half
``mae``                     mean ``|s - t|`` over every candidate of the scored groups (raw marks)
``failure_rate``            fraction of groups the student could not score (any NaN, e.g. an unparseable answer);
                            those groups are left out of the three metrics above
==========================  =========================================================================================

With ``tie_margin`` > 0 (``student.gate.tie_margin``, ``audit.tie_margin``) a teacher's marks that differ by no more
than its own retest noise count as ties: before Spearman and pairwise accuracy, each group's teacher marks are
replaced by their tie block (:func:`tie_blocks`), so "``t_i != t_j``" and "all tie" above read "in different blocks"
and "one block". ``tie_margin`` 0 gives exact ties only (the table as written).

:func:`gate` compares these with :class:`flowforge.reward_model.config.GateThresholds`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor


def average_ranks(values: Tensor) -> Tensor:
    """``[K]`` -> ``[K]`` float64 ranks 0..K-1, ties given the mean of the ranks they span."""
    values = values.double()
    order = torch.argsort(values, stable=True)
    ranks = torch.empty_like(values)
    sorted_values = values[order]
    start = 0
    for end in range(1, len(values) + 1):
        if end == len(values) or sorted_values[end] != sorted_values[start]:
            ranks[order[start:end]] = (start + end - 1) / 2.0
            start = end
    return ranks


def tie_blocks(values: Tensor, margin: float = 0.0) -> Tensor:
    """``[K]`` teacher marks -> ``[K]`` float64 tie-block index (0 = lowest block): sorted ascending, a block takes
    every mark within ``margin`` of the block's lowest mark, the next mark starts a new block. ``margin`` 0: one
    block per distinct value (exact ties only), so ranks and pair signs equal those of ``values``.

    Raises:
        ValueError: a negative ``margin``.
    """
    if margin < 0:
        raise ValueError(f"tie_margin must be >= 0, got {margin}")
    values = values.double().view(-1)
    order = torch.argsort(values, stable=True)
    blocks = torch.empty_like(values)
    block, low = -1, math.inf
    for i in order.tolist():
        if block < 0 or values[i] - low > margin:
            block, low = block + 1, float(values[i])
        blocks[i] = block
    return blocks


def spearman(student: Tensor, teacher: Tensor) -> float:
    """Spearman's rank correlation of two ``[K]`` score vectors (module table); NaN when ``teacher`` has no order,
    0 when only ``student`` ties everything."""
    rt, rs = average_ranks(teacher), average_ranks(student)
    dt, ds = rt - rt.mean(), rs - rs.mean()
    nt, ns = dt.norm(), ds.norm()
    if nt == 0:
        return math.nan
    if ns == 0:
        return 0.0
    return float((dt * ds).sum() / (nt * ns))


def pair_agreement(student: Tensor, teacher: Tensor) -> tuple[float, int]:
    """``(agreeing pairs, teacher-ordered pairs)`` of one group: pairs ``i < j`` with ``t_i != t_j``; a student tie
    adds one half."""
    dt = teacher.double()[:, None] - teacher.double()[None, :]
    ds = student.double()[:, None] - student.double()[None, :]
    upper = torch.triu(torch.ones_like(dt, dtype=torch.bool), diagonal=1) & (dt != 0)
    same = (torch.sign(ds) == torch.sign(dt)) & upper
    ties = (ds == 0) & upper
    return float(same.sum() + 0.5 * ties.sum()), int(upper.sum())


def agreement(student: Sequence[Tensor], teacher: Sequence[Tensor], tie_margin: float = 0.0) -> dict[str, float]:
    """The module table's metrics over groups (``student[g]``, ``teacher[g]``: ``[K_g]`` scores on [0, 1]), plus
    ``groups`` (scored), ``groups_tied`` and ``pairs``; teacher marks within ``tie_margin`` tie (:func:`tie_blocks`).
    Metrics with nothing to average are NaN.

    Raises:
        ValueError: different numbers of groups, a group whose two vectors differ in length, a negative margin.
    """
    if len(student) != len(teacher):
        raise ValueError(f"{len(student)} student groups vs {len(teacher)} teacher groups")
    rhos, errors, agree, pairs, failed, tied = [], [], 0.0, 0, 0, 0
    for s, t in zip(student, teacher):
        s, t = torch.as_tensor(s).double().view(-1), torch.as_tensor(t).double().view(-1)
        if s.shape != t.shape:
            raise ValueError(f"a group has {s.numel()} student scores and {t.numel()} teacher scores")
        if torch.isnan(s).any():
            failed += 1
            continue
        errors.append((s - t).abs())
        blocks = tie_blocks(t, tie_margin)
        rho = spearman(s, blocks)
        if math.isnan(rho):
            tied += 1
        else:
            rhos.append(rho)
        a, n = pair_agreement(s, blocks)
        agree, pairs = agree + a, pairs + n
    total = len(student)
    return {"groups": float(total - failed), "groups_tied": float(tied), "pairs": float(pairs),
            "spearman": sum(rhos) / len(rhos) if rhos else math.nan,
            "pairwise_accuracy": agree / pairs if pairs else math.nan,
            "mae": float(torch.cat(errors).mean()) if errors else math.nan,
            "failure_rate": failed / total if total else math.nan}


def _threshold(thresholds: Any, name: str) -> float:
    return float(thresholds[name] if isinstance(thresholds, Mapping) else getattr(thresholds, name))


def gate(metrics: Mapping[str, float], thresholds: Any) -> tuple[bool, list[str]]:
    """Whether the held-out ``metrics`` (:func:`agreement`) pass ``thresholds`` (a
    :class:`~flowforge.reward_model.config.GateThresholds` or a mapping with its field names), and every reason
    they do not (empty when passed). A NaN metric fails its check.
    """
    reasons = []
    groups, need = metrics.get("groups", 0.0), _threshold(thresholds, "min_groups")
    if not groups >= need:
        reasons.append(f"only {groups:g} held-out groups were scored; the gate needs min_groups={need:g}")
    checks = (("spearman", "min_spearman", True), ("pairwise_accuracy", "min_pairwise_accuracy", True),
              ("mae", "max_mae", False), ("failure_rate", "max_failure_rate", False))
    for metric, name, at_least in checks:
        value, bound = float(metrics.get(metric, math.nan)), _threshold(thresholds, name)
        ok = value >= bound if at_least else value <= bound
        if not ok:  # NaN compares False: fails
            reasons.append(f"{metric}={value:.4g} {'<' if at_least else '>'} {name}={bound:g}"
                           if not math.isnan(value) else f"{metric} is NaN (nothing to measure); {name}={bound:g}")
    return not reasons, reasons


def evaluate(student: Any, groups: Sequence[Any], tie_margin: float = 0.0) -> dict[str, float]:
    """:func:`agreement` of ``student.predict(groups)`` (one ``[K]`` tensor per group, presented order) with the
    groups' teacher scores."""
    predictions = student.predict(groups) if groups else []
    return agreement(predictions, [torch.tensor(g.scores, dtype=torch.float64) for g in groups], tie_margin)
