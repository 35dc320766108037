"""A run's reward scorers: built from the config (:func:`build_reward_processor`) and checked against the model and
the config once they are built (before any step)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flowforge.models.base import AudioDecoding
from flowforge.rewards.base import is_paid, takes_audio
from flowforge.rewards.processor import RewardProcessor
from flowforge.rewards.registry import build_scorer
from flowforge.runtime.errors import UserError


def build_reward_processor(cfg: Any, adapter: Any, run_dir: Any) -> RewardProcessor:
    """The training components (``reward.weights``) and the eval scorers (``eval.scorers``), each built once with
    its ``reward.options``, checked (:func:`check_audio_scorers`, :func:`check_paid_scorers`), in one processor.

    Raises:
        UserError: as the checks; what a scorer's constructor raises.
    """
    r = cfg.reward
    names = list(dict.fromkeys([*r.weights, *cfg.eval.scorers]))
    scorers = {n: build_scorer(n, run_dir=run_dir, **r.options.get(n, {})) for n in names}
    check_audio_scorers(scorers, adapter, r.overlap)
    check_paid_scorers(scorers, cfg.eval, r.weights)
    paid = sorted(n for n, s in scorers.items() if is_paid(s) and r.weights.get(n))
    if paid and cfg.distributed.context_parallel.degree > 1:  # every rank of the context group scores the same media
        raise UserError("distributed.context_parallel", f"every rank of a context group scores the same media, so "
                        f"the paid reward components {paid} would be billed once per rank",
                        "train them without context parallelism (ulysses=1, ring=1)")
    return RewardProcessor(scorers, r.weights, r.required, batch_size=r.batch_size)


def check_audio_scorers(scorers: dict, adapter, overlap: bool) -> None:
    """Refuse scorers that take audio (``takes_audio``) when the model makes none or ``reward.overlap`` is on.

    Raises:
        UserError: naming the scorers and ``model.adapter`` / ``reward.overlap``.
    """
    audio = sorted(n for n, s in scorers.items() if takes_audio(s))
    if audio and not isinstance(adapter, AudioDecoding):
        raise UserError("model.adapter", f"{type(adapter).__name__} produces no audio, but reward components "
                        f"{audio} score audio (takes_audio)", "use an audio-video family (ltx2) or drop them")
    if audio and overlap:
        raise UserError("reward.overlap", f"true, but reward components {audio} score audio, which the overlapped "
                        "score stream does not carry", "set reward.overlap=false")


def check_paid_scorers(scorers: Mapping[str, Any], eval_cfg: Any, weights: Mapping[str, float]) -> None:
    """Refuse paid scorers (``paid = True``) named only in ``eval.scorers`` while ``eval.teacher_groups`` is 0:
    evaluation asks a paid scorer only for that many held-out groups, so it would never be used there.

    Raises:
        UserError: naming ``eval.scorers``, the scorers and ``eval.teacher_groups``.
    """
    idle = sorted(n for n in eval_cfg.scorers if n not in weights and is_paid(scorers[n]))
    if idle and not eval_cfg.teacher_groups:
        raise UserError("eval.scorers", f"{idle} are paid scorers (each request billed), which evaluation asks only "
                        "for the first eval.teacher_groups held-out groups, and eval.teacher_groups=0",
                        "set eval.teacher_groups=N or drop them")
