"""Validate a whole config before any model loads: every violation collected, one error raised.

:func:`preflight` returns the warnings (things that run but are probably not what the user wants) and raises
:class:`PreflightError` listing *every* error at once, so a user fixes a config in one round trip.

Each config section has already checked its own values when it was built (:mod:`flowforge.settings`: types,
ranges, NaN / inf in every float field, ``run.name`` one path component); preflight checks what no single section
can: names owned by other modules (algorithm, kernel, schedule, advantage modes, dtypes, task, adapter, scorers and
their options, strategy), trained steps against the schedule and kernel, batch divisibility across ranks, prompt
files against the task, each algorithm's own rules (:meth:`flowforge.objectives.Objective.preflight_problems`), the
reward-hacking guard and the rollout chunking (:func:`flowforge.train.preflight.rules.run_rules`).

With ``this_machine=True`` (the default; ``flowforge check`` and ``train``) it also checks the config against this
machine: ``run.device`` exists, the prompt files are there (absent ones are only warnings without it),
``model.path`` is a model directory (a Hub id not in the local cache is a warning, a
problem offline), output and cache directories are directories, an explicit ``train.resume`` is committed, and one
step's decoded media (a lower bound) fit in memory: a huge ``data.group_size`` is refused with an estimate. A world
model's trained set behind closed coupling gates is a warning (the gates read from its weights file).

What needs the loaded model -- the latent shape (``model.height`` / ``width`` / ``frames`` divisibility), LoRA
targets that match no module, LoRA layers inside trained submodules (``module+lora``) when the targets are only
known then, the memory estimate -- is checked by :func:`check_loaded_model` once it loads
(:mod:`flowforge.train.preflight.loaded`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flowforge.algorithms import schedules
from flowforge.algorithms.advantages import COMBINE_MODES, STD_MODES
from flowforge.algorithms.sde import TRANSITION_KINDS, transition
from flowforge.config import Config, ConfigError
from flowforge.data.prompt_set import PromptSet, open_prompts
from flowforge.data.prompts import IMAGE_TASKS, TASKS, check_task, resolve_prompt_path
from flowforge.runtime.dtypes import DTYPE_NAMES
from flowforge.runtime.errors import one_line
from flowforge.settings.schema import note_choice
from flowforge.train.preflight.loaded import check_loaded_model  # noqa: F401 - the trainer imports it from here
from flowforge.train.preflight.loaded import _gib, media_bytes, memory_limit
from flowforge.train.preflight.modules import module_path_problems
from flowforge.train.preflight.parallel import context_parallel_problems, data_world
from flowforge.train.preflight.rules import run_rules

VIDEO_TASKS = ("t2v", "i2v")


class PreflightError(ConfigError):
    """The config cannot run; ``problems`` lists every violation."""

    def __init__(self, problems):
        super().__init__(problems, header="preflight failed")


@dataclass(frozen=True)
class PreflightReport:
    warnings: tuple[str, ...]
    prompts: dict[str, PromptSet] = field(default_factory=dict)  # the prompt files checked, by key: read them once


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


def _scorer_problems(name: str, options: dict) -> list[str]:
    """:func:`flowforge.rewards.registry.check_scorer_spec` of one reward component, each problem naming its key
    (``reward.options.<name>`` with the allowed option names, or ``reward.weights``); no scorer is built."""
    import inspect

    from flowforge.rewards.registry import SCORERS, check_scorer_spec

    out = []
    for problem in check_scorer_spec(name, options):
        if not problem.startswith("reward.options."):
            out.append(f"reward.weights: {problem}")
            continue
        if "unexpected keyword argument" in problem and name in SCORERS:
            params = inspect.signature(SCORERS[name]).parameters
            allowed = [p for p in params if p != "run_dir" and params[p].kind is not inspect.Parameter.VAR_KEYWORD]
            unknown = sorted(set(options) - set(params))
            problem = f"reward.options.{name}: unknown option{'s' * (len(unknown) > 1)} {unknown}; allowed: {allowed}"
        out.append(problem)
    return out


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
    _choice(problems, "distributed.param_dtype", cfg.distributed.param_dtype, DTYPE_NAMES)
    _choice(problems, "distributed.reduce_dtype", cfg.distributed.reduce_dtype, DTYPE_NAMES)
    for name in cfg.reward.weights:
        problems.extend(_scorer_problems(name, cfg.reward.options.get(name, {})))
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


# ------------------------------------------------------------------------------------------------ this machine
def _device_problems(cfg: Config, problems: list[str]) -> None:
    """``run.device`` names a device torch knows and this machine has."""
    name = cfg.run.device
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        problems.append(f"run.device={name!r} is not a device ({one_line(str(exc))}); use cpu, cuda, cuda:N or mps")
        return
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            problems.append(f"run.device={name!r} but this machine has no CUDA device (torch.cuda.is_available() is "
                            f"False for torch {torch.__version__}); use run.device=cpu or run on a GPU machine")
        elif device.index is not None and device.index >= count:
            problems.append(f"run.device={name!r} but this machine has {count} CUDA device(s): cuda:0 .. "
                            f"cuda:{count - 1}")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        problems.append(f"run.device={name!r} but MPS is not available on this machine; use run.device=cpu")


def _model_path_problems(cfg: Config, problems: list[str], warnings: list[str], this_machine: bool) -> None:
    """``model.path``: a known demo name; for a registered family (a ``pkg.module:Class`` adapter decides what its
    path means) and ``this_machine``, a path on disk, or a Hub id -- a warning when it is not in the local cache
    (training downloads it), a problem when it is not and ``HF_HUB_OFFLINE`` forbids the download."""
    from flowforge.demo.paths import is_demo_name, resolve_demo_path
    from flowforge.models import ADAPTERS, cached_hub_snapshot, download_hint, hub_offline, looks_like_hub_id

    path = cfg.model.path
    if is_demo_name(path):
        try:
            resolve_demo_path(path)
        except ValueError as exc:
            problems.append(f"model.path: {exc}")
        return
    if not this_machine or cfg.model.adapter not in ADAPTERS:
        return
    if os.path.exists(path):
        # every registered family loads a transformer config.json, at the top (a bare transformer, a world model)
        # or under transformer/ (a diffusers pipeline)
        if not os.path.isdir(path):
            problems.append(f"model.path={path!r} is a file; give a model directory (diffusers pipeline or "
                            "transformer), a Hub id (org/name) or demo:base")
        elif not any(os.path.isfile(os.path.join(path, *rel)) for rel in (("config.json",),
                                                                          ("transformer", "config.json"))):
            problems.append(f"model.path={path!r} holds neither config.json nor transformer/config.json: not a "
                            "diffusers model directory; give the directory save_pretrained wrote")
        return
    if looks_like_hub_id(path):
        missing = (f"model.path={path!r} is not a directory here and looks like a Hub id that is not in the local "
                   "Hugging Face cache")
        if cached_hub_snapshot(path) is not None:
            return
        if hub_offline():  # training here cannot get it
            problems.append(f"{missing}, and HF_HUB_OFFLINE is set; {download_hint(path)}")
        else:
            warnings.append(f"{missing}; training downloads it")
        return
    why = "cannot be reached (a symlink loop or a broken link)" if os.path.lexists(path) else "does not exist"
    problems.append(f"model.path={path!r} {why} on this machine; give a local diffusers directory, a Hub id "
                    "(org/name) or demo:base")


def _directory_problems(cfg: Config, problems: list[str]) -> None:
    """Directories flowforge will create or write into must not be files."""
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    for key, path in (("run.output_dir", Path(cfg.run.output_dir)), ("run.name", run_dir),
                      ("data.cache_dir", Path(cfg.data.cache_dir))):
        if path.exists() and not path.is_dir():
            problems.append(f"{key}: {path} is a file, not a directory; choose another {key}")


def _resume_problems(cfg: Config, problems: list[str]) -> None:
    """An explicit ``train.resume`` path is a committed checkpoint directory (its files' checksums are verified when
    training resumes: hashing a large checkpoint here would make ``check`` slow)."""
    from flowforge.train.checkpoint import MARKER, is_committed

    resume = cfg.train.resume
    if resume in (None, "auto", "must"):
        return
    path = Path(resume).expanduser()
    fix = "give a committed checkpoint directory (<run>/checkpoints/step_N) or train.resume=auto"
    if not path.exists():
        problems.append(f"train.resume={resume!r}: {path} does not exist; {fix}")
    elif not is_committed(path):
        problems.append(f"train.resume={resume!r}: {path} has no {MARKER} marker (not a checkpoint directory, or an "
                        f"interrupted or superseded write); {fix}")


def _memory_problems(cfg: Config, world: int, counts: dict[str, int], problems: list[str]) -> None:
    """One step's and one evaluation's decoded media (lower bounds, :func:`media_bytes`) against the memory of
    ``run.device`` on this machine: a run that cannot hold them would exhaust memory (or swap for hours)."""
    limit = memory_limit(cfg.run.device)
    if limit is None:
        return
    total, what = limit
    d, m, e = cfg.data, cfg.model, cfg.eval
    per_rank = max(1, d.prompts_per_step * d.group_size // max(world, 1))
    size = f"{m.height}x{m.width}" + (f"x{m.frames} frames" if m.frames else "")
    need = media_bytes(cfg, per_rank)
    if need > total:
        problems.append(f"data.prompts_per_step x data.group_size = {per_rank} samples per rank at {size}: one step's "
                        f"decoded media alone need at least {_gib(need)}, more than the {_gib(total)} {what} of this "
                        "machine; lower data.group_size / data.prompts_per_step or model.height / model.width")
    n_eval = counts.get("data.eval_prompts")
    if n_eval is not None:
        rows = min(n_eval, e.max_prompts or n_eval) * e.samples_per_prompt
        need = media_bytes(cfg, rows)
        if need > total:
            problems.append(f"eval: {rows} samples ({min(n_eval, e.max_prompts or n_eval)} prompts x "
                            f"eval.samples_per_prompt={e.samples_per_prompt}) at {size} need at least {_gib(need)} of "
                            f"decoded media, more than the {_gib(total)} {what}; lower eval.max_prompts or "
                            "eval.samples_per_prompt")


def _leverage_warnings(cfg: Config, warnings: list[str]) -> None:
    """A world model whose trained set sits behind closed coupling gates (B-only or coupling-LoRA on a base whose gates
    stayed ~0 in SFT): :func:`~flowforge.models.world_model.adapter.gate_leverage_warnings` of the gates read from
    its weights file, no network built. Other adapters, and a path with no local weights file, are left to the
    loaded-model check."""
    if cfg.model.adapter != "world_model":
        return
    from flowforge.demo.paths import is_demo_name, resolve_demo_path
    from flowforge.models.world_model.adapter import gate_leverage_warnings, read_coupling_gates

    try:
        path = resolve_demo_path(cfg.model.path) if is_demo_name(cfg.model.path) else cfg.model.path
        gates = read_coupling_gates(path)
    except Exception:  # noqa: BLE001 - an unknown demo name or unreadable weights: named by the model checks / load
        return
    if gates is not None:
        warnings.extend(gate_leverage_warnings(cfg.lora.trainable, cfg.lora.modules, gates))


def preflight(cfg: Config, *, world_size: int | None = None, this_machine: bool = True) -> PreflightReport:
    """Check ``cfg`` as a whole (each section has checked its own values when it was built). Returns warnings;
    raises :class:`PreflightError` listing every error.

    Args:
        world_size: number of ranks sharing each step's batch (default: ``$WORLD_SIZE`` or 1).
        this_machine: also check the config against this machine (device, ``model.path`` on disk, directories,
            memory; see the module docstring). False checks only the config itself (e.g. a GPU config on a
            laptop).
    """
    from flowforge.models import option_problems
    from flowforge.objectives import OBJECTIVES

    problems: list[str] = []
    warnings: list[str] = []
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    _name_problems(cfg, problems)
    _task_problems(cfg, problems, warnings)
    _audio_problems(cfg, problems)
    opened: dict[str, PromptSet] = {}
    counts = _prompt_problems(cfg, problems, warnings, this_machine, opened)
    _model_path_problems(cfg, problems, warnings, this_machine)
    _trained_step_problems(cfg, problems)
    problems += context_parallel_problems(cfg, world)
    world = data_world(cfg, world)  # from here: ranks with samples of their own (a context group shares its samples)
    _batch_problems(cfg, world, problems)
    if this_machine:
        for check in (_device_problems, _directory_problems, _resume_problems, module_path_problems):
            check(cfg, problems)
        _memory_problems(cfg, world, counts, problems)
        _leverage_warnings(cfg, warnings)
    objective = OBJECTIVES.get(cfg.train.algorithm)
    problems += objective.preflight_problems(cfg, world_size=world) if objective is not None else []
    problems += cfg.rollout.cross_problems(cfg.lora.trainable)  # engine vs lora.trainable, Ray installed
    problems += option_problems(cfg.model.adapter, cfg.sampler.model_options)  # family sampler keys (LTX-2)
    run_rules(cfg, problems, warnings, world_size=world)  # the reward-hacking guard, rollout chunking
    if cfg.data.group_size < 2 and cfg.advantage.std_mode == "group":
        warnings.append(f"data.group_size={cfg.data.group_size} with advantage.std_mode='group': every group has one "
                        "candidate, so every advantage is 0 and nothing is learned")
    if cfg.sampler.negative_prompt is not None and cfg.sampler.guidance_scale == 1.0:
        warnings.append(f"sampler.negative_prompt={cfg.sampler.negative_prompt!r} is not used: "
                        "classifier-free guidance runs only when sampler.guidance_scale != 1")
    grouped = sorted({n for n in (*cfg.eval.scorers, *cfg.reward.weights) if n == "group_diversity"})
    if grouped and cfg.eval.samples_per_prompt < 2:  # the eval scores every reward component too
        warnings.append(f"{grouped[0]} is evaluated with eval.samples_per_prompt={cfg.eval.samples_per_prompt}: it "
                        "compares samples of the same prompt, so eval/group_diversity and eval/diversity are NaN "
                        "(not measured); diversity needs eval.samples_per_prompt >= 2")
    if cfg.reward.device != "cpu":
        warnings.append(f"reward.device={cfg.reward.device!r} is not read: scorers run on the run device "
                        "(run.device) unless a scorer takes its own device option (reward.options.<name>.device)")
    if problems:
        raise PreflightError(problems)
    return PreflightReport(warnings=tuple(warnings), prompts=opened)
