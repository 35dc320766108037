"""The teacher's retest noise: how often the demo teacher orders a pair of candidates the same way when it is asked
again, as a function of how far apart its two marks were -- where a tie margin (``audit.tie_margin``,
``student.gate.tie_margin``; :func:`flowforge.reward_model.evaluate.tie_blocks`) should sit.

The retest re-scores stage A's stored media (the JPEG frames as the judge received them, read from its request
ledger) with the teacher scorer built again at other ``seed`` values -- for
:class:`~flowforge.orchestrate.demo.LegibilityScorer`, other draws of its distortions -- and compares each
within-group pair's order with the recorded marks. The teacher as configured (``teacher.scorer_options``, its
seed 0 by default) must reproduce the ledger's marks exactly (checked).
A paid judge's retest is a second request of the same groups, billed; this module makes none.

    python -m flowforge.orchestrate.retest examples/stages/digits.yaml [overrides] [--seeds 1,2]

prints, per bin of recorded ``|t_i - t_j|``, the pairs in it and the fraction ordered the same way on the retest.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

BIN_EDGES = (0.0, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 1.01)


def retest_pairs(groups: Sequence[Any], scorers: Sequence[Any]) -> tuple[Tensor, Tensor]:
    """``(|t_i - t_j| [P], same order [P])`` float64 over every within-group pair ``i < j`` of ``groups``
    (:class:`~flowforge.reward_model.data.JudgedGroup`, first frame of each candidate) and every retest scorer
    (``P = pairs x len(scorers)``, group by group, each group's pairs once per scorer): the recorded marks' distance
    and whether the retest orders the pair alike (a
    retest tie counts as not alike)."""
    from flowforge.reward_model.data import decode_frame, group_frames

    dist, same = [], []
    for group in groups:
        _, candidates = group_frames(group)
        media = torch.stack([decode_frame(frames[0]) for frames in candidates])
        recorded = torch.tensor(group.scores, dtype=torch.float64)
        upper = torch.triu(torch.ones(len(recorded), len(recorded), dtype=torch.bool), diagonal=1)
        d = (recorded[:, None] - recorded[None, :])[upper]
        for scorer in scorers:
            again = scorer(media, [group.prompt] * len(media), [{}] * len(media)).double()
            dist.append(d.abs())
            same.append((torch.sign(d) == torch.sign((again[:, None] - again[None, :])[upper])).double())
    empty = torch.zeros(0, dtype=torch.float64)
    return (torch.cat(dist) if dist else empty), (torch.cat(same) if same else empty)


def reproduces(groups: Sequence[Any], scorer: Any) -> bool:
    """Whether ``scorer`` gives every recorded mark of ``groups`` exactly (the recorded teacher, rebuilt)."""
    from flowforge.reward_model.data import decode_frame, group_frames

    for group in groups:
        _, candidates = group_frames(group)
        media = torch.stack([decode_frame(frames[0]) for frames in candidates])
        marks = scorer(media, [group.prompt] * len(media), [{}] * len(media)).double()
        if not torch.equal(marks, torch.tensor(group.scores, dtype=torch.float32).double()):
            return False
    return True


def retest_table(dist: Tensor, same: Tensor, edges: Sequence[float] = BIN_EDGES) -> list[dict[str, float]]:
    """Per bin ``[low, high)`` of ``dist``: ``{"low", "high", "pairs", "same_order"}`` (NaN for an empty bin)."""
    rows = []
    for low, high in zip(edges[:-1], edges[1:]):
        sel = (dist >= low) & (dist < high)
        rows.append({"low": low, "high": high, "pairs": float(sel.sum()),
                     "same_order": float(same[sel].mean()) if sel.any() else float("nan")})
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    from flowforge.orchestrate.config import load_pipeline
    from flowforge.orchestrate.stages import open_ledger, stage_a_groups
    from flowforge.rewards.registry import build_scorer

    p = argparse.ArgumentParser(prog="python -m flowforge.orchestrate.retest", description=__doc__.split("\n")[0])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--seeds", default="1,2", help="teacher seeds of the retest (other than the one that made the "
                   "recorded marks: teacher.scorer_options' seed, default 0)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    pcfg = load_pipeline(args.config, args.overrides)
    try:
        groups = stage_a_groups(pcfg, open_ledger(pcfg, writer=False))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if not groups:
        raise SystemExit("no usable judged stage-A group (frames missing, or no answer for a judged condition): "
                         "no retest")
    options = dict(pcfg.teacher.scorer_options)
    if not reproduces(groups[:8], build_scorer(pcfg.teacher.scorer, **options)):
        raise SystemExit(f"{pcfg.teacher.scorer} rebuilt with teacher.scorer_options does not give the recorded marks: "
                         "no retest")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    dist, same = retest_pairs(groups, [build_scorer(pcfg.teacher.scorer, **{**options, "seed": s}) for s in seeds])
    print(f"{len(groups)} judged groups of stage A, {len(dist)} pairs x retests (seeds {seeds})")
    print("recorded |t_i - t_j|   pairs   ordered alike on the retest")
    for row in retest_table(dist, same):
        print(f"[{row['low']:.4f}, {row['high']:.4f})  {int(row['pairs']):6d}   {row['same_order']:.3f}")


if __name__ == "__main__":
    main()
