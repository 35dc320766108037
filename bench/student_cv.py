"""Choose student settings honestly: cross-validate them on a pipeline's stage-A groups, never on its test split.

A pipeline that has run stage A (a development seed, e.g. ``run.seed=0``) holds the teacher's judged groups. This
splits them as stage B does (``student.split`` over the pass's clusters, ``student.split_seed``), sets the **test**
split aside untouched, and deals the remaining clusters into ``--folds`` folds (sorted by ``sha256("cv:<cluster>")``,
fold ``i`` = every ``folds``-th; every group of a cluster in one fold). For each fold it trains the configured student
on the other folds for exactly ``student.epochs`` epochs (no validation split, so nothing is selected on the fold)
and scores the fold: mean within-group Spearman and pairwise accuracy against the teacher
(:func:`flowforge.reward_model.evaluate.evaluate`, ``student.gate.tie_margin``). It prints each fold and the mean with
its standard error over folds. Compare settings by rerunning with other ``student.*`` overrides (not
``student.split`` / ``student.split_seed``, which would move the test split: refused); then run the chosen settings
on fresh pipeline seeds, whose test split is the headline.

    python bench/student_cv.py examples/stages/digits_pen.yaml [overrides, e.g. student.lr=1e-3] [--folds 5]

Trains ``folds`` students in a temporary directory (removed afterwards); reads the pipeline, writes nothing in it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import statistics
import tempfile
from pathlib import Path


def folds_of(clusters: list[str], folds: int) -> dict[str, int]:
    """``cluster -> fold`` in ``[0, folds)``: clusters sorted by ``sha256("cv:<cluster>")``, dealt in turn."""
    ordered = sorted(set(clusters), key=lambda c: hashlib.sha256(f"cv:{c}".encode()).hexdigest())
    return {c: i % folds for i, c in enumerate(ordered)}


def cross_validate(cfg, pool: list, folds: int, work_dir: str | Path) -> list[dict[str, float]]:
    """Per fold ``k``: the student of ``cfg`` (a :class:`~flowforge.reward_model.config.StudentConfig`) trained on
    ``pool``'s groups outside fold ``k`` (:func:`folds_of` of their clusters) for ``cfg.epochs`` epochs, its
    agreement with the teacher on fold ``k``'s groups (:func:`flowforge.reward_model.evaluate.evaluate`, plus
    ``"held_out"``: the number of groups). Students are written under ``work_dir``.

    Raises:
        ValueError: ``folds`` < 2, or fewer distinct clusters than folds.
    """
    from flowforge.reward_model.evaluate import evaluate
    from flowforge.reward_model.students import load_student
    from flowforge.reward_model.train import train_student

    fold = folds_of([g.cluster for g in pool], max(folds, 1))
    if folds < 2 or len(fold) < folds:
        raise ValueError(f"--folds={folds} needs >= 2 folds and as many clusters ({len(fold)})")
    cfg = dataclasses.replace(cfg, split=(1.0, 0.0, 0.0))  # train on all it is given: nothing selected on a fold
    rows = []
    for k in range(folds):
        held = [g for g in pool if fold[g.cluster] == k]
        result = train_student(cfg, [g for g in pool if fold[g.cluster] != k], Path(work_dir) / f"fold{k}")
        rows.append({**evaluate(load_student(result.student_dir, device=cfg.device), held, cfg.gate.tie_margin),
                     "held_out": float(len(held))})
    return rows


def cv_pool(pcfg, ledger) -> tuple[list, int]:
    """``(groups to cross-validate on, number of test groups set aside)``: stage A's judged groups split as stage B
    splits them (``student.split`` / ``split_seed`` over the pass's clusters), the train and val splits only.

    Raises:
        ValueError: stage A has judged nothing yet.
    """
    from flowforge.orchestrate.stages import stage_a_groups
    from flowforge.reward_model.data import split_groups

    s = pcfg.student
    splits = split_groups(stage_a_groups(pcfg, ledger), s.split_seed, s.split,
                          sorted(set(ledger.clusters().values())))
    return splits["train"] + splits["val"], len(splits["test"])  # the test split is never read here


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--folds", type=int, default=5)
    args = parser.parse_args()
    import torch

    from flowforge.orchestrate.config import load_pipeline
    from flowforge.orchestrate.stages import open_ledger

    moved = [o for o in args.overrides if o.split("=")[0] in ("student.split", "student.split_seed")]
    if moved:
        raise SystemExit(f"{moved[0]}: the split is the pipeline's (its test split stays set aside); not an override")
    try:
        pcfg = load_pipeline(args.config, args.overrides)  # a bad config or override: one line (ConfigError)
        threads = pcfg.run.num_threads
        if threads != "auto" and threads > 0:
            torch.set_num_threads(threads)
        ledger = open_ledger(pcfg, writer=False)
        pool, test = cv_pool(pcfg, ledger)
        with tempfile.TemporaryDirectory(prefix="student-cv-") as tmp:
            rows = cross_validate(pcfg.student, pool, args.folds, tmp)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    s = pcfg.student
    for k, row in enumerate(rows):
        print(f"fold {k}: {int(row['held_out'])} groups held out, Spearman {row['spearman']:.3f}, pairwise "
              f"{row['pairwise_accuracy']:.3f}")
    print(f"{len(pool)} groups (the test split's {test} set aside), {args.folds} folds, "
          f"{s.epochs} epochs")
    for key in ("spearman", "pairwise_accuracy"):
        values = [r[key] for r in rows]
        print(f"{key}: {statistics.mean(values):.3f} +- {statistics.stdev(values) / len(values) ** 0.5:.3f} "
              "(mean +- SE over folds)")


if __name__ == "__main__":
    main()
