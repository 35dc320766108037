"""The base config sections: everything a run needs apart from the algorithm-specific sections.

Each section is a frozen dataclass that checks its own values when constructed (a :class:`ConfigError` naming
``section.key``, the value and what is allowed). Values whose allowed set is owned by a torch-level module (kernel,
schedule, advantage modes, dtype, task, adapter, scorer and strategy names) and rules that read several sections are
checked by :func:`flowforge.train.preflight.preflight`. The algorithm sections (``grpo``, ``forward``, ``nft``, ...)
are declared by the objectives that own them (:mod:`flowforge.objectives`); :mod:`flowforge.config` assembles the
root.

===============  ==============================================================================
``run``          run directory, seed, threads, device
``model``        adapter name or ``pkg.module:Class``, weights path, dtype, resolution, task
``lora``         trainable mode (``lora`` | ``full`` | ``module`` | ``module+lora``), LoRA rank / alpha / dropout /
                 targets, trained submodules
``data``         prompt files, prompts per step (M), group size (K), encoding cache
``sampler``      schedule, SDE kernel, noise level, guidance, which steps are trained
``reward``       reward components, weights, required components, per-scorer options, scoring overlapped with
                 the rollout
``advantage``    group normalization (std mode, eps, floor), component combination, clip
``train``        algorithm, optimizer, LR schedule, updates per batch, micro-batches
``eval``         held-out evaluation cadence and fixed noise seed
``checkpoint``   checkpoint cadence and retention
``distributed``  DDP / FSDP2 under torchrun: strategy, mixed-precision dtypes, activation checkpointing,
                 context parallelism (:mod:`flowforge.settings.distributed`)
``artifacts``    optional per-rollout trajectory sidecars
``metrics``      experiment trackers (JSONL always, TensorBoard, W&B) and the log-line cadence
``sft``          flow-matching supervised fine-tuning (``flowforge sft``)
===============  ==============================================================================
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flowforge.settings.distributed import DistributedConfig  # defined beside its context-parallel part
from flowforge.settings.schema import Checks, Section, fingerprint, to_dict

LR_SCHEDULES = ("constant", "linear", "cosine")
"""``train.lr_schedule`` values: the multiplier after warmup (:func:`flowforge.policy.lr_lambda`)."""
TRAINABLE_MODES = ("lora", "full", "module", "module+lora")
"""``lora.trainable`` values (``module``: full fine-tune of exactly the submodules ``lora.modules``; ``module+lora``:
those submodules in full and LoRA on ``lora.targets``, or the adapter's defaults, together)."""
LORA_MODES = ("lora", "module+lora")
"""``lora.trainable`` values that train LoRA adapters (``lora.rank`` / ``alpha`` / ``targets`` apply)."""
MODULE_MODES = ("module", "module+lora")
"""``lora.trainable`` values that train the submodules ``lora.modules`` in full (``lora.modules`` required)."""
SIGMA_SAMPLINGS = ("logit_normal", "uniform")
"""``sft.sigma_sampling`` values (:func:`flowforge.algorithms.schedules.sample_sigmas`)."""
TRACKERS = ("jsonl", "tensorboard", "wandb")
GUARD_ACTIONS = ("stop", "rollback")
"""``metrics.trackers`` values (:mod:`flowforge.train.trackers`). ``jsonl`` (``metrics.jsonl`` / ``eval.jsonl``) is
always written whether listed or not: the report, ``flowforge compare`` and resume read it."""
SEED_LIMIT = 2**32
"""``run.seed`` is in ``[0, SEED_LIMIT)``: the prompt sampler needs a non-negative seed and the per-step order
generator is seeded with ``seed * 7919 + step``, which must stay inside torch's 64-bit seed range."""
MAX_SAMPLER_STEPS = 1000
"""Most ``sampler.num_steps``: the families discretise sigma into 1000 training timesteps (SD3 / Wan feed
``1000 * sigma``), so a finer schedule repeats timesteps; a larger value is a typo that would take hours per
rollout."""


@dataclass(frozen=True)
class RunConfig(Section):
    section_name = "run"

    name: str = "run"
    output_dir: str = "runs"
    seed: int = 0
    num_threads: int | str = 0  # 0 = leave torch's default; "auto": the faster of it and 1, measured at start-up
    device: str = "cpu"

    def problems(self) -> list[str]:
        c = Checks(self)
        # the run directory is output_dir/name: a name with a separator, "..", or an absolute path would put it
        # somewhere else (and a later cleanup would act there)
        c.require(self.name not in ("", ".", "..") and not any(ch in self.name for ch in "/\\\0"),
                  f"run.name={self.name!r} must be one directory name (no '/', not empty, '.' or '..'); put the "
                  "parent directories in run.output_dir")
        c.require(self.output_dir != "", "run.output_dir='' is empty; give a directory (e.g. runs)")
        c.require(0 <= self.seed < SEED_LIMIT, f"run.seed={self.seed} must be in [0, 2**32)")
        c.require(self.num_threads == "auto" or (isinstance(self.num_threads, int) and self.num_threads >= 0),
                  f"run.num_threads={self.num_threads!r} must be >= 0 (0: torch's default) or 'auto' (the faster of "
                  "torch's default and 1 thread, measured at start-up)")
        c.require(bool(self.device.strip()), "run.device='' is empty; give cpu, cuda, cuda:N or mps")
        return c.problems


@dataclass(frozen=True)
class ModelConfig(Section):
    section_name = "model"

    adapter: str = "sd3"  # a registered family or "pkg.module:Class"
    path: str = "demo:base"  # local diffusers directory, hub id, or "demo:base"
    dtype: str = "float32"  # dtype of the frozen weights and forwards; trainable weights stay fp32
    height: int = 32
    width: int = 32
    frames: int | None = None
    task: str = "t2i"

    def problems(self) -> list[str]:
        c = Checks(self)
        c.positive("height", "width", "frames")
        c.require(bool(self.path.strip()), "model.path='' is empty; give a local diffusers directory, a Hub id "
                                          "(org/name) or demo:base")
        return c.problems


@dataclass(frozen=True)
class LoraConfig(Section):
    section_name = "lora"

    trainable: str = "lora"  # "lora" | "full" | "module" | "module+lora" (TRAINABLE_MODES)
    rank: int | None = None  # None: 8 under LoRA (LORA_MODES); must stay None under "full" / "module"
    alpha: float | None = None  # None: equal to the rank
    dropout: float = 0.0
    targets: tuple[str, ...] | None = None  # None: the adapter's default attention projections
    modules: tuple[str, ...] | None = None  # MODULE_MODES: exact submodule paths trained in full

    @property
    def resolved_rank(self) -> int:
        return 8 if self.rank is None else self.rank

    @property
    def resolved_alpha(self) -> float:
        return float(self.resolved_rank if self.alpha is None else self.alpha)

    def problems(self) -> list[str]:
        c = Checks(self)
        c.choice("trainable", TRAINABLE_MODES)
        # Dropout makes the replayed forward a different function from the rollout's.
        c.require(self.dropout == 0, f"lora.dropout={self.dropout}: dropout in the trained policy makes rollout and "
                                     "replay different policies (the first ratio would not be 1); set it to 0")
        lora_modes = " or ".join(repr(m) for m in LORA_MODES)
        c.require(not (self.trainable not in LORA_MODES and (self.rank is not None or self.alpha is not None
                                                             or self.targets is not None)),
                  f"lora.trainable={self.trainable!r} but lora.rank / lora.alpha / lora.targets are set: they go with "
                  f"lora.trainable={lora_modes}; either train LoRA or remove the LoRA keys")
        if self.trainable in LORA_MODES:
            c.require(self.rank is None or self.rank >= 1, f"lora.rank={self.rank} must be >= 1 with "
                                                           f"lora.trainable={self.trainable!r}")
            c.require(self.alpha is None or self.alpha > 0, f"lora.alpha={self.alpha} must be > 0")
        c.require((self.trainable in MODULE_MODES) == bool(self.modules) and all(m.strip() for m in self.modules or ()),
                  f"lora.modules={list(self.modules or ())} goes with lora.trainable="
                  f"{' or '.join(repr(m) for m in MODULE_MODES)} (and only with them; lora.trainable="
                  f"{self.trainable!r} here): exact submodule paths such as latent_state_rollout.transition")
        c.require(self.targets is None or all(t.strip() for t in self.targets),
                  f"lora.targets={list(self.targets or ())} holds an empty name; give module names such as "
                  "attn.to_q")
        return c.problems


@dataclass(frozen=True)
class DataConfig(Section):
    section_name = "data"

    prompts: str = "demo:train"  # JSONL in the unified schema, or "demo:train"
    eval_prompts: str = "demo:eval"
    prompts_per_step: int = 4  # M
    group_size: int = 8  # K candidates per prompt
    cache_dir: str = ".cache/flowforge"

    def problems(self) -> list[str]:
        c = Checks(self)
        c.positive("prompts_per_step", "group_size")
        return c.problems


MODEL_OPTIONS = ("audio_guidance_scale", "guidance_rescale", "audio_guidance_rescale", "frame_rate")  # per family


@dataclass(frozen=True)
class SamplerConfig(Section):
    section_name = "sampler"

    num_steps: int = 10
    schedule: str = "static"  # "static" | "dynamic" | "wan"
    shift: float = 3.0
    mu: float | None = None  # dynamic shift; None with schedule "dynamic" = computed from the resolution
    sde_kind: str = "sde"  # "sde" | "dance" | "cps" | "ode"
    noise_level: float = 0.7  # eta
    guidance_scale: float = 1.0  # whether CFG runs is the family's guidance rule (AdapterMixin.guidance_use)
    negative_prompt: str | None = None  # CFG's unconditional prompt, used when the pipeline runs CFG; None: the model's
    trained_indices: tuple[int, ...] | None = None
    num_sde_steps: int = 3
    sde_window: tuple[float, float] = (0.0, 1.0)
    sde_pool: tuple[int, ...] | None = None  # resample trained steps from this pool every rollout
    batch_size: int | None = None  # rollout chunk size; None = train.micro_batch_size
    # read by adapters listing them in `sampler_options` (LTX-2); None: the model pipeline's default
    audio_guidance_scale: float | None = None  # audio CFG scale (LTX-2: 7.0)
    guidance_rescale: float | None = None  # CFG rescale in [0, 1] (LTX-2: 0.7); audio_guidance_rescale: audio's
    audio_guidance_rescale: float | None = None
    frame_rate: float | None = None  # video frames per second (LTX-2: 24)

    @property
    def model_options(self) -> dict[str, float]:
        """The set :data:`MODEL_OPTIONS` keys (:func:`flowforge.models.set_sampler_options` applies them)."""
        return {k: getattr(self, k) for k in MODEL_OPTIONS if getattr(self, k) is not None}

    def problems(self) -> list[str]:
        c = Checks(self)
        c.positive("batch_size", "frame_rate")
        for key in ("guidance_rescale", "audio_guidance_rescale"):
            value = getattr(self, key)
            c.require(value is None or 0.0 <= value <= 1.0, f"sampler.{key}={value} must be in [0, 1]")
        c.positive("noise_level", "num_sde_steps", "audio_guidance_scale", allow_zero=True)
        if not 2 <= self.num_steps <= MAX_SAMPLER_STEPS:
            c.problems.append(f"sampler.num_steps={self.num_steps} must be >= 2" if self.num_steps < 2 else
                              f"sampler.num_steps={self.num_steps} must be <= {MAX_SAMPLER_STEPS} (the models "
                              "discretise sigma into 1000 timesteps)")
            return c.problems
        n = self.num_steps
        for name, values in (("sampler.trained_indices", self.trained_indices), ("sampler.sde_pool", self.sde_pool)):
            for i in values or ():
                if not 0 <= i < n:
                    c.problems.append(f"{name} entry {i} is outside [0, {n}) (sampler.num_steps={n})")
                elif i == n - 1:  # sigma_next = 0: the transition has no noise, so no log-prob
                    c.problems.append(f"{name} entry {i} is the last step (sigma_next = 0): its transition is "
                                      f"degenerate and never trained; allowed 0..{n - 2}")
        return c.problems


@dataclass(frozen=True)
class RewardConfig(Section):
    """Reward components. ``device`` is kept for compatibility but not read: scorers run where the media are (the
    run device) unless a scorer takes its own ``device`` option (``reward.options.<name>.device``)."""

    section_name = "reward"

    weights: dict[str, float] = field(default_factory=lambda: {"digit": 1.0})
    required: tuple[str, ...] = ()  # components that must never be NaN
    options: dict[str, dict[str, Any]] = field(default_factory=dict)  # per-component scorer kwargs
    batch_size: int = 64
    device: str = "cpu"  # not read (see the class docstring)
    overlap: bool = False  # send each group to the group scorers (judge) while later groups are still rolled out

    def problems(self) -> list[str]:
        c = Checks(self)
        c.positive("batch_size")
        for name, opts in self.options.items():
            value = opts.get("max_concurrency", 1) if isinstance(opts, Mapping) else 1
            c.require(not isinstance(value, bool) and isinstance(value, int) and value >= 1,
                      f"reward.options.{name}.max_concurrency={value!r} must be an int >= 1 (calls in flight at once)")
        for name in self.required:
            c.require(name in self.weights, f"reward.required lists {name!r} but reward.weights has no weight for it")
        if not self.weights:
            c.problems.append("reward.weights is empty: give at least one component")
        elif all(w == 0 for w in self.weights.values()):
            c.problems.append("reward.weights are all 0: the reward is constant")
        return c.problems


@dataclass(frozen=True)
class AdvantageConfig(Section):
    section_name = "advantage"

    std_mode: str = "group"  # "group" | "batch" | "none"
    eps: float = 1e-4
    std_floor: float = 0.0
    combine: str = "weighted_sum"  # "weighted_sum" | "per_component"
    clip: float = 5.0

    def problems(self) -> list[str]:
        c = Checks(self)
        c.positive("eps", "clip")
        c.positive("std_floor", allow_zero=True)
        return c.problems


@dataclass(frozen=True)
class TrainConfig(Section):
    section_name = "train"

    algorithm: str = "grpo"
    steps: int = 60
    lr: float = 3e-4
    lr_schedule: str = "constant"  # "constant" | "linear" | "cosine" (after warmup)
    warmup_steps: int = 0  # counted in optimizer steps
    weight_decay: float = 1e-4
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    num_updates_per_batch: int = 2
    micro_batch_size: int = 8
    allow_unit_ratio: bool = False  # allow num_updates_per_batch = 1 with a clipped objective
    max_staleness: int = 0  # > 0: step k+1 rolls out (rollout workers) while step k updates; GRPO family only
    resume: str | None = None  # "auto" (the newest committed checkpoint, else from scratch), "must" (as auto,
    # refused when there is none) or a checkpoint path

    def problems(self) -> list[str]:
        c = Checks(self)
        c.choice("lr_schedule", LR_SCHEDULES)
        c.positive("lr", "micro_batch_size", "num_updates_per_batch", "grad_clip", "adam_eps")
        c.positive("steps", "warmup_steps", "weight_decay", "max_staleness", allow_zero=True)
        c.require(all(0 <= b < 1 for b in self.adam_betas),
                  f"train.adam_betas={list(self.adam_betas)} must both be in [0, 1) (e.g. [0.9, 0.999])")
        return c.problems


@dataclass(frozen=True)
class EvalConfig(Section):
    section_name = "eval"

    every: int = 10  # 0 = only at the start and the end
    seed: int = 1234
    samples_per_prompt: int = 2  # candidates per eval prompt (within-group diversity needs >= 2)
    scorers: tuple[str, ...] = ()  # eval-only scorers beside the reward components (e.g. digit_eval)
    max_prompts: int | None = None
    batch_size: int = 32
    # every run: held-out groups (first prompts) a paid scorer (vlm_judge, paid=True) scores per eval, billed;
    # 0: evaluation uses the free scorers only
    teacher_groups: int = 0

    def problems(self) -> list[str]:
        c = Checks(self)
        c.positive("batch_size", "samples_per_prompt", "max_prompts")
        c.positive("teacher_groups", allow_zero=True)
        c.positive("every", allow_zero=True)
        return c.problems


@dataclass(frozen=True)
class CheckpointConfig(Section):
    section_name = "checkpoint"

    every: int = 0  # 0 = never
    keep: int = 3

    def problems(self) -> list[str]:
        c = Checks(self)
        c.positive("every", allow_zero=True)
        c.require(self.keep >= 1, f"checkpoint.keep={self.keep} must be >= 1")
        return c.problems


@dataclass(frozen=True)
class ArtifactsConfig(Section):
    section_name = "artifacts"

    root: str | None = None  # write per-rollout trajectory sidecars under this directory
    keep: int = 2  # rollouts kept

    def problems(self) -> list[str]:
        c = Checks(self)
        c.require(self.keep >= 1, f"artifacts.keep={self.keep} must be >= 1")
        return c.problems


@dataclass(frozen=True)
class WandbSettings:
    """``metrics.wandb``: the W&B run's ``wandb.init`` arguments. A key left unset falls back to W&B's environment
    variable (``WANDB_PROJECT`` -- then ``flowforge`` --, ``WANDB_NAME`` -- then ``run.name`` --, ``WANDB_ENTITY``,
    ``WANDB_RUN_GROUP``, ``WANDB_TAGS``, ``WANDB_NOTES``); ``WANDB_MODE`` / ``WANDB_DIR`` stay environment-only."""

    project: str | None = None
    entity: str | None = None  # team or user; None: the logged-in default
    name: str | None = None  # the run's display name
    group: str | None = None
    tags: tuple[str, ...] = ()
    notes: str | None = None


@dataclass(frozen=True)
class MetricsConfig(Section):
    """Where the rank-0 process logs: ``trackers`` beside the always-written JSONL files (``tensorboard`` under
    ``<run>/tb/``, ``wandb`` through the ``wandb`` library, ``pip install flowforge[wandb]``, configured by
    ``wandb`` (:class:`WandbSettings`: project, name, tags, ...; W&B's own environment variables such as
    ``WANDB_MODE=offline`` apply), and ``log_every``: a log line with the key metrics every that many steps when
    the progress bar is off (``--no-progress``; 0 = never)."""

    section_name = "metrics"

    trackers: tuple[str, ...] = ("jsonl", "tensorboard")
    log_every: int = 10
    wandb: WandbSettings = field(default_factory=WandbSettings)

    def problems(self) -> list[str]:
        c = Checks(self)
        for name in self.trackers:
            c.require(name in TRACKERS, f"metrics.trackers lists {name!r}; allowed: {list(TRACKERS)}")
        c.positive("log_every", allow_zero=True)
        return c.problems


@dataclass(frozen=True)
class GuardConfig(Section):
    """Reward-hacking guard (``flowforge.train.guard``): when the held-out ``judge`` (an eval metric of a model other
    than the reward; None = the first of ``eval.scorers``) falls at ``patience`` consecutive evaluations by more than
    ``min_delta`` each while the training ``reward`` rises over those steps, ``stop`` the run, or ``rollback`` to the
    weights of the best evaluation and stop. ``patience`` 0 = off."""

    section_name = "guard"

    patience: int = 0
    action: str = "stop"  # "stop" | "rollback"
    judge: str | None = None  # e.g. "eval/digit_eval"
    reward: str = "reward/total_mean"  # the logged training metric that must rise
    min_delta: float = 0.0

    def problems(self) -> list[str]:
        c = Checks(self)
        c.choice("action", GUARD_ACTIONS)
        c.positive("patience", "min_delta", allow_zero=True)
        c.require(self.judge is None or self.judge.startswith("eval/"),
                  f"guard.judge={self.judge!r} must name an eval metric (eval/<scorer>, e.g. eval/digit_eval)")
        return c.problems


@dataclass(frozen=True)
class SFTConfig(Section):
    """Flow-matching SFT (:func:`flowforge.train.sft.run_sft`); the seed, threads, prompts, cache and the eval
    sampler come from ``run``, ``data`` and ``sampler``."""

    section_name = "sft"

    steps: int = 1000
    batch_size: int = 64
    lr: float = 1e-3  # AdamW, linear warmup, then lr_schedule
    warmup_steps: int = 50
    lr_schedule: str = "constant"  # after warmup: "constant" | "linear" | "cosine" to 0 at `steps` (as train's)
    eval_every: int = 100  # DigitEval at step 0, every eval_every steps and at the end (0: start and end)
    cond_dropout: float = 0.1  # drop the text condition this often (keeps guidance > 1 usable)
    output: str = "runs/sft-base"
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max gradient norm; 0 = no clipping
    sigma_sampling: str = "logit_normal"  # "logit_normal" (SD3) | "uniform"
    eval_samples_per_prompt: int = 1
    eval_seed: int = 1234  # fixed eval noise
    save_checkpoints: bool = True  # a loadable transformer under output/checkpoints/ at every evaluation
    # world models only: the flow-matching loss weighs the frame's last paddle_rows rows (Breakout's paddle) by
    # paddle_weight, the others by 1 (normalised to mean 1; algorithms.losses.anchors.row_weights)
    paddle_rows: int = 2
    paddle_weight: float = 1.0
    coupling_gate_init: float = 0.0  # world models only: every coupling gate's value before the first step
    # world models only: this share of clips gives the direct action path (modulation, context) the null actions,
    # so their actions reach the video only through B -> coupling (0: every clip uses both paths, as before)
    direct_action_dropout: float = 0.0

    def problems(self) -> list[str]:
        c = Checks(self)
        c.positive("batch_size", "lr", "eval_samples_per_prompt", "paddle_weight")
        c.positive("paddle_rows", allow_zero=True)
        c.require(math.isfinite(self.coupling_gate_init),
                  f"sft.coupling_gate_init={self.coupling_gate_init!r} must be a finite number")
        c.positive("steps", "warmup_steps", "eval_every", "weight_decay", "grad_clip", allow_zero=True)
        c.require(0.0 <= self.cond_dropout < 1.0, f"sft.cond_dropout={self.cond_dropout} must be in [0, 1)")
        c.require(0.0 <= self.direct_action_dropout <= 1.0,
                  f"sft.direct_action_dropout={self.direct_action_dropout!r} must be in [0, 1]")
        c.choice("sigma_sampling", SIGMA_SAMPLINGS)
        c.choice("lr_schedule", LR_SCHEDULES)
        return c.problems


HEAD_SECTIONS: tuple[type, ...] = (RunConfig, ModelConfig, LoraConfig, DataConfig, SamplerConfig, RewardConfig,
                                   AdvantageConfig, TrainConfig)
"""Base sections written before the algorithm sections (the order of a dumped config)."""
TAIL_SECTIONS: tuple[type, ...] = (EvalConfig, GuardConfig, CheckpointConfig, DistributedConfig, ArtifactsConfig,
                                   MetricsConfig, SFTConfig)
"""Base sections written after the algorithm sections."""


RESUME_NEUTRAL_KEYS: tuple[str, ...] = (
    "run.name", "run.output_dir",  # where the run is written, not what it computes
    "run.num_threads",  # CPU threads: a resource of the machine the run continues on (may change rounding only)
    "data.cache_dir",  # where encoded prompts are cached; the encodings are the same
    "data.eval_prompts", "eval",  # held-out evaluation: fixed noise of its own, never feeds the update
    "reward.device",  # not read (see RewardConfig)
    "reward.overlap",  # when groups are scored, not what: the same scores (tests/train/test_reward_overlap.py)
    "train.resume",  # how this invocation starts, not what it computes
    "checkpoint", "artifacts", "metrics",  # what is written or logged beside the run, and how much is kept
    "rollout",  # in-process or worker rollouts: bit-identical trajectories either way (tests/rollout/test_engine.py)
    "distributed.activation_checkpointing",  # recomputes activations to save memory; the values are the same
    "distributed.offload",  # where weights / AdamW states live; the same AdamW arithmetic (tests/test_offload.py)
    "sft",  # read by `flowforge sft` only
)
"""Config keys (dotted, or a whole section) that do not change what a resumed run computes: the config
fingerprint stored in a checkpoint (:func:`resume_fingerprint`) leaves them out, so changing them on resume is not
reported. ``train.steps`` is left out too unless the LR schedule decays over it (:func:`resume_neutral_keys`).
Everything else -- model, LoRA, prompts, sampler, reward, advantage, optimizer, the algorithm sections, seed,
device, distributed dtypes -- is in the fingerprint."""


def resume_neutral_keys(config: Mapping[str, Any]) -> tuple[str, ...]:
    """:data:`RESUME_NEUTRAL_KEYS` for ``config`` (a nested mapping, e.g. :func:`~flowforge.settings.to_dict` of a
    root config), plus ``train.steps`` when ``train.lr_schedule`` is ``constant``: with ``linear`` / ``cosine`` the
    LR at every step depends on the total number of steps, so a changed ``train.steps`` changes the run."""
    schedule = (config.get("train") or {}).get("lr_schedule", "constant")
    return RESUME_NEUTRAL_KEYS + (("train.steps",) if schedule == "constant" else ())


def resume_fingerprint(cfg: Any) -> str:
    """The fingerprint a checkpoint stores: :func:`~flowforge.settings.schema.fingerprint` of the root config
    ``cfg`` without its :func:`resume_neutral_keys`."""
    return fingerprint(cfg, resume_neutral_keys(to_dict(cfg)))
