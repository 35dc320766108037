"""Preflight checks of the config alone (names owned by other modules, the task against the adapter, prompt files,
audio scorers, trained steps against the schedule, batch splits): each appends to ``problems`` / ``warnings``, read by
:func:`flowforge.train.preflight.check.preflight`."""

from __future__ import annotations

import os

import torch

from flowforge.algorithms import schedules
from flowforge.algorithms.advantages import COMBINE_MODES, STD_MODES
from flowforge.algorithms.sde import TRANSITION_KINDS, transition
from flowforge.config import Config
from flowforge.data.prompt_set import PromptSet, open_prompts
from flowforge.data.prompts import IMAGE_TASKS, TASKS, check_task, resolve_prompt_path
from flowforge.runtime.dtypes import DTYPE_NAMES
from flowforge.runtime.errors import one_line
from flowforge.settings.schema import note_choice

VIDEO_TASKS = ("t2v", "i2v")


def _choice(problems, name, value, allowed):
    note_choice(name, allowed)  # the generated config reference lists these allowed values
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
    from flowforge.models import adapter_class, adapter_class_problem, adapter_tasks, what_an_adapter_is

    m = cfg.model
    if m.task not in TASKS:
        return
    try:
        tasks = adapter_tasks(m.adapter)
        not_one = adapter_class_problem(m.adapter)
    except ValueError as exc:
        problems.append(f"model.adapter: {exc}")
        tasks = ()
    else:
        if not_one:
            problems.append(f"model.adapter: {not_one}; {what_an_adapter_is()}")
            return
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


def _prompt_problems(cfg: Config, problems: list[str], warnings: list[str], this_machine: bool,
                     opened: dict[str, PromptSet]) -> dict[str, int]:
    """The prompt files, when present on this machine: every row valid (images included), fitting ``model.task``,
    and at least ``data.prompts_per_step`` training prompts. A file absent here is a problem naming the absolute
    path tried (relative paths start at the working directory), or with ``this_machine=False`` (``check
    --portable``: a config written for another machine) a warning. A path that is there but is a directory, not a
    regular file (``/dev/null``) or unreadable (a symlink loop) is a problem either way.

    Returns:
        The number of prompts of each file that loaded, by key (``data.prompts`` / ``data.eval_prompts``); the
        files themselves go into ``opened``.
    """
    counts: dict[str, int] = {}
    for name, source in (("data.prompts", cfg.data.prompts), ("data.eval_prompts", cfg.data.eval_prompts)):
        try:
            path = resolve_prompt_path(source)
            records = open_prompts(path)  # byte offsets, not records: any size
        except FileNotFoundError as exc:
            if os.path.islink(path):  # a link to nothing is a broken input, not a file of another machine
                problems.append(f"{name}={source!r} is a symlink to {os.readlink(path)!r}, which does not exist")
            elif this_machine:
                problems.append(f"{name}={source!r}: {exc}")
            else:
                warnings.append(f"{name}={source!r}: no such file on this machine ({exc})")
            continue
        except ValueError as exc:  # a bad row or image (file, line, field), or not a readable regular file
            problems.append(f"{name}: {one_line(str(exc))}")
            continue
        except OSError as exc:  # a read error the file checks could not foresee
            problems.append(f"{name}={source!r} cannot be read ({type(exc).__name__}: {exc})")
            continue
        counts[name], opened[name] = len(records), records
        try:
            check_task(records, cfg.model.task, name)
        except ValueError as exc:
            problems.append(str(exc))
    n, m = counts.get("data.prompts"), cfg.data.prompts_per_step
    if n is not None and m > n:
        problems.append(f"data.prompts_per_step={m} is more than the {n} prompts in data.prompts "
                        f"({cfg.data.prompts!r}): the prompts of one step are distinct; use at most {n} or add prompts")
    return counts


