"""Cross-section preflight rules of the run-level features: the reward-hacking guard, the rollout chunking, the
forward-process DPM-Solver-2 rollouts, what ``flowforge export`` can write, scoring overlapped with the rollout and
bounded-staleness asynchronous training.

Called by :func:`flowforge.train.preflight.preflight` (which lists every problem at once); kept here so that each
feature's rules live beside it.

Rollout chunking
    A replay objective (one that re-scores stored SDE steps, ``uses_log_probs``) gets an importance ratio of exactly
    1 at its first update only when every replayed micro-batch has the shape of the rollout chunk that produced its
    rows: the transformer's kernels (matrix products above all) may round differently for another number of rows.
    That holds when the rollout chunk (``sampler.batch_size``, default ``train.micro_batch_size``) equals
    ``train.micro_batch_size`` and each update's rows per rank are a multiple of it. Otherwise the first ratio is off
    by float rounding (measured 1.2e-7 on CPU, ``train/first_update_ratio_dev``); preflight warns and names the
    mismatch. Training is still correct: the deviation is one unit in the last place, far inside any clip range.

DPM-Solver-2 rollouts (``forward.sampler: dpm2``)
    On the SD3 "static" schedule the last nonzero level is tiny (0.009 for 10 steps, shift 3), and the solver's
    2nd-order correction of the next-to-last step, weighted by the log-SNR gap ratio (4.6 there), amplifies the
    data-prediction error (flowforge's measurement in :mod:`flowforge.algorithms.solvers`: 1.15 against 0.14 on the
    "wan" kind); preflight warns. NVlabs' released SD3 path samples on exactly this static schedule (its
    ``pipeline_with_logprob`` with ``sigmas=None``), so the warning names the measured cost, not a deviation from
    the reference: keep "static" to match NVlabs, or use "wan" for the smaller error.

Scoring overlapped with the rollout (``reward.overlap``)
    The trainer rolls the step out group by group in its own process and sends each finished group to the group
    scorers (:mod:`flowforge.rewards.stream`). It needs ``rollout.engine: local`` (worker processes return the whole
    step at once) and one process (under ``torchrun`` a group may straddle ranks and is gathered by collectives
    after the rollout); both are errors. Without a ``needs_group`` component there is nothing to overlap: a warning.

Bounded staleness (``train.max_staleness > 0``, :mod:`flowforge.train.async_rollout`)
    The next steps roll out in the rollout workers while the trainer updates, so it needs ``rollout.engine:
    workers``; and an objective whose loss is an importance ratio against the recorded log-probs of the sampling
    policy (``accepts_staleness``: the GRPO family). Both are errors, one line each.
"""

from __future__ import annotations

from flowforge.train.guard import guard_problems


def chunking_warnings(cfg, world_size: int = 1) -> list[str]:
    """The rollout-chunking warning (module docstring) for a root config, or none."""
    from flowforge.objectives import OBJECTIVES

    objective = OBJECTIVES.get(cfg.train.algorithm)
    if objective is None or not objective.uses_log_probs:
        return []
    t, mb = cfg.train, cfg.train.micro_batch_size
    chunk = cfg.sampler.batch_size or mb
    per_update = cfg.data.prompts_per_step * cfg.data.group_size // max(world_size, 1) // t.num_updates_per_batch
    if chunk == mb and per_update % mb == 0:
        return []
    why = (f"sampler.batch_size={chunk} (the rollout chunk) differs from train.micro_batch_size={mb}" if chunk != mb
           else f"each update's {per_update} rows per rank are not a multiple of train.micro_batch_size={mb}")
    return [f"{why}: the first update replays rows in batches of another shape than the rollout's, so its importance "
            "ratio may differ from 1 by float rounding (train/first_update_ratio_dev ~1e-7) instead of being exactly "
            "1; set sampler.batch_size equal to train.micro_batch_size (or leave it unset) and make it divide "
            "data.prompts_per_step x data.group_size / (ranks x train.num_updates_per_batch) for an exact replay"]


