"""Shortcut probes of a student at its gate: does it need the media, the order, the reference?

Each probe re-presents the test groups with one piece of information taken away and scores the student's agreement
with the teacher again (:func:`flowforge.reward_model.evaluate.agreement`):

================  ===================================================================================================
probe             what changes / when the gate fails
================  ===================================================================================================
``prompt_only``   every candidate frame replaced by a black frame of the same size (prompt, reference, condition
                  frame, examples and layout kept). Fails the gate when the student does not beat it: the mean over
                  test groups of ``spearman(student) - spearman(probe)`` is not above ``2.33`` standard errors of that
                  paired difference (one-sided, p < 0.01), i.e. the student ranks as well without seeing the
                  candidates.
``position``      the candidates presented in another order (rotated by one place; labels stay in place), scores
                  mapped back to the candidates; ``order_consistency`` = mean Spearman between the student's scores
                  of the same candidates in both orders. Fails the gate when the student passes the Spearman and
                  pairwise thresholds in the presented order but not re-ordered (a student that scores positions
                  drops to chance); one below them in both orders is failed by the gate's agreement alone.
``no_reference``  the reference removed (groups that have one; NaN otherwise); for a student that cannot score
                  without one (``needs_reference``, e.g. ``scalar_head`` with ``reference: true``) replaced by a black
                  image of its size instead. Reported, never failing: a student may rank well without the
                  reference.
================  ===================================================================================================

A student that scores each candidate alone (``scores_candidates_alone = True``: its score of a candidate depends on
that candidate's media, the prompt and the side media only, e.g. ``scalar_head``) cannot fail ``prompt_only`` or
``position`` in any way its agreement check would not already fail it: blank media tie every candidate (Spearman 0,
so the probe restates "Spearman significantly above 0") and re-ordering cannot change a score. For such a student
both are recorded as ``{"vacuous": why}`` and not run; they are evidence only for students that see the group.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from flowforge.reward_model.data import JudgedGroup, decode_frame, read_frame
from flowforge.reward_model.evaluate import agreement, spearman, tie_blocks
from flowforge.rewards.judge import protocol as P

Z_99 = 2.326
"""One-sided 99 % normal quantile for the paired prompt-only test."""
VACUOUS = ("not run: the student scores each candidate alone, so blank media tie every candidate (Spearman 0) and "
           "the presented order cannot change a score; the agreement check already decides what this probe would")


def _black_like(frame_path: str, directory: Path) -> tuple[str, str]:
    """``(path, sha256)`` of a black JPEG of the size of the frame at ``frame_path``, written into ``directory``."""
    frame = decode_frame(read_frame(frame_path))
    data = P.jpeg_bytes(torch.zeros_like(frame), max(frame.shape[-2:]))
    digest = P.sha256_hex(data)
    (directory / f"{digest}.jpg").write_bytes(data)
    return str(directory / f"{digest}.jpg"), digest


def _blank(group: JudgedGroup, directory: Path) -> JudgedGroup:
    path, digest = _black_like(group.candidates[0][0], directory)
    frames = tuple(tuple(path for _ in c) for c in group.candidates)
    hashes = tuple(tuple(digest for _ in c) for c in group.candidates)
    return dataclasses.replace(group, key=group.key + ":blank", candidates=frames, hashes=hashes)


def _rotated(group: JudgedGroup) -> tuple[JudgedGroup, list[int]]:
    """The group with candidate ``j`` shown at position ``(j + 1) % K``; ``order[new position] = old position``."""
    k = len(group.labels)
    order = [(p - 1) % k for p in range(k)]

    def take(values):
        return tuple(values[i] for i in order) if values else values

    return dataclasses.replace(group, key=group.key + ":rotated", candidates=take(group.candidates),
                               scores=take(group.scores), permutation=take(group.permutation),
                               hashes=take(group.hashes)), order


def _per_group_spearman(predictions: Sequence[torch.Tensor], groups: Sequence[JudgedGroup],
                        tie_margin: float) -> torch.Tensor:
    values = [spearman(p.double(), tie_blocks(torch.tensor(g.scores, dtype=torch.float64), tie_margin))
              if not torch.isnan(p).any() else math.nan for p, g in zip(predictions, groups, strict=True)]
    return torch.tensor(values, dtype=torch.float64)


def shortcut_probes(student: Any, groups: Sequence[JudgedGroup], thresholds: Any) -> tuple[dict[str, Any], list[str]]:
    """``(probe records, reasons the gate fails)`` for ``student`` on the test ``groups`` (module table)."""
    if getattr(student, "scores_candidates_alone", False):
        vacuous = {"vacuous": VACUOUS}
        return {"prompt_only": vacuous, "position": dict(vacuous), "no_reference": _no_reference(student, groups,
                                                                                                 thresholds)}, []
    teacher = [torch.tensor(g.scores, dtype=torch.float64) for g in groups]
    base = student.predict(groups)
    base_rho = _per_group_spearman(base, groups, thresholds.tie_margin)
    reasons: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        blank_groups = [_blank(g, Path(tmp)) for g in groups]
        blank = student.predict(blank_groups)
    prompt_only = agreement(blank, teacher, thresholds.tie_margin)
    diff = base_rho - _per_group_spearman(blank, groups, thresholds.tie_margin)
    diff = diff[~torch.isnan(diff)]
    mean = float(diff.mean()) if diff.numel() else math.nan
    se = float(diff.std() / math.sqrt(diff.numel())) if diff.numel() > 1 else math.nan
    prompt_only.update(spearman_gain=mean, spearman_gain_se=se)
    if not (mean > Z_99 * se or (se == 0 and mean > 0)):
        reasons.append(f"the student does not beat its prompt-only baseline (blank media): Spearman gain "
                       f"{mean:.3g} +- {se:.3g} over {diff.numel()} test groups is not above {Z_99} standard errors")
    rotated, orders = zip(*(_rotated(g) for g in groups)) if groups else ((), ())
    moved = student.predict(list(rotated))
    back = []
    for scores, order in zip(moved, orders, strict=True):
        out = torch.empty_like(scores)
        out[torch.tensor(order)] = scores
        back.append(out)
    position = agreement(back, teacher, thresholds.tie_margin)
    consistency = [spearman(b.double(), o.double()) for b, o in zip(back, base, strict=True)
                   if not (torch.isnan(b).any() or torch.isnan(o).any())]
    position["order_consistency"] = sum(consistency) / len(consistency) if consistency else math.nan
    rho, pairs = position["spearman"], position["pairwise_accuracy"]

    def passes(a: dict) -> bool:
        return a["spearman"] >= thresholds.min_spearman and a["pairwise_accuracy"] >= thresholds.min_pairwise_accuracy

    # a shortcut only when the order is what made it pass: a student below the thresholds in the presented order
    # is failed by the gate's own agreement check, and re-ordering it proves nothing more
    if passes(agreement(base, teacher, thresholds.tie_margin)) and not passes(position):
        reasons.append(f"with the candidates re-ordered the student's agreement falls to Spearman {rho:.3g} / pairwise "
                       f"{pairs:.3g} (position shortcut; thresholds {thresholds.min_spearman:g} / "
                       f"{thresholds.min_pairwise_accuracy:g})")
    return {"prompt_only": prompt_only, "position": position,
            "no_reference": _no_reference(student, groups, thresholds)}, reasons


def _no_reference(student: Any, groups: Sequence[JudgedGroup], thresholds: Any) -> dict[str, float]:
    """The ``no_reference`` probe (module table)."""
    with_reference = [i for i, g in enumerate(groups) if g.reference is not None]
    if not with_reference:
        return {"groups": 0.0}
    with tempfile.TemporaryDirectory() as tmp:
        if getattr(student, "needs_reference", False):
            stripped = [_black_reference(groups[i], Path(tmp)) for i in with_reference]
        else:
            stripped = [dataclasses.replace(groups[i], key=groups[i].key + ":noref", reference=None,
                                            reference_hashes=()) for i in with_reference]
        predictions = student.predict(stripped)
    return agreement(predictions, [torch.tensor(groups[i].scores, dtype=torch.float64) for i in with_reference],
                     thresholds.tie_margin)


def _black_reference(group: JudgedGroup, directory: Path) -> JudgedGroup:
    """``group`` with each reference frame replaced by a black image of its size."""
    black = [_black_like(path, directory) for path in group.reference or ()]
    return dataclasses.replace(group, key=group.key + ":blackref", reference=tuple(p for p, _ in black),
                               reference_hashes=tuple(h for _, h in black))