def _audio_problems(cfg: Config, problems: list[str]) -> None:
    """Built-in reward components that score audio (``takes_audio``, e.g. ``av_onset_sync``) need a model that
    makes sound (its adapter class has ``decode_audio``: ``ltx2``) and ``reward.overlap`` off (the overlapped score
    stream carries no audio); the trainer checks the same on the built objects (bring-your-own scorers too)."""
    from flowforge.models import adapter_class
    from flowforge.rewards.registry import SCORERS

    audio = sorted(n for n in dict.fromkeys([*cfg.reward.weights, *cfg.eval.scorers])
                   if n in SCORERS and getattr(SCORERS[n], "takes_audio", False))
    if not audio:
        return
    try:
        sounding = hasattr(adapter_class(cfg.model.adapter), "decode_audio")
    except ValueError:
        return  # the unknown adapter is reported by _task_problems
    if not sounding:
        problems.append(f"reward.weights: {audio} score audio, but model.adapter={cfg.model.adapter!r} produces "
                        "none; use an audio-video family (ltx2) or drop them")
    if cfg.reward.overlap:
        problems.append(f"reward.overlap: true, but {audio} score audio, which the overlapped score stream does not "
                        "carry; set reward.overlap=false")


def _scorer_problems(name: str, options: dict, key: str = "reward.weights") -> list[str]:
    """:func:`flowforge.rewards.registry.check_scorer_spec` of one scorer, each problem naming its key
    (``reward.options.<name>``, unknown options with the allowed names, or ``key``: where the name is listed); no
    scorer is built."""
    from flowforge.rewards.registry import check_scorer_spec

    return [p if p.startswith("reward.options.") else f"{key}: {p}" for p in check_scorer_spec(name, options)]


def _name_problems(cfg: Config, problems: list[str]) -> None:
    """Values whose allowed names are owned by other modules (the sections cannot import them)."""
    from flowforge.objectives import OBJECTIVES
    from flowforge.runtime.distributed import STRATEGIES

    _choice(problems, "train.algorithm", cfg.train.algorithm, sorted(OBJECTIVES))
    _choice(problems, "sampler.sde_kind", cfg.sampler.sde_kind, TRANSITION_KINDS)
    _choice(problems, "sampler.schedule", cfg.sampler.schedule, schedules.SCHEDULE_KINDS)
    _choice(problems, "advantage.std_mode", cfg.advantage.std_mode, STD_MODES)
    _choice(problems, "advantage.combine", cfg.advantage.combine, COMBINE_MODES)
    _choice(problems, "model.dtype", cfg.model.dtype, DTYPE_NAMES)
    _choice(problems, "model.task", cfg.model.task, TASKS)
    _choice(problems, "distributed.strategy", cfg.distributed.strategy, STRATEGIES)
    _choice(problems, "distributed.param_dtype", cfg.distributed.param_dtype, DTYPE_NAMES)
    _choice(problems, "distributed.reduce_dtype", cfg.distributed.reduce_dtype, DTYPE_NAMES)
    for name in cfg.reward.weights:
        problems.extend(_scorer_problems(name, cfg.reward.options.get(name, {})))
    for name in cfg.eval.scorers:
        # an eval-only scorer is built with its reward.options too (a held-out judge needs its model paths)
        problems.extend(_scorer_problems(name, cfg.reward.options.get(name, {}), "eval.scorers"))
    scored = [*cfg.reward.weights, *(n for n in cfg.eval.scorers if n not in cfg.reward.weights)]
    for name in cfg.reward.options:
        if name not in scored:
            problems.append(f"reward.options.{name}: neither a weighted component nor an eval scorer; allowed: "
                            f"{scored} (reward.weights, eval.scorers)")


def offload_problems(cfg: Config, world: int) -> list[str]:
    """``distributed.offload`` other than ``none`` needs FSDP on >= 2 ranks (one line naming the field, its value and
    what is allowed). An error, not a silent no-op: offload is asked for because the GPU is short of memory, and a
    run that ignored it would keep everything on the GPU that the setting (and ``flowforge plan``) counted on the
    host."""
    d = cfg.distributed
    if d.offload == "none" or (d.strategy == "fsdp" and world > 1):
        return []
    why = f"distributed.strategy={d.strategy!r}" if world > 1 else f"{world} process"
    return [f"distributed.offload={d.offload!r} needs FSDP on >= 2 ranks (torchrun --nproc_per_node N with "
            f"distributed.strategy=fsdp), got {why}; allowed here: ['none']"]


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

