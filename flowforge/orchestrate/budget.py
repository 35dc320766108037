"""The pipeline's teacher budget: what its teacher ledgers billed, and what one spender may still bill.

``teacher.max_requests`` caps the billed teacher requests of the whole pipeline directory: stage A, stage C's audits
and the teacher arm (:mod:`flowforge.orchestrate.arms`) together. Each spender's request ledger gets ``max_billed`` =
the cap less what the others billed (:func:`teacher_cap`), so a rerun continues under the same total.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flowforge.orchestrate.directory import PipelineLayout
from flowforge.rewards.judge.ledger import BudgetExhausted


def billed_at(path: Path) -> int:
    """Billed attempts in the judge request ledger at ``path`` (0 when there is none)."""
    from flowforge.rewards.judge.ledger import RequestLedger

    if not path.is_file():
        return 0
    book = RequestLedger(path)
    try:
        return book.billed()
    finally:
        book.close()


def teacher_spent(pcfg: Any) -> int:
    """Billed teacher requests of the whole pipeline directory: stage A, stage C's audits and the teacher arm
    (:mod:`flowforge.orchestrate.arms`); ``teacher.max_requests`` caps this sum."""
    layout = PipelineLayout.of(pcfg)
    return sum(billed_at(p) for p in (layout.a_judge_ledger, layout.audit_judge_ledger,
                                      layout.arm_judge_ledger("teacher")))


def teacher_cap(pcfg: Any, own: Path, what: str) -> int:
    """``max_billed`` for the teacher's request ledger at ``own``: ``teacher.max_requests`` less what the pipeline's
    other teacher ledgers billed (0: no limit, when ``teacher.max_requests`` is 0). A ledger's cap counts its own
    billed attempts, so a rerun continues under the same total.

    Raises:
        BudgetExhausted: the others spent the whole budget (``what`` names the spender that cannot be paid).
    """
    budget = pcfg.teacher.max_requests
    if not budget:
        return 0
    elsewhere = teacher_spent(pcfg) - billed_at(own)
    if budget - elsewhere <= 0:  # 0 would mean "no limit" to the ledger: never pass it
        raise BudgetExhausted(f"teacher.max_requests={budget} was spent ({elsewhere} billed elsewhere in the "
                              f"pipeline); {what} cannot be paid: rerun with a larger teacher.max_requests")
    return budget - elsewhere
