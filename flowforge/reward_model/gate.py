"""The student's quality gate, judged on the test split only, with the permutation null beside it.

The gate passes when, on the test groups (clusters never trained on, epochs chosen on the separate validation
split by :func:`flowforge.reward_model.train.train_student`):

1. the agreement thresholds hold (:func:`flowforge.reward_model.evaluate.gate`: Spearman, pairwise accuracy, MAE,
   failure rate, ``min_groups``), and
2. those thresholds are ones a random student fails: the probability that a random ranking of each test group
   passes both the Spearman and the pairwise threshold (:func:`flowforge.reward_model.null.null_summary`, on the
   test groups' own teacher scores, ties included) is below ``max_null_pass`` -- too few test groups, or
   thresholds too low, fail the gate whatever the student scores (``max_null_pass: 1`` turns this off: for
   tests of the pipeline's mechanics), and
3. with ``mae_below_constant``, the student's MAE is below that of a constant predictor (``constant``: the
   training split's median mark, :func:`flowforge.reward_model.baselines.constant_mark`, on every candidate of the
   test groups it scored), and
4. the student beats its shortcut baselines (:func:`flowforge.reward_model.probes.shortcut_probes`: blank media,
   re-ordered candidates; the reference removed is reported; ``fail_on_shortcuts: false`` reports them only).

The record also holds the student's permutation p-values (``null.spearman_p``, ``null.pairwise_p``) and the probes.
The pipeline's stage B adds one more condition to this verdict, with ``student.gate.min_spearman_above_baselines``:
the student's Spearman against its baselines' (:func:`flowforge.reward_model.baselines.baseline_reasons`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from flowforge.reward_model.config import GateThresholds
from flowforge.reward_model.evaluate import agreement, gate
from flowforge.reward_model.null import null_summary
from flowforge.reward_model.probes import shortcut_probes


def gate_on_test(student: Any, test_groups: Sequence[Any], thresholds: GateThresholds, *,
                 seed: int = 0, constant: float | None = None) -> dict[str, Any]:
    """``{"test": agreement, "null": null summary, "probes": shortcut probes, "passed": bool, "reasons": [...]}`` for
    ``student`` on ``test_groups`` (module docstring); with ``constant`` (a mark on [0, 1]) and at least one group the
    student scored, also ``"constant_mae"``: that constant's mean ``|constant - teacher|`` over the candidates of
    the groups the student scored (the ones its own ``mae`` averages; a group it failed counts in neither).

    Raises:
        ValueError: ``thresholds.mae_below_constant`` without a ``constant``.
    """
    if thresholds.mae_below_constant and constant is None:
        raise ValueError("student.gate.mae_below_constant needs the constant predictor's mark (the training split's "
                         "median, flowforge.reward_model.baselines.constant_mark)")
    teacher = [torch.tensor(g.scores, dtype=torch.float64) for g in test_groups]
    predictions = student.predict(test_groups) if test_groups else []  # once: the metrics and the constant's groups
    metrics = agreement(predictions, teacher, thresholds.tie_margin)
    passed, reasons = gate(metrics, thresholds)
    scored = [t for p, t in zip(predictions, teacher) if not torch.as_tensor(p).isnan().any()]
    constant_mae = float(torch.cat(scored).sub(constant).abs().mean()) if constant is not None and scored else None
    if thresholds.mae_below_constant and not (constant_mae is not None and metrics["mae"] < constant_mae):
        reasons.append(f"mae={metrics['mae']:.4g} is not below the constant predictor's mae="
                       f"{constant_mae if constant_mae is not None else float('nan'):.4g} (the training split's "
                       f"median mark {constant:.4g} on every candidate; student.gate.mae_below_constant)")
    null: dict[str, float] = {}
    if teacher:
        null = null_summary(teacher, thresholds.min_spearman, thresholds.min_pairwise_accuracy, metrics,
                            trials=thresholds.null_trials, seed=seed, tie_margin=thresholds.tie_margin)
        if thresholds.max_null_pass < 1 and not null["pass_probability"] < thresholds.max_null_pass:
            reasons.append(f"a random student passes min_spearman={thresholds.min_spearman:g} and "
                           f"min_pairwise_accuracy={thresholds.min_pairwise_accuracy:g} on these "
                           f"{len(teacher)} test groups with probability {null['pass_probability']:.3g} >= "
                           f"max_null_pass={thresholds.max_null_pass:g} (too few test groups or thresholds too low)")
    probes: dict[str, Any] = {}
    if test_groups:
        probes, shortcut_reasons = shortcut_probes(student, test_groups, thresholds)
        if thresholds.fail_on_shortcuts:
            reasons += shortcut_reasons
        else:  # reported, not failing (student.gate.fail_on_shortcuts: false)
            probes["ignored_reasons"] = shortcut_reasons
    out = {"test": metrics, "null": null, "probes": probes, "passed": not reasons, "reasons": reasons}
    return out if constant_mae is None else {**out, "constant_mae": constant_mae}