def dpm2_warnings(cfg) -> list[str]:
    """The warning for DPM-Solver-2 forward-process rollouts on a schedule whose last nonzero level is tiny."""
    from flowforge.objectives import OBJECTIVES

    objective = OBJECTIVES.get(cfg.train.algorithm)
    sections = {s.section_name for s in getattr(objective, "sections", ())}
    if "forward" not in sections or cfg.forward.sampler != "dpm2" or cfg.sampler.schedule == "wan":
        return []
    return [f"forward.sampler='dpm2' with sampler.schedule={cfg.sampler.schedule!r}: the last nonzero sigma of this "
            "schedule is tiny and DPM-Solver-2's second-order step before it amplifies the model's error (NVlabs' SD3 "
            "path samples on this static schedule too); sampler.schedule='wan' gives the smaller error"]


def export_warnings(cfg) -> list[str]:
    """A ``module+lora`` run of a family whose export writes diffusers files: it trains, samples and resumes, but
    ``flowforge export`` refuses it (only the families with a format of their own export ``module+lora``)."""
    from flowforge.models import OWN_FORMAT_FAMILIES

    if cfg.lora.trainable != "module+lora" or cfg.model.adapter in OWN_FORMAT_FAMILIES:
        return []
    return [f"lora.trainable='module+lora' with model.adapter={cfg.model.adapter!r}: the run trains, samples and "
            f"resumes, but flowforge export cannot write it yet (only {list(OWN_FORMAT_FAMILIES)}); use "
            "lora.trainable='lora' or 'module' for a run to export"]


def run_rules(cfg, problems: list[str], warnings: list[str], *, world_size: int = 1) -> None:
    """Append the guard's problems and warnings (:func:`flowforge.train.guard.guard_problems`), the rollout
    chunking warning (:func:`chunking_warnings`), the DPM-Solver-2 schedule warning (:func:`dpm2_warnings`) and the
    export warning (:func:`export_warnings`) of ``cfg`` to ``problems`` / ``warnings``."""
    guard_p, guard_w = guard_problems(cfg)
    problems += guard_p
    warnings += guard_w + chunking_warnings(cfg, world_size) + dpm2_warnings(cfg) + export_warnings(cfg)
    overlap_p, overlap_w = overlap_rules(cfg, world_size)
    problems += overlap_p + staleness_problems(cfg)
    warnings += overlap_w


def overlap_rules(cfg, world_size: int = 1) -> tuple[list[str], list[str]]:
    """``(problems, warnings)`` of ``reward.overlap`` (module docstring)."""
    if not cfg.reward.overlap:
        return [], []
    from flowforge.rewards.byo import is_import_spec
    from flowforge.rewards.registry import SCORERS

    problems = []
    if world_size > 1:
        problems.append(f"reward.overlap needs one process; under torchrun ({world_size} ranks) groups that straddle "
                        "ranks are gathered after the rollout: set reward.overlap false")
    if cfg.rollout.engine != "local":
        problems.append(f"reward.overlap needs rollout.engine='local' (got {cfg.rollout.engine!r}): worker processes "
                        "return the step's rollout at once, so there is nothing to overlap")
    grouped = [n for n in cfg.reward.weights if is_import_spec(n) or getattr(SCORERS.get(n), "needs_group", False)]
    warnings = [] if grouped else ["reward.overlap is on but no reward component needs whole groups (e.g. vlm_judge): "
                                   "per-sample components are scored after the rollout, so nothing overlaps"]
    return problems, warnings


def staleness_problems(cfg) -> list[str]:
    """The problems of ``train.max_staleness`` (module docstring)."""
    s = cfg.train.max_staleness
    if not s:
        return []
    from flowforge.objectives import OBJECTIVES

    problems = []
    allowed = sorted(name for name, cls in OBJECTIVES.items() if cls.accepts_staleness)
    objective = OBJECTIVES.get(cfg.train.algorithm)
    if objective is not None and not objective.accepts_staleness:
        problems.append(f"train.max_staleness={s} needs an algorithm whose loss clips the importance ratio against "
                        f"the sampling policy's log-probs; train.algorithm={cfg.train.algorithm!r} does not: "
                        f"allowed {allowed}, or train.max_staleness=0")
    if cfg.rollout.engine != "workers":
        problems.append(f"train.max_staleness={s} rolls the next steps out in rollout workers while the trainer "
                        f"updates: needs rollout.engine='workers' (got {cfg.rollout.engine!r}), or "
                        "train.max_staleness=0")
    return problems
