"""The permutation null of student-teacher agreement: what a *random* student scores, so that a gate or an audit can
be set where a random student fails.

A random student ranks the ``K`` candidates of each group in a uniformly random order. For ``trials`` draws, every
group's teacher scores ``t`` (``[K_g]``) are paired with a random permutation of ``0..K_g-1`` as student scores and
the draw is scored as the repository's own :func:`~flowforge.reward_model.evaluate.agreement` scores a student
(within-group Spearman averaged over groups, pooled pairwise accuracy). From the draws:

============================  =====================================================================================
``pass_probability``          fraction of draws whose Spearman >= ``min_spearman`` **and** pairwise accuracy >=
                              ``min_pairwise_accuracy``: the chance that a random student passes those thresholds
                              on these groups (Monte Carlo, standard error ``sqrt(p (1 - p) / trials)``)
``p_value``                   ``(1 + #{draws >= observed}) / (1 + trials)`` for an observed metric (the permutation
                              test's p-value, Phipson & Smyth 2010, never 0)
``quantile``                  the ``1 - alpha`` quantile of a metric under the null
============================  =====================================================================================

With teacher scores that do not tie, the null depends only on ``K`` and the number of groups
(:func:`untied_groups`), so thresholds for a config can be computed before any group was judged. Draws come from a
``torch.Generator`` seeded with ``seed``: the same inputs give the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from flowforge.reward_model.evaluate import average_ranks, tie_blocks

DEFAULT_TRIALS = 2000
DEFAULT_ALPHA = 0.01
"""A random student may pass a gate or an audit with probability below this."""


def untied_groups(k: int, groups: int) -> list[Tensor]:
    """``groups`` teacher score vectors ``[k]`` without ties (``0, 1, ..., k-1`` scaled to [0, 1]).

    Raises:
        ValueError: ``k < 2`` or ``groups < 1``.
    """
    if k < 2 or groups < 1:
        raise ValueError(f"the null needs groups of k >= 2 candidates and >= 1 group, got k={k}, groups={groups}")
    return [torch.arange(k, dtype=torch.float64) / (k - 1) for _ in range(groups)]


def null_draws(teacher: Sequence[Tensor], *, trials: int = DEFAULT_TRIALS, seed: int = 0,
               tie_margin: float = 0.0) -> dict[str, Tensor]:
    """``{"spearman": [trials], "pairwise_accuracy": [trials]}`` float64: the agreement of ``trials`` random
    students with ``teacher`` (one ``[K_g]`` tensor per group), computed for all trials at once with the definitions
    of :func:`~flowforge.reward_model.evaluate.agreement` (teacher ties get average ranks; a group whose teacher
    scores all tie is left out of the Spearman mean and has no pairs; marks within ``tie_margin`` tie, as there);
    equal to calling ``agreement`` per draw (a test checks it).

    Raises:
        ValueError: no groups, or ``trials < 1``.
    """
    if not teacher or trials < 1:
        raise ValueError(f"the null needs >= 1 group and >= 1 trial, got {len(teacher)} groups, {trials} trials")
    gen = torch.Generator().manual_seed(seed)
    rho_sum = torch.zeros(trials, dtype=torch.float64)
    agree = torch.zeros(trials, dtype=torch.float64)
    ordered_groups, pairs = 0, 0
    for t in teacher:
        t = tie_blocks(torch.as_tensor(t, dtype=torch.float64).view(-1), tie_margin)  # agreement's tie rule
        k = t.numel()
        student = torch.argsort(torch.rand(trials, k, generator=gen), dim=1).double()  # [trials, k] ranks
        rt = average_ranks(t)
        dt = rt - rt.mean()
        if dt.norm() > 0:
            ds = student - student.mean(dim=1, keepdim=True)
            rho_sum += (ds * dt).sum(dim=1) / (ds.norm(dim=1) * dt.norm())
            ordered_groups += 1
        upper = torch.triu(torch.ones(k, k, dtype=torch.bool), diagonal=1) & (t[:, None] != t[None, :])
        sign_t = torch.sign(t[:, None] - t[None, :])
        sign_s = torch.sign(student[:, :, None] - student[:, None, :])  # [trials, k, k]
        agree += ((sign_s == sign_t) & upper).sum(dim=(1, 2)).double()
        pairs += int(upper.sum())
    nan = torch.full((trials,), math.nan, dtype=torch.float64)
    return {"spearman": rho_sum / ordered_groups if ordered_groups else nan,
            "pairwise_accuracy": agree / pairs if pairs else nan}


def pass_probability(draws: dict[str, Tensor], min_spearman: float, min_pairwise_accuracy: float) -> float:
    """Fraction of null ``draws`` (:func:`null_draws`) that pass both thresholds. NaN draws (no ordered group) fail."""
    ok = (draws["spearman"] >= min_spearman) & (draws["pairwise_accuracy"] >= min_pairwise_accuracy)
    return float(ok.double().mean())


def p_value(draws: Tensor, observed: float) -> float:
    """Permutation p-value of ``observed`` against null ``draws`` ``[trials]`` (module table); NaN for a NaN
    observation."""
    if math.isnan(observed):
        return math.nan
    return float((1 + (draws >= observed - 1e-12).sum()) / (1 + draws.numel()))


def quantile(draws: Tensor, alpha: float = DEFAULT_ALPHA) -> float:
    """The ``1 - alpha`` quantile of null ``draws`` ``[trials]`` (NaN draws left out)."""
    kept = draws[~torch.isnan(draws)]
    return float(torch.quantile(kept, 1.0 - alpha)) if kept.numel() else math.nan


def null_summary(teacher: Sequence[Tensor], min_spearman: float, min_pairwise_accuracy: float,
                 observed: dict[str, float] | None = None, *, trials: int = DEFAULT_TRIALS,
                 seed: int = 0, tie_margin: float = 0.0) -> dict[str, float]:
    """What the gate and the audits record: ``pass_probability`` of the thresholds on ``teacher``'s groups, its
    Monte Carlo standard error, the null's 99th percentiles (``spearman_q99``, ``pairwise_q99``), and, for
    ``observed`` metrics (``agreement``), their permutation p-values (``spearman_p``, ``pairwise_p``)."""
    draws = null_draws(teacher, trials=trials, seed=seed, tie_margin=tie_margin)
    p = pass_probability(draws, min_spearman, min_pairwise_accuracy)
    out = {"groups": float(len(teacher)), "trials": float(trials), "pass_probability": p,
           "pass_probability_se": math.sqrt(p * (1 - p) / trials),
           "spearman_q99": quantile(draws["spearman"]), "pairwise_q99": quantile(draws["pairwise_accuracy"])}
    if observed is not None:
        out["spearman_p"] = p_value(draws["spearman"], float(observed.get("spearman", math.nan)))
        out["pairwise_p"] = p_value(draws["pairwise_accuracy"], float(observed.get("pairwise_accuracy", math.nan)))
    return out
