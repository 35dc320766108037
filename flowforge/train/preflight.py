"""Validate a whole config before any model loads: every violation collected, one error raised.

:func:`preflight` returns the warnings (things that run but are probably not what the user wants) and raises
:class:`PreflightError` listing *every* error at once, so a user fixes a config in one round trip.

Algorithm properties (which objectives use per-step log-probs, which clip an importance ratio, which replay a
sampler) are read from the objective classes themselves (``flowforge.objectives.OBJECTIVES``), never from a second
list kept here.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from flowforge.algorithms import schedules
from flowforge.algorithms.advantages import STD_MODES, COMBINE_MODES
from flowforge.algorithms.losses import AWM_WEIGHTINGS, CRD_LOSS_TYPES, DGPO_MODES, GUARD_STEP_WEIGHTS, NFT_MODES
from flowforge.algorithms.sde import TRANSITION_KINDS, transition
from flowforge.config import Config, ConfigError
from flowforge.data.prompts import IMAGE_TASKS, TASKS, check_task, load_prompts, resolve_prompt_path

LR_SCHEDULES = ("constant", "linear", "cosine")
TRAINABLE_MODES = ("lora", "full")
DTYPES = ("float32", "bfloat16", "float16")
VIDEO_TASKS = ("t2v", "i2v")
FORWARD_SIGMA_MODES = ("uniform_schedule", "full_schedule")
NFT_REWARD_TRANSFORMS = ("reference", "absolute")


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


def _positive(problems, name, value, *, allow_zero=False):
    if value is None:
        return
    ok = value >= 0 if allow_zero else value > 0
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        problems.append(f"{name}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


def _trained_step_problems(cfg: Config, problems: list[str]) -> None:
    s = cfg.sampler
    if s.num_steps < 2:
        problems.append(f"sampler.num_steps={s.num_steps} must be >= 2")
        return
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
    steps: set[int] = set()
    for name, values in (("sampler.trained_indices", s.trained_indices), ("sampler.sde_pool", s.sde_pool)):
        for i in values or ():
            if not 0 <= i < s.num_steps:
                problems.append(f"{name} entry {i} is outside [0, {s.num_steps}) (sampler.num_steps={s.num_steps})")
            elif i == s.num_steps - 1:
                problems.append(f"{name} entry {i} is the last step (sigma_next = 0): its transition is degenerate "
                                f"and never trained; allowed 0..{s.num_steps - 2}")
            else:
                steps.add(i)
    if s.trained_indices is None and s.sde_pool is None:
        try:
            steps.update(schedules.resolve_trained_steps(s.num_steps, num_sde_steps=s.num_sde_steps,
                                                         fraction=tuple(s.sde_window)))
        except ValueError as exc:
            problems.append(f"sampler.num_sde_steps / sampler.sde_window: {exc}")
    if s.sde_kind not in TRANSITION_KINDS or s.sde_kind == "ode":
        return
    # Each trained step must have a finite, positive transition std under the configured kernel; computed by the
    # kernel itself, so a kernel whose step 0 is singular (sigma = 1) is caught wherever the clamp does not apply.
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


def preflight(cfg: Config, *, world_size: int | None = None) -> PreflightReport:
    """Check ``cfg`` as a whole. Returns warnings; raises :class:`PreflightError` listing every error.

    Args:
        world_size: number of ranks sharing each step's batch (default: ``$WORLD_SIZE`` or 1).
    """
    from flowforge.objectives import OBJECTIVES
    from flowforge.rewards.registry import SCORERS

    problems: list[str] = []
    warnings: list[str] = []
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))

    t, s, d, a, lo = cfg.train, cfg.sampler, cfg.data, cfg.advantage, cfg.lora
    _choice(problems, "train.algorithm", t.algorithm, sorted(OBJECTIVES))
    _choice(problems, "sampler.sde_kind", s.sde_kind, TRANSITION_KINDS)
    _choice(problems, "sampler.schedule", s.schedule, schedules.SCHEDULE_KINDS)
    _choice(problems, "advantage.std_mode", a.std_mode, STD_MODES)
    _choice(problems, "advantage.combine", a.combine, COMBINE_MODES)
    _choice(problems, "train.lr_schedule", t.lr_schedule, LR_SCHEDULES)
    _choice(problems, "lora.trainable", lo.trainable, TRAINABLE_MODES)
    _choice(problems, "model.dtype", cfg.model.dtype, DTYPES)
    _choice(problems, "model.task", cfg.model.task, TASKS)
    _task_problems(cfg, problems, warnings)
    _prompt_problems(cfg, problems, warnings)
    _choice(problems, "nft.loss_mode", cfg.nft.loss_mode, NFT_MODES)
    _choice(problems, "forward.sampler", cfg.forward.sampler, TRANSITION_KINDS)
    _choice(problems, "forward.sample_with", cfg.forward.sample_with, ("old", "live"))
    _choice(problems, "forward.sigma_mode", cfg.forward.sigma_mode, FORWARD_SIGMA_MODES)
    _choice(problems, "awm.weighting", cfg.awm.weighting, AWM_WEIGHTINGS)
    _choice(problems, "dgpo.mode", cfg.dgpo.mode, DGPO_MODES)
    _choice(problems, "crd.loss_type", cfg.crd.loss_type, CRD_LOSS_TYPES)
    _choice(problems, "grpo_guard.step_weight", cfg.grpo_guard.step_weight, GUARD_STEP_WEIGHTS)
    _choice(problems, "nft.reward_transform", cfg.nft.reward_transform, NFT_REWARD_TRANSFORMS)
    _choice(problems, "nft.std_scope", cfg.nft.std_scope, ("group", "batch"))
    if not 0 <= cfg.forward.decay_max < 1 or cfg.forward.decay_rate < 0:
        problems.append(f"forward.decay_rate={cfg.forward.decay_rate} must be >= 0 and forward.decay_max="
                        f"{cfg.forward.decay_max} in [0, 1)")
    if not 0 <= cfg.nft.ema_decay < 1:
        problems.append(f"nft.ema_decay={cfg.nft.ema_decay} must be in [0, 1) (0 = no EMA)")
    if cfg.artifacts.keep < 1:
        problems.append(f"artifacts.keep={cfg.artifacts.keep} must be >= 1")
    if cfg.checkpoint.keep < 1:
        problems.append(f"checkpoint.keep={cfg.checkpoint.keep} must be >= 1")
    from flowforge.runtime.distributed import STRATEGIES

    _choice(problems, "distributed.strategy", cfg.distributed.strategy, STRATEGIES)
    if cfg.forward.inner_epochs < 1:
        problems.append(f"forward.inner_epochs={cfg.forward.inner_epochs} must be >= 1")

    for name, value in (("train.lr", t.lr), ("train.micro_batch_size", t.micro_batch_size),
                        ("train.num_updates_per_batch", t.num_updates_per_batch),
                        ("data.prompts_per_step", d.prompts_per_step), ("data.group_size", d.group_size),
                        ("model.height", cfg.model.height), ("model.width", cfg.model.width),
                        ("reward.batch_size", cfg.reward.batch_size), ("sampler.batch_size", s.batch_size),
                        ("train.grad_clip", t.grad_clip), ("eval.batch_size", cfg.eval.batch_size),
                        ("nft.beta", cfg.nft.beta), ("nft.adv_clip", cfg.nft.adv_clip),
                        ("awm.clip_low", cfg.awm.clip_low), ("dgpo.beta", cfg.dgpo.beta), ("dpo.beta", cfg.dpo.beta),
                        ("crd.beta", cfg.crd.beta), ("crd.adv_clip", cfg.crd.adv_clip), ("advantage.eps", a.eps),
                        ("eval.samples_per_prompt", cfg.eval.samples_per_prompt)):
        _positive(problems, name, value)
    for name, value in (("train.steps", t.steps), ("train.warmup_steps", t.warmup_steps),
                        ("sampler.noise_level", s.noise_level), ("eval.every", cfg.eval.every),
                        ("checkpoint.every", cfg.checkpoint.every), ("advantage.std_floor", a.std_floor),
                        ("grpo.kl_weight", cfg.grpo.kl_weight), ("nft.ref_weight", cfg.nft.ref_weight),
                        ("nft.std_floor", cfg.nft.std_floor), ("awm.kl_weight", cfg.awm.kl_weight),
                        ("dgpo.kl_weight", cfg.dgpo.kl_weight), ("crd.kl_beta", cfg.crd.kl_beta), ("nft.guard_min_spread", cfg.nft.guard_min_spread)):
        _positive(problems, name, value, allow_zero=True)
    if cfg.grpo.clip_low <= 0 or (cfg.grpo.clip_high is not None and cfg.grpo.clip_high <= 0):
        problems.append(f"grpo.clip_low={cfg.grpo.clip_low} / grpo.clip_high={cfg.grpo.clip_high} must be > 0")

    _trained_step_problems(cfg, problems)

    # Batch arithmetic: the per-rank batch splits into disjoint updates of whole micro-batches.
    batch = d.prompts_per_step * d.group_size
    if batch % world:
        problems.append(f"data.prompts_per_step * data.group_size = {batch} is not divisible by the world size "
                        f"{world}")
    per_rank = batch // world
    if t.num_updates_per_batch > 0 and per_rank % t.num_updates_per_batch:
        problems.append(f"train.num_updates_per_batch={t.num_updates_per_batch} does not divide the per-rank batch "
                        f"{per_rank} (= prompts_per_step {d.prompts_per_step} x group_size {d.group_size} / "
                        f"world {world})")
    elif t.num_updates_per_batch > 0 and t.micro_batch_size > 0:
        per_update = per_rank // t.num_updates_per_batch
        if per_update % t.micro_batch_size:
            problems.append(f"train.micro_batch_size={t.micro_batch_size} does not divide the per-update batch "
                            f"{per_update} (per-rank batch {per_rank} / num_updates_per_batch "
                            f"{t.num_updates_per_batch})")

    objective = OBJECTIVES.get(t.algorithm)
    if objective is not None:
        if objective.clipped_ratio and t.num_updates_per_batch == 1 and a.std_mode != "none" \
                and not t.allow_unit_ratio:
            problems.append(
                f"train.num_updates_per_batch=1 with train.algorithm={t.algorithm!r} and group-centred advantages: "
                "every update sees the rollout policy, so the importance ratio is identically 1, clipping never "
                "engages and the logged loss is identically 0 (a plain policy gradient). Use num_updates_per_batch "
                ">= 2, or set train.allow_unit_ratio=true if that is what you want")
        if world > 1 and objective.needs_whole_groups(cfg) and per_rank % d.group_size:
            problems.append(f"train.algorithm={t.algorithm!r} computes group statistics per rank: the per-rank batch "
                            f"{per_rank} must hold whole groups of data.group_size={d.group_size}")
        if objective.uses_log_probs and s.sde_kind == "ode":
            problems.append(f"sampler.sde_kind='ode' with train.algorithm={t.algorithm!r}: a log-prob objective needs "
                            f"a stochastic kernel; allowed: {[k for k in TRANSITION_KINDS if k != 'ode']}")
    if d.group_size < 2 and a.std_mode == "group":
        warnings.append(f"data.group_size={d.group_size} with advantage.std_mode='group': every group has one "
                        "candidate, so every advantage is 0 and nothing is learned")

    if lo.dropout != 0:
        problems.append(f"lora.dropout={lo.dropout}: dropout in the trained policy makes rollout and replay "
                        "different policies (the first ratio would not be 1); set it to 0")
    if lo.trainable == "full" and (lo.rank is not None or lo.alpha is not None or lo.targets is not None):
        problems.append("lora.trainable='full' but lora.rank / lora.alpha / lora.targets are set: either train "
                        "LoRA (lora.trainable='lora') or remove the LoRA keys")
    if lo.trainable == "lora":
        if lo.rank is not None and lo.rank < 1:
            problems.append(f"lora.rank={lo.rank} must be >= 1 with lora.trainable='lora'")
        if lo.alpha is not None and lo.alpha <= 0:
            problems.append(f"lora.alpha={lo.alpha} must be > 0")

    r = cfg.reward
    for name in r.weights:
        if name not in SCORERS:
            problems.append(f"reward.weights: unknown component {name!r}; allowed: {sorted(SCORERS)}")
    for name in r.required:
        if name not in r.weights:
            problems.append(f"reward.required lists {name!r} but reward.weights has no weight for it")
    for name in cfg.eval.scorers:
        if name not in SCORERS:
            problems.append(f"eval.scorers: unknown scorer {name!r}; allowed: {sorted(SCORERS)}")
    for name in r.options:
        if name not in r.weights:
            problems.append(f"reward.options.{name}: not a weighted component (reward.weights: {sorted(r.weights)})")
    if not r.weights:
        problems.append("reward.weights is empty: give at least one component")
    elif all(w == 0 for w in r.weights.values()):
        problems.append("reward.weights are all 0: the reward is constant")

    if problems:
        raise PreflightError(problems)
    return PreflightReport(warnings=tuple(warnings))
