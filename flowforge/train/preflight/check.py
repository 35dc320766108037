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

from flowforge.config import Config, ConfigError
from flowforge.data.prompt_set import PromptSet
from flowforge.train.preflight.machine import (_device_problems, _directory_problems, _leverage_warnings,
                                               _memory_problems, _model_path_problems, _resume_problems)
from flowforge.train.preflight.modules import module_path_problems
from flowforge.train.preflight.parallel import context_parallel_problems, data_world
from flowforge.train.preflight.rules import run_rules
from flowforge.train.preflight.static import (_audio_problems, _batch_problems, _name_problems, _prompt_problems,
                                              _task_problems, _trained_step_problems, offload_problems)


class PreflightError(ConfigError):
    """The config cannot run; ``problems`` lists every violation."""

    def __init__(self, problems):
        super().__init__(problems, header="preflight failed")


@dataclass(frozen=True)
class PreflightReport:
    warnings: tuple[str, ...]
    prompts: dict[str, PromptSet] = field(default_factory=dict)  # the prompt files checked, by key: read them once



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
    problems += offload_problems(cfg, world)  # FSDP's ranks: the whole world (context groups shard too)
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
