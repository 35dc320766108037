"""What the student is measured against beside its gate: the agreement with the teacher, on the same test groups, of
scores that never saw a teacher mark.

================  =================================================================================================
baseline          scores of a test group's ``K`` candidates (presented order)
================  =================================================================================================
``init``          the student before stage B: :func:`~flowforge.reward_model.students.create_student` of the same
                  ``student`` section (its ``init`` weights, or its seeded random start)
``constant``      one mark for every candidate (:func:`constant_mark` of the training split: its median teacher
                  mark, the constant with the least mean absolute error there; recorded as ``mark``): a ranking of
                  all ties (Spearman 0, pairwise accuracy 0.5) whose ``mae`` is what ``student.gate.max_mae`` must
                  beat to mean anything (``student.gate.mae_below_constant`` gates on it)
``<scorer>``      each name in ``student.gate.baselines``: a flowforge reward scorer (a registry name such as
                  ``action_idm``, or ``pkg.module:Factory``) -- the reward a user has without a teacher -- on the
                  candidates' judged frames (decoded from the group's stored JPEGs, a video ``[K, 3, F, H, W]`` for
                  a ``takes_video`` scorer, else each frame scored and the frames averaged), the group's prompt
                  and its condition's prompt-row metadata (empty when none is given)
================  =================================================================================================

Beside them, for reference and never gated on (:func:`judges_on_test`): the run's independent evaluation judges
(``eval.scorers``, the free ones), scored the same way. They measure what the teacher is meant to measure by other
means, so they may agree with it; they never train. A judge where lower is better (a stroke width) agrees with a
negative Spearman.

With ``student.gate.min_spearman_above_baselines`` the gate also asks the student's test Spearman to reach every
baseline's plus that margin (:func:`baseline_reasons`).

Each entry is :func:`flowforge.reward_model.evaluate.agreement` (``spearman``, ``pairwise_accuracy``, ``mae``,
``groups``, ...) with the gate's ``tie_margin``; the gate record keeps them under ``baselines``, where the student's
own ``test`` agreement is to be read against them. A scorer's scores are compared by rank only (its ``mae`` is on
its own scale).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from flowforge.reward_model.data import JudgedGroup, decode_frame, group_frames
from flowforge.reward_model.evaluate import agreement


def _teacher(groups: Sequence[JudgedGroup]) -> list[Tensor]:
    return [torch.tensor(g.scores, dtype=torch.float64) for g in groups]


def scorer_predictions(scorer: Any, groups: Sequence[JudgedGroup],
                       metadata: Mapping[str, Mapping[str, Any]] | None = None) -> list[Tensor]:
    """``[K]`` float64 scores of ``scorer`` per group (module table, ``<scorer>``); NaN where it gave none.
    ``metadata``: prompt-row metadata by condition id (a group's candidates each get a copy of its condition's)."""
    from flowforge.rewards.base import takes_video

    out = []
    with torch.no_grad():
        for group in groups:
            _, candidates = group_frames(group)
            frames = [torch.stack([decode_frame(f) for f in frames]) for frames in candidates]  # [F, 3, H, W] each
            k, meta = len(frames), dict((metadata or {}).get(group.condition_id) or {})
            if takes_video(scorer):
                video = torch.stack([f.transpose(0, 1) for f in frames])  # [K, 3, F, H, W]
                scores = scorer(video, [group.prompt] * k, [dict(meta) for _ in range(k)])
            else:
                flat = torch.cat(frames)
                per_frame = scorer(flat, [group.prompt] * len(flat), [dict(meta) for _ in range(len(flat))])
                scores = torch.stack([s.mean() for s in torch.split(per_frame, [len(f) for f in frames])])
            out.append(scores.detach().double().cpu().view(-1))
    return out


def constant_mark(groups: Sequence[JudgedGroup]) -> float:
    """The median of every teacher mark in ``groups`` (a training split): the constant prediction with the least mean
    absolute error on them; 0.5 without marks."""
    marks = [m for g in groups for m in g.scores]
    return float(torch.tensor(marks, dtype=torch.float64).median()) if marks else 0.5


def baselines_on_test(cfg: Any, groups: Sequence[JudgedGroup], *, constant: float,
                      metadata: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, float]]:
    """``{"init": ..., "constant": ..., <scorer>: ...}``: the module table's agreements on ``groups`` for the
    :class:`~flowforge.reward_model.config.StudentConfig` ``cfg`` (``{}`` without groups); ``constant`` is the
    constant predictor's mark (:func:`constant_mark` of the training split); ``metadata`` as
    :func:`scorer_predictions`.

    Raises:
        ValueError: a name in ``cfg.gate.baselines`` that is no scorer (the registry lists the allowed ones).
    """
    if not groups:
        return {}
    from flowforge.reward_model.students import create_student
    from flowforge.rewards.registry import build_scorer

    margin, teacher = cfg.gate.tie_margin, _teacher(groups)
    init = create_student(cfg)
    init.eval()
    out = {"init": agreement(init.predict(groups), teacher, margin),
           "constant": {**agreement([torch.full((len(g.scores),), constant, dtype=torch.float64) for g in groups],
                                    teacher, margin), "mark": constant}}
    for name in cfg.gate.baselines:
        out[name] = agreement(scorer_predictions(build_scorer(name), groups, metadata), teacher, margin)
    return out


def judges_on_test(names: Sequence[str], groups: Sequence[JudgedGroup], *, tie_margin: float,
                   metadata: Mapping[str, Mapping[str, Any]] | None = None,
                   options: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """``{name: agreement}`` with the teacher on ``groups`` of each independent evaluation judge in ``names``
    (``eval.scorers``, built with its ``options``), for reference beside the gate (module docstring). A scorer that
    is paid once built (``paid``, which a judge's options decide: the teacher itself, billed per request) is left out
    unasked; a judge that cannot be built or cannot score these groups (its metadata missing, ...) is recorded as
    ``{"error": "<why>"}`` rather than stopping the gate it only annotates. ``{}`` without groups."""
    from flowforge.rewards.base import is_paid
    from flowforge.rewards.registry import build_scorer

    out: dict[str, dict[str, Any]] = {}
    for name in names if groups else ():
        try:
            scorer = build_scorer(name, **dict((options or {}).get(name) or {}))
            if is_paid(scorer):
                continue
            out[name] = agreement(scorer_predictions(scorer, groups, metadata), _teacher(groups), tie_margin)
        except Exception as exc:  # noqa: BLE001 -- a reference number, not a verdict: say why it is missing
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            logging.getLogger("flowforge").warning("eval judge %s beside the gate: %s", name, out[name]["error"])
    return out


def baseline_reasons(test: dict[str, float], baselines: dict[str, dict[str, float]], margin: float | None) -> list[str]:
    """Why the student (``test``: its :func:`~flowforge.reward_model.evaluate.agreement` on the test groups) fails
    ``student.gate.min_spearman_above_baselines`` = ``margin`` against ``baselines`` (:func:`baselines_on_test`): one
    reason per baseline whose Spearman plus ``margin`` the student's does not reach (``>=`` passes); ``[]`` when it
    reaches them all or ``margin`` is None. A baseline that ordered no group (Spearman NaN) counts as 0; a student
    whose Spearman is NaN reaches none."""
    if margin is None:
        return []
    mine, reasons = float(test.get("spearman", float("nan"))), []
    for name, found in baselines.items():
        theirs = float(found.get("spearman", float("nan")))
        bar = margin + (0.0 if theirs != theirs else theirs)  # NaN: no order to beat
        if not mine >= bar:
            reasons.append(f"spearman={mine:.4g} is not {margin:g} above the {name} baseline's {theirs:.4g} "
                           "(student.gate.min_spearman_above_baselines)")
    return reasons
