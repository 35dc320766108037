"""Validate a whole config before any model loads: every violation collected, one error raised.

:func:`preflight` returns the warnings (things that run but are probably not what the user wants) and raises
:class:`PreflightError` listing *every* error at once, so a user fixes a config in one round trip.

Each config section has already checked its own values when it was built (:mod:`flowforge.settings`); preflight
checks what no single section can: names owned by other modules (algorithm, kernel, schedule, advantage modes, dtype,
task, adapter, scorers, strategy), trained steps against the schedule and kernel, batch divisibility across ranks,
prompt files against the task, and each algorithm's own rules across sections
(:meth:`flowforge.objectives.Objective.preflight_problems`, reached through ``flowforge.objectives.OBJECTIVES``:
algorithm properties are never listed a second time here).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from flowforge.algorithms import schedules
from flowforge.algorithms.advantages import COMBINE_MODES, STD_MODES
from flowforge.algorithms.sde import TRANSITION_KINDS, transition
from flowforge.config import Config, ConfigError
from flowforge.data.prompts import IMAGE_TASKS, TASKS, check_task, load_prompts, resolve_prompt_path
from flowforge.runtime.dtypes import DTYPE_NAMES

VIDEO_TASKS = ("t2v", "i2v")


class PreflightError(ConfigError):
    """The config cannot run; ``problems`` lists every violation."""

    def __init__(self, problems):
        super().__init__(problems, header="preflight failed")


@dataclass(frozen=True)
class PreflightReport:
    warnings: tuple[str, ...]


def _choice(problems, name, value, allowed):
    if value not in allowed:
        problems.append(f"{name}={value!r} is not one of {list(allowed)}")


def _trained_step_problems(cfg: Config, problems: list[str]) -> None:
    """Trained steps (indices already in range: the ``sampler`` section checks them) against the schedule and the
    configured kernel: each must have a finite, positive transition std."""
    s = cfg.sampler
    try:
        if s.schedule == "dynamic" and s.mu is None:
            mu = schedules.calculate_shift((cfg.model.height // 16) * (cfg.model.width // 16))
        else:
            mu = s.mu
        sigmas = schedules.flow_match_sigmas(s.num_steps, None if mu is not None else s.shift, mu=mu,
                                             kind=s.schedule)
    except ValueError as exc:
        problems.append(f"sampler schedule: {exc}")
        return
    steps = {*(s.trained_indices or ()), *(s.sde_pool or ())}
    if s.trained_indices is None and s.sde_pool is None:
        try:
            steps.update(schedules.resolve_trained_steps(s.num_steps, num_sde_steps=s.num_sde_steps,
                                                         fraction=tuple(s.sde_window)))
        except ValueError as exc:
            problems.append(f"sampler.num_sde_steps / sampler.sde_window: {exc}")
    if s.sde_kind not in TRANSITION_KINDS or s.sde_kind == "ode":
        return
    # Computed by the kernel itself, so a kernel whose step 0 is singular (sigma = 1) is caught wherever the clamp
    # does not apply.
    for i in sorted(steps):
        probe = torch.zeros(1, 1)
        try:
            std = transition(s.sde_kind, probe, probe, sigmas[i], sigmas[i + 1], s.noise_level,
                             sigma_max=sigmas[1], compute_log_prob=False).std
        except ValueError as exc:
            problems.append(f"trained step {i} under sampler.sde_kind={s.sde_kind!r}: {exc}")
            continue
        if not bool(torch.isfinite(std).all()) or not bool((std > 0).all()):
            problems.append(f"trained step {i} (sigma {float(sigmas[i]):.4f} -> {float(sigmas[i + 1]):.4f}) has "
                            f"transition std {float(std[0])} under sampler.sde_kind={s.sde_kind!r} with "
                            f"noise_level={s.noise_level}: its log-prob is undefined; choose other steps")


def _task_problems(cfg: Config, problems: list[str], warnings: list[str]) -> None:
    """``model.task`` against the adapter class's declared ``tasks`` (imported, no weights loaded), image tasks
    against its ``condition_on_images``, and ``model.frames``."""
    from flowforge.models import adapter_class, adapter_tasks

    m = cfg.model
    if m.task not in TASKS:
        return
    try:
        tasks = adapter_tasks(m.adapter)
    except ValueError as exc:
        problems.append(f"model.adapter: {exc}")
        tasks = ()
    if tasks is None:
        warnings.append(f"model.adapter={m.adapter!r} declares no class-level `tasks` tuple: model.task={m.task!r} "
                        "is not checked against it")
    elif tasks and m.task not in tasks:
        problems.append(f"model.task={m.task!r}: model.adapter={m.adapter!r} runs only {list(tasks)}")
    if m.task in IMAGE_TASKS and tasks != () and not hasattr(adapter_class(m.adapter), "condition_on_images"):
        problems.append(f"model.task={m.task!r}: model.adapter={m.adapter!r} has no condition_on_images "
                        "(the ImageConditioned extension in flowforge/models/base.py), so it cannot take the "
                        "prompts' condition images")
    if m.task in VIDEO_TASKS and m.frames is None:
        problems.append(f"model.task={m.task!r} needs model.frames (e.g. 81 for Wan)")
    elif m.task == "i2v" and m.frames < 2:
        problems.append(f"model.frames={m.frames} with model.task='i2v': the first frame is the condition image, "
                        "so nothing would be generated; use >= 2 frames (e.g. 81 for Wan)")
    elif m.task not in VIDEO_TASKS and m.frames is not None:
        problems.append(f"model.frames={m.frames} with model.task={m.task!r}: frames are for video tasks "
                        f"{list(VIDEO_TASKS)}; remove model.frames")


def _prompt_problems(cfg: Config, problems: list[str], warnings: list[str]) -> None:
    """The prompt files, when present on this machine: every row valid (images included) and fitting
    ``model.task``. A file absent here is a warning (a config written for another machine); the trainer loads it
    again and fails there if it is still missing."""
    for name, source in (("data.prompts", cfg.data.prompts), ("data.eval_prompts", cfg.data.eval_prompts)):
        try:
            path = resolve_prompt_path(source)
            if path.is_dir():
                problems.append(f"{name}={source!r} is a directory; give a JSONL prompt file")
                continue
            if not path.is_file():
                warnings.append(f"{name}={source!r}: no such file on this machine (checked again when training "
                                "starts)")
                continue
            records = load_prompts(path)
        except ValueError as exc:  # a bad row or image (the message names the file, line and field)
            problems.append(f"{name}: {exc}")
            continue
        except (OSError, RuntimeError) as exc:  # unreadable file, symlink loop
            problems.append(f"{name}={source!r} cannot be read ({type(exc).__name__}: {exc})")
            continue
        try:
            check_task(records, cfg.model.task, name)
        except ValueError as exc:
            problems.append(str(exc))


def _name_problems(cfg: Config, problems: list[str]) -> None:
    """Values whose allowed names are owned by other modules (the sections cannot import them)."""
    from flowforge.objectives import OBJECTIVES
    from flowforge.rewards.registry import check_scorer_spec
    from flowforge.runtime.distributed import STRATEGIES

    _choice(problems, "train.algorithm", cfg.train.algorithm, sorted(OBJECTIVES))
    _choice(problems, "sampler.sde_kind", cfg.sampler.sde_kind, TRANSITION_KINDS)
    _choice(problems, "sampler.schedule", cfg.sampler.schedule, schedules.SCHEDULE_KINDS)
    _choice(problems, "advantage.std_mode", cfg.advantage.std_mode, STD_MODES)
    _choice(problems, "advantage.combine", cfg.advantage.combine, COMBINE_MODES)
    _choice(problems, "model.dtype", cfg.model.dtype, DTYPE_NAMES)
    _choice(problems, "model.task", cfg.model.task, TASKS)
    _choice(problems, "distributed.strategy", cfg.distributed.strategy, STRATEGIES)
    for name in cfg.reward.weights:
        problems.extend(f"reward.weights: {p}" for p in check_scorer_spec(name, cfg.reward.options.get(name, {})))
    for name in cfg.eval.scorers:
        problems.extend(f"eval.scorers: {p}" for p in check_scorer_spec(name, {}))


def _batch_problems(cfg: Config, world: int, problems: list[str]) -> None:
    """The per-rank batch splits into disjoint updates of whole micro-batches."""
    t, d = cfg.train, cfg.data
    batch = d.prompts_per_step * d.group_size
    if batch % world:
        problems.append(f"data.prompts_per_step * data.group_size = {batch} is not divisible by the world size "
                        f"{world}")
    per_rank = batch // world
    if per_rank % t.num_updates_per_batch:
        problems.append(f"train.num_updates_per_batch={t.num_updates_per_batch} does not divide the per-rank batch "
                        f"{per_rank} (= prompts_per_step {d.prompts_per_step} x group_size {d.group_size} / "
                        f"world {world})")
    elif (per_rank // t.num_updates_per_batch) % t.micro_batch_size:
        problems.append(f"train.micro_batch_size={t.micro_batch_size} does not divide the per-update batch "
                        f"{per_rank // t.num_updates_per_batch} (per-rank batch {per_rank} / num_updates_per_batch "
                        f"{t.num_updates_per_batch})")


def preflight(cfg: Config, *, world_size: int | None = None) -> PreflightReport:
    """Check ``cfg`` as a whole (each section has checked its own values when it was built). Returns warnings;
    raises :class:`PreflightError` listing every error.

    Args:
        world_size: number of ranks sharing each step's batch (default: ``$WORLD_SIZE`` or 1).
    """
    from flowforge.objectives import OBJECTIVES

    problems: list[str] = []
    warnings: list[str] = []
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    _name_problems(cfg, problems)
    _task_problems(cfg, problems, warnings)
    _prompt_problems(cfg, problems, warnings)
    _trained_step_problems(cfg, problems)
    _batch_problems(cfg, world, problems)
    objective = OBJECTIVES.get(cfg.train.algorithm)
    if objective is not None:
        problems += objective.preflight_problems(cfg, world_size=world)
    if cfg.data.group_size < 2 and cfg.advantage.std_mode == "group":
        warnings.append(f"data.group_size={cfg.data.group_size} with advantage.std_mode='group': every group has one "
                        "candidate, so every advantage is 0 and nothing is learned")
    if cfg.reward.device != "cpu":
        warnings.append(f"reward.device={cfg.reward.device!r} is not read: scorers run on the run device "
                        "(run.device) unless a scorer takes its own device option (reward.options.<name>.device)")
    if problems:
        raise PreflightError(problems)
    return PreflightReport(warnings=tuple(warnings))
