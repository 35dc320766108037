"""Size and power of an audit verdict, by simulation from teacher marks: how often a *random* student passes
(the size, wanted < 1 %) and how often a student whose true agreement sits at the gate's bar is stopped (the power,
wanted >= 0.8).

A verdict is taken on ``groups`` groups of ``K`` candidates the teacher can order (at least two tie blocks of
:func:`~flowforge.reward_model.evaluate.tie_blocks` at ``tie_margin``) and passes when the pooled agreement
(:func:`~flowforge.reward_model.evaluate.agreement`: mean within-group Spearman, pooled pairwise accuracy) meets
both thresholds. Each of ``trials`` simulated verdicts draws its groups, with replacement, from a pool of teacher
mark vectors (the real ones: stage A's judged groups; before any run: :func:`default_marks`) and scores them with:

==================  ===============================================================================================
student             scores of a group's candidates (``[K]``; ``z``: the normal scores ``Phi^-1((r + 0.5) / K)`` of
                    the teacher's tie-block average ranks ``r``; ``e``: standard normal noise)
==================  ===============================================================================================
random              ``e``: independent of the teacher (the permutation null of :mod:`flowforge.reward_model.null`)
at the gate's bar   ``z + sigma e``, ``sigma`` the largest noise at which the student's *expected* Spearman and
                    pairwise accuracy (over the mark pool) still meet the gate's thresholds: the weakest student the
                    gate is there to admit, found by bisection on common random numbers
==================  ===============================================================================================

``size`` = P(random student passes both thresholds), ``power`` = P(student at the bar fails at least one). Draws
come from a ``torch.Generator`` seeded with ``seed`` (the same inputs give the same numbers): one bank of simulated
groups per student (``[BANK, K, K]`` at once), whose per-group agreements every verdict resamples.

The default mark model (:func:`default_marks`, used before stage A has judged anything): each group's ``K`` marks
independent uniform on ``[0, 1]`` (the judge's mark range), tied within ``tie_margin`` as the audits tie them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

DEFAULT_TRIALS = 2000  # Monte Carlo standard error <= 0.011 (0.009 at a power of 0.8, 0.002 at a size of 0.01)
BANK = 8192  # simulated groups per student: the verdicts resample them
CALIBRATION_GROUPS = 4096  # the bank's first groups, on which the bar student's noise is set (SE of its mean ~0.005)
CALIBRATION_STEPS = 12  # bisection steps: sigma to 1/4096 of its bracket
DEFAULT_MARK_GROUPS = 256


def default_marks(k: int, *, groups: int = DEFAULT_MARK_GROUPS, seed: int = 0) -> list[Tensor]:
    """``groups`` teacher mark vectors ``[k]`` float64, each mark independent uniform on [0, 1] (module docstring).

    Raises:
        ValueError: ``k < 2`` or ``groups < 1``.
    """
    if k < 2 or groups < 1:
        raise ValueError(f"a mark model needs groups of k >= 2 candidates and >= 1 group, got k={k}, groups={groups}")
    gen = torch.Generator().manual_seed(seed)
    return list(torch.rand(groups, k, generator=gen, dtype=torch.float64))


def orderable(marks: Sequence[Tensor], k: int, tie_margin: float = 0.0) -> Tensor:
    """``[G, k]`` float64 tie blocks of the mark vectors of ``marks`` that have ``k`` candidates, no NaN, and more
    than one tie block at ``tie_margin`` (the groups an audit verdict counts); ``G`` may be 0."""
    rows = [torch.as_tensor(m, dtype=torch.float64).view(-1) for m in marks]
    rows = [r for r in rows if r.numel() == k and not torch.isnan(r).any()]
    if not rows:
        return torch.zeros(0, k, dtype=torch.float64)
    blocks = batched_tie_blocks(torch.stack(rows), tie_margin)
    return blocks[blocks.amax(dim=1) > 0]


def batched_tie_blocks(marks: Tensor, margin: float = 0.0) -> Tensor:
    """:func:`~flowforge.reward_model.evaluate.tie_blocks` of every row of ``marks`` ``[G, K]`` at once (the same
    rule: sorted ascending, a block takes every mark within ``margin`` of its lowest): ``[G, K]`` float64."""
    values, order = torch.sort(marks.double(), dim=1, stable=True)
    sorted_blocks = torch.zeros_like(values)
    low, block = values[:, 0].clone(), torch.zeros_like(values[:, 0])
    for j in range(1, values.shape[1]):  # K steps, every group at once
        new = values[:, j] - low > margin
        block = block + new.double()
        low = torch.where(new, values[:, j], low)
        sorted_blocks[:, j] = block
    return torch.empty_like(sorted_blocks).scatter_(1, order, sorted_blocks)


def _ranks(values: Tensor) -> Tensor:
    """``[..., K]`` -> ``[..., K]`` float64 average ranks 0..K-1 (ties share the mean of their ranks)."""
    less = (values[..., None, :] < values[..., :, None]).sum(-1)
    equal = (values[..., None, :] == values[..., :, None]).sum(-1)
    return (less + (equal - 1) / 2.0).double()


class _Groups:
    """The teacher side of the mark pool, precomputed per group: centred unit ranks, normal scores, pair signs."""

    def __init__(self, blocks: Tensor) -> None:
        k = blocks.shape[1]
        rt = _ranks(blocks)  # [G, K]
        dt = rt - rt.mean(dim=1, keepdim=True)
        self.dt = dt / dt.norm(dim=1, keepdim=True)
        self.z = torch.distributions.Normal(0.0, 1.0).icdf((rt + 0.5) / k)  # [G, K]
        self.sign_t = torch.sign(blocks[:, :, None] - blocks[:, None, :])  # [G, K, K]
        self.mask = torch.triu(torch.ones(k, k, dtype=torch.bool), diagonal=1) & (self.sign_t != 0)

    def per_group(self, idx: Tensor, student: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(spearman, agreeing pairs, pairs)`` ``[B]`` float64 of students ``[B, K]`` (continuous: no ties) on
        the pool's groups ``idx`` ``[B]``."""
        rs = torch.argsort(torch.argsort(student, dim=-1), dim=-1).double()
        ds = rs - rs.mean(dim=-1, keepdim=True)
        rho = ((ds / ds.norm(dim=-1, keepdim=True)) * self.dt[idx]).sum(-1)
        sign_s = torch.sign(rs[:, :, None] - rs[:, None, :])
        mask = self.mask[idx]
        return rho, ((sign_s == self.sign_t[idx]) & mask).sum(dim=(1, 2)).double(), mask.sum(dim=(1, 2)).double()


