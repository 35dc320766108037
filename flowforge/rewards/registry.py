"""Name -> factory table of the built-in reward scorers (an explicit dict, no import-time magic).

``build_scorer("digit")``, ``build_scorer("jpeg_compressibility", quality=95)``. Options are passed to the factory
as keyword arguments; a wrong option raises the factory's own ``TypeError`` / ``ValueError``. A factory that declares
``options_class`` (a :class:`~flowforge.rewards.options.ScorerOptions` section, e.g. the ``vlm_judge``'s
:class:`~flowforge.rewards.judge.options.JudgeOptions`) gets its options built and checked as that section instead,
passed as its first argument; :func:`option_sections` lists those sections for the config reference.

A new scorer is one module under :mod:`flowforge.rewards.scorers` plus one line in :data:`SCORERS`. Factories are
only imported here, never called at import time: heavy dependencies (transformers, open_clip) load when a scorer is
built.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowforge.rewards.base import RewardScorer
from flowforge.rewards.byo import build_imported, check_import_spec, is_import_spec, load_factory
from flowforge.rewards.judge.client import VLMJudge
from flowforge.rewards.options import ScorerOptions
from flowforge.rewards.scorers.action_following import ActionFollowingScorer, InverseDynamicsReward
from flowforge.rewards.scorers.aesthetic import AestheticScorer
from flowforge.rewards.scorers.av_sync import AVOnsetSync
from flowforge.rewards.scorers.clap import ClapScore
from flowforge.rewards.scorers.clip_score import ClipScore
from flowforge.rewards.scorers.digit import DigitEvalScorer, DigitScorer
from flowforge.rewards.scorers.diversity import GroupDiversity
from flowforge.rewards.scorers.edit_score import EditScore
from flowforge.rewards.scorers.hps import HPSv2Scorer
from flowforge.rewards.scorers.hpsv3 import HPSv3Scorer
from flowforge.rewards.scorers.image_reward import ImageRewardScorer
from flowforge.rewards.scorers.jpeg import JpegCompressibility, JpegIncompressibility
from flowforge.rewards.scorers.latent_reference import LatentReference
from flowforge.rewards.scorers.ocr import OcrScorer
from flowforge.rewards.scorers.pickscore import PickScore
from flowforge.rewards.scorers.remote import RemoteScorer
from flowforge.rewards.scorers.unified_reward import UnifiedReward
from flowforge.rewards.scorers.vqa_score import VQAScore
from flowforge.rewards.scorers.video_align import VideoAlignScorer
from flowforge.rewards.scorers.world_eval import (BallPathScorer, InverseDynamicsLift, InverseDynamicsScorer, WorldPSNR,
                                                  WorldSSIM)
from flowforge.runtime.errors import UserError
from flowforge.runtime.option_types import option_type_problems

SCORERS: dict[str, Callable[..., RewardScorer]] = {
    "digit": DigitScorer,
    "digit_eval": DigitEvalScorer,
    "group_diversity": GroupDiversity,
    "jpeg_compressibility": JpegCompressibility,
    "jpeg_incompressibility": JpegIncompressibility,
    "latent_reference": LatentReference,
    "pickscore": PickScore,
    "clip_score": ClipScore,
    "aesthetic": AestheticScorer,
    "hps": HPSv2Scorer,
    "ocr": OcrScorer,
    "remote": RemoteScorer,
    "vlm_judge": VLMJudge,
    "action_following": ActionFollowingScorer,
    "action_idm": InverseDynamicsReward,
    "inverse_dynamics": InverseDynamicsScorer,
    "inverse_dynamics_lift": InverseDynamicsLift,
    "ball_track": BallPathScorer,
    "world_psnr": WorldPSNR,
    "world_ssim": WorldSSIM,
    "av_onset_sync": AVOnsetSync,
    "clap": ClapScore,
    "unified_reward": UnifiedReward,
    "vqa_score": VQAScore,
    "edit_score": EditScore,
    "image_reward": ImageRewardScorer,
    "hpsv3": HPSv3Scorer,
    "video_align": VideoAlignScorer,
}
"""Built-in scorer names and their factories."""


def options_class(name: str) -> type[ScorerOptions] | None:
    """The option section the built-in scorer ``name`` declares (``options_class``), or None (keyword options)."""
    declared = getattr(SCORERS.get(name), "options_class", None)
    return declared if isinstance(declared, type) and issubclass(declared, ScorerOptions) else None


def option_sections() -> list[tuple[str, type[ScorerOptions]]]:
    """``(section name, section class)`` of every built-in scorer that declares its options as a section
    (``("reward.options.vlm_judge", JudgeOptions)``), in registry order."""
    return [(cls.section_name, cls) for cls in map(options_class, SCORERS) if cls is not None]


def build_scorer(name: str, *, run_dir: str | Path | None = None, **options: Any) -> RewardScorer:
    """Build the scorer registered as ``name`` (or imported from ``name = "pkg.module:Factory"``,
    :mod:`flowforge.rewards.byo`) with keyword ``options``.

    ``run_dir`` (the run directory, for scorers that keep files there, e.g. ``vlm_judge``'s request ledger) is passed
    as the keyword ``run_dir`` to factories whose signature accepts it, and dropped for the others.

    Raises:
        ValueError: ``name`` is not registered (the message lists the allowed names); an import path that does not
            import or does not give a scorer.
        UserError: an option whose value does not fit its annotation in the factory's signature
            (:func:`flowforge.runtime.option_types.option_type_problems`), naming ``reward.options.<name>.<option>``.
        ConfigError: for a scorer with an option section, every problem of its options
            (:meth:`flowforge.rewards.options.ScorerOptions.from_options`).
    """
    if is_import_spec(name):
        if run_dir is not None and _accepts_run_dir(load_factory(name)):
            options = {**options, "run_dir": run_dir}
        return build_imported(name, options)
    if name not in SCORERS:
        raise ValueError(f"unknown reward scorer {name!r}; allowed names: {sorted(SCORERS)}")
    section = options_class(name)
    if section is not None:
        built = section.from_options(options)
        return SCORERS[name](built, **({"run_dir": run_dir} if run_dir is not None else {}))
    wrong = option_type_problems(_chosen(name, options), options, f"reward.options.{name}")
    if wrong:
        what, _, why = wrong[0].partition(": ")
        raise UserError(what, "; ".join([why, *wrong[1:]]))
    if run_dir is not None and _accepts_run_dir(_chosen(name, options)):
        options = {**options, "run_dir": run_dir}
    return SCORERS[name](**options)


def _chosen(name: str, options: dict[str, Any]) -> Callable[..., Any]:
    """The factory whose signature the options of built-in ``name`` are checked against: the registered one, or
    the one its ``choose(options)`` picks (``vqa_score``: local model or server).

    Raises:
        ValueError: ``choose`` refuses the options (e.g. conflicting ones).
    """
    factory = SCORERS[name]
    choose = getattr(factory, "choose", None)
    return choose(options) if callable(choose) else factory


def _accepts_run_dir(factory: Callable[..., Any]) -> bool:
    try:
        return "run_dir" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a callable without an inspectable signature
        return False


def check_scorer_spec(name: str, options: dict[str, Any]) -> list[str]:
    """Problems with the reward component ``name`` and its ``options`` without building a built-in scorer ([] when
    none): an unknown built-in name (the allowed names listed), options that do not fit its factory's signature
    (unknown ones named with the allowed; a factory with ``choose(options)`` is checked as the one it picks, and
    what ``choose`` refuses, e.g. conflicting options, is one problem), or
    an import path that does not import or does not give a scorer (:func:`flowforge.rewards.byo.check_import_spec`),
    and options whose values do not fit the annotations of that signature
    (:func:`flowforge.runtime.option_types.option_type_problems`: ``reward.options.<name>.<option>: expected float,
    got ...``); for a scorer with an option section, every problem of building that section (unknown options, types,
    values: :meth:`flowforge.rewards.options.ScorerOptions.option_problems`). Preflight lists these."""
    if is_import_spec(name):
        return check_import_spec(name, options)
    if name not in SCORERS:
        return [f"unknown component {name!r}; allowed: {sorted(SCORERS)} or an import path 'pkg.module:Factory'"]
    section = options_class(name)
    if section is not None:
        return section.option_problems(options)
    try:
        factory = _chosen(name, options)
    except ValueError as exc:
        return [f"reward.options.{name}: {exc}"]
    params = inspect.signature(factory).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        unknown = sorted(str(k) for k in options if k not in params)
        if unknown:
            allowed = [p for p in params if p != "run_dir"]
            return [f"reward.options.{name}: unknown option{'s' * (len(unknown) > 1)} {unknown}; allowed: {allowed}"]
    try:
        inspect.signature(factory).bind(**options)
    except TypeError as exc:
        return [f"reward.options.{name}: {exc}"]
    return option_type_problems(factory, options, f"reward.options.{name}")