def bar_noise(pool: _Groups, idx: Tensor, noise: Tensor, min_spearman: float, min_pairwise_accuracy: float) -> float:
    """The largest ``sigma`` (module table) at which the student ``z + sigma e`` on the groups ``idx`` ``[B]`` with
    noise ``[B, K]`` has a mean Spearman >= ``min_spearman`` and a pooled pairwise accuracy >=
    ``min_pairwise_accuracy`` (bisection; the same draws at every ``sigma``); ``math.inf`` when a random student
    meets both in expectation (thresholds at or below 0 / 0.5), 0 when no noise does (thresholds of 1)."""

    def meets(sigma: float) -> bool:
        rho, agree, pairs = pool.per_group(idx, pool.z[idx] + sigma * noise)
        return bool(rho.mean() >= min_spearman) and bool(agree.sum() / pairs.sum() >= min_pairwise_accuracy)

    if min_spearman <= 0.0 and min_pairwise_accuracy <= 0.5:
        return math.inf
    if not meets(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while meets(hi):  # the expected agreement falls towards the null's as sigma grows
        lo, hi = hi, 2 * hi
        if hi > 1e6:
            return math.inf
    for _ in range(CALIBRATION_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo


def size_and_power(marks: Sequence[Tensor], k: int, groups: int, *, min_spearman: float,
                   min_pairwise_accuracy: float, gate_spearman: float, gate_pairwise_accuracy: float,
                   tie_margin: float = 0.0, trials: int = DEFAULT_TRIALS, seed: int = 0) -> dict[str, float]:
    """Size and power (module docstring) of a verdict on ``groups`` orderable groups of ``k`` drawn from ``marks``
    (``[k]`` mark vectors; others are left out) at the audit thresholds ``min_*``, the bar student set at the gate's
    ``gate_*``. Returns ``{"size", "power", "sigma", "bar_spearman", "bar_pairwise_accuracy", "orderable",
    "marks"}``: ``sigma`` the bar student's noise (:func:`bar_noise`), ``bar_*`` its expected agreement,
    ``orderable`` the fraction of mark vectors the teacher can order.

    The per-group agreements of :data:`BANK` simulated groups (random and bar student) are computed once; each of
    the ``trials`` verdicts pools ``groups`` of them drawn with replacement (groups are independent, so the cost
    does not grow with ``groups``).

    Raises:
        ValueError: ``k < 2``, ``groups < 1``, ``trials < 1``, or no mark vector of ``marks`` is orderable.
    """
    if k < 2 or groups < 1 or trials < 1:
        raise ValueError(f"size_and_power needs k >= 2, groups >= 1, trials >= 1; got k={k}, groups={groups}, "
                         f"trials={trials}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: more threads only contend (measured 0.1 s on one, up to 6 s on two)
    try:
        return _size_and_power(marks, k, groups, min_spearman, min_pairwise_accuracy, gate_spearman,
                               gate_pairwise_accuracy, tie_margin, trials, seed)
    finally:
        torch.set_num_threads(threads)


def _size_and_power(marks: Sequence[Tensor], k: int, groups: int, min_spearman: float, min_pairwise_accuracy: float,
                    gate_spearman: float, gate_pairwise_accuracy: float, tie_margin: float, trials: int,
                    seed: int) -> dict[str, float]:
    """:func:`size_and_power` after its argument checks, on the calling thread."""
    blocks = orderable(marks, k, tie_margin)
    if blocks.shape[0] == 0:
        raise ValueError(f"none of the {len(marks)} teacher mark vectors of {k} candidates has an order at "
                         f"tie_margin={tie_margin}: no audit verdict can be taken")
    pool = _Groups(blocks)
    gen = torch.Generator().manual_seed(seed)
    bank = torch.randint(blocks.shape[0], (BANK,), generator=gen)
    random_student = pool.per_group(bank, torch.rand(BANK, k, generator=gen, dtype=torch.float64))
    noise = torch.randn(BANK, k, generator=gen, dtype=torch.float64)
    c = CALIBRATION_GROUPS
    sigma = bar_noise(pool, bank[:c], noise[:c], gate_spearman, gate_pairwise_accuracy)
    bar_student = pool.per_group(bank, noise if math.isinf(sigma) else pool.z[bank] + sigma * noise)
    draws = torch.randint(BANK, (trials, groups), generator=gen)

    def verdicts(stats: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        rho, agree, pairs = (s[draws] for s in stats)  # [trials, groups]
        return rho.mean(dim=1), agree.sum(dim=1) / pairs.sum(dim=1)

    rho, pairwise = verdicts(random_student)
    size = float(((rho >= min_spearman) & (pairwise >= min_pairwise_accuracy)).double().mean())
    rho, pairwise = verdicts(bar_student)
    power = float(((rho < min_spearman) | (pairwise < min_pairwise_accuracy)).double().mean())
    return {"size": size, "power": power, "sigma": sigma, "bar_spearman": float(bar_student[0].mean()),
            "bar_pairwise_accuracy": float(bar_student[1].sum() / bar_student[2].sum()),
            "orderable": blocks.shape[0] / max(len(marks), 1), "marks": float(len(marks))}
