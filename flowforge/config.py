"""Typed configuration: frozen dataclasses per section, YAML files, ``section.key=value`` overrides.

Precedence is defaults < YAML < CLI. Loading checks *shape* (unknown keys, wrong types) and collects every such
problem into one :class:`ConfigError`; *meaning* (allowed algorithm names, step indices, divisibility, ...) is checked
by :mod:`flowforge.train.preflight`, which also collects every violation before any model loads.

This module imports no torch: configs are validated and dumped without touching a model.

Sections and who reads them (each stage of the loop receives only its own section):

==============  ==============================================================================
``run``         run directory, seed, threads, device
``model``       adapter name or ``pkg.module:Class``, weights path, dtype, resolution
``lora``        trainable mode (``lora`` | ``full``), LoRA rank / alpha / dropout / targets
``data``        prompt files, prompts per step (M), group size (K), encoding cache
``sampler``     schedule, SDE kernel, noise level, guidance, which steps are trained
``reward``      reward components, weights, required components
``advantage``   group normalization (std mode, eps, floor), component combination, clip
``train``       algorithm, optimizer, LR schedule, updates per batch, micro-batches
``grpo``        FlowGRPO clip range and KL weight (also used by ``grpo_guard``)
``grpo_guard``  GRPO-Guard per-step reweighting
``forward``     forward-process objectives (nft, awm, dgpo, dpo, crd): sampler, sigma visits, old-policy decay
``nft``         DiffusionNFT beta, reward transform, guard, EMA
``awm``         Advantage Weighted Matching clip and weighting
``dgpo``        DGPO beta and mode
``dpo``         Diffusion-DPO beta
``crd``         Centered Reward Distillation beta, loss type, teacher
``eval``        held-out evaluation cadence and fixed noise seed
``checkpoint``  checkpoint cadence and retention
``distributed`` DDP / FSDP2 under torchrun: strategy, mixed-precision dtypes, activation checkpointing
``artifacts``   optional per-rollout trajectory sidecars
``sft``         flow-matching supervised fine-tuning (``flowforge sft``)
==============  ==============================================================================
"""

from __future__ import annotations

import dataclasses
import hashlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml


class ConfigError(ValueError):
    """A config could not be loaded or is invalid. ``problems`` lists every violation found."""

    def __init__(self, problems: Sequence[str], header: str = "invalid config"):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{header} ({len(self.problems)} problem{'s' * (len(self.problems) != 1)}):\n{lines}")


@dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    output_dir: str = "runs"
    seed: int = 0
    num_threads: int = 0  # 0 = leave torch's default
    device: str = "cpu"


@dataclass(frozen=True)
class ModelConfig:
    adapter: str = "sd3"  # a registered family or "pkg.module:Class"
    path: str = "demo:base"  # local diffusers directory, hub id, or "demo:base"
    dtype: str = "float32"  # dtype of the frozen weights and forwards; trainable weights stay fp32
    height: int = 32
    width: int = 32
    frames: int | None = None
    task: str = "t2i"


@dataclass(frozen=True)
class LoraConfig:
    trainable: str = "lora"  # "lora" | "full"
    rank: int | None = None  # None: 8 under "lora"; must stay None under "full"
    alpha: float | None = None  # None: equal to the rank
    dropout: float = 0.0
    targets: tuple[str, ...] | None = None  # None: the adapter's default attention projections

    @property
    def resolved_rank(self) -> int:
        return 8 if self.rank is None else self.rank

    @property
    def resolved_alpha(self) -> float:
        return float(self.resolved_rank if self.alpha is None else self.alpha)


@dataclass(frozen=True)
class DataConfig:
    prompts: str = "demo:train"  # JSONL in the unified schema, or "demo:train"
    eval_prompts: str = "demo:eval"
    prompts_per_step: int = 4  # M
    group_size: int = 8  # K candidates per prompt
    cache_dir: str = ".cache/flowforge"


@dataclass(frozen=True)
class SamplerConfig:
    num_steps: int = 10
    schedule: str = "static"  # "static" | "dynamic" | "wan"
    shift: float = 3.0
    mu: float | None = None  # dynamic shift; None with schedule "dynamic" = computed from the resolution
    sde_kind: str = "sde"  # "sde" | "dance" | "cps" | "ode"
    noise_level: float = 0.7  # eta
    guidance_scale: float = 1.0
    trained_indices: tuple[int, ...] | None = None
    num_sde_steps: int = 3
    sde_window: tuple[float, float] = (0.0, 1.0)
    sde_pool: tuple[int, ...] | None = None  # resample trained steps from this pool every rollout
    batch_size: int | None = None  # rollout chunk size; None = train.micro_batch_size


@dataclass(frozen=True)
class RewardConfig:
    weights: dict[str, float] = field(default_factory=lambda: {"digit": 1.0})
    required: tuple[str, ...] = ()  # components that must never be NaN
    options: dict[str, dict[str, Any]] = field(default_factory=dict)  # per-component scorer kwargs
    batch_size: int = 64
    device: str = "cpu"


@dataclass(frozen=True)
class AdvantageConfig:
    std_mode: str = "group"  # "group" | "batch" | "none"
    eps: float = 1e-4
    std_floor: float = 0.0
    combine: str = "weighted_sum"  # "weighted_sum" | "per_component"
    clip: float = 5.0


@dataclass(frozen=True)
class TrainConfig:
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
    resume: str | None = None  # "auto" or a checkpoint path


@dataclass(frozen=True)
class GRPOConfig:
    clip_low: float = 1e-4
    clip_high: float | None = None
    kl_weight: float = 0.0  # transition-mean KL to the reference policy (flow_grpo's beta)


@dataclass(frozen=True)
class ForwardConfig:
    """Shared by the forward-process objectives (nft, awm, dgpo, dpo, crd): they train on noised final samples."""

    sampler: str = "ode"  # rollout kernel: "sde" | "dance" | "cps" | "ode" (only the final x0 is kept)
    sample_with: str = "old"  # policy that samples: "old" (off-policy, DiffusionNFT's default) | "live"
    sigma_mode: str = "uniform_schedule"  # "uniform_schedule" (one schedule sigma per visit) | "full_schedule"
    inner_epochs: int = 1
    decay_rate: float = 0.001  # old <- decay * old + (1 - decay) * live, decay = min(decay_rate * n, decay_max)
    decay_max: float = 0.5


@dataclass(frozen=True)
class NFTConfig:
    beta: float = 1.0
    adv_clip: float = 5.0
    loss_mode: str = "reference"  # "reference" (adaptive x0 weighting) | "paper_velocity_mse"
    reward_transform: str = "reference"  # "reference" (clipped group advantages) | "absolute"
    std_floor: float = 0.0  # absolute transform: Z = adv_clip * max(std, std_floor)
    std_scope: str = "group"  # absolute transform: std per "group" or over the whole "batch"
    guard: bool = False  # skip groups that tie, spread < guard_min_spread, or best < guard_min_best
    guard_min_spread: float = 0.0
    guard_min_best: float | None = None
    ema_decay: float = 0.0  # > 0: keep an eval EMA of live with this decay
    ref_weight: float = 0.0  # velocity-MSE penalty to the reference policy


@dataclass(frozen=True)
class AWMConfig:
    clip_low: float = 1e-4
    clip_high: float | None = None
    weighting: str = "ghuber"  # "uniform" | "t" | "t**2" | "huber" | "ghuber"
    ghuber_power: float = 0.25
    adv_max: float | None = None
    kl_weight: float = 0.0  # velocity-MSE KL to the reference policy


@dataclass(frozen=True)
class DGPOConfig:
    beta: float = 100.0
    mode: str = "reference"  # "reference" (official surrogate) | "paper"
    kl_weight: float = 0.0


@dataclass(frozen=True)
class DPOConfig:
    beta: float = 2000.0


@dataclass(frozen=True)
class CRDConfig:
    beta: float = 1.0
    adv_clip: float = 5.0
    loss_type: str = "mse"  # "mse" | "bce"
    kl_beta: float = 0.0  # anchor to the CFG-guided reference teacher
    teacher_guidance: float = 1.0


@dataclass(frozen=True)
class GuardConfig:
    step_weight: str = "inv_dt"  # GRPO-Guard per-step reweighting: "inv_dt" | "none"


@dataclass(frozen=True)
class EvalConfig:
    every: int = 10  # 0 = only at the start and the end
    seed: int = 1234
    samples_per_prompt: int = 2  # candidates per eval prompt (within-group diversity needs >= 2)
    scorers: tuple[str, ...] = ()  # eval-only scorers beside the reward components (e.g. digit_eval)
    max_prompts: int | None = None
    batch_size: int = 32


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # 0 = never
    keep: int = 3


@dataclass(frozen=True)
class DistributedConfig:
    strategy: str = "ddp"  # "ddp" | "fsdp"; used when launched by torchrun with WORLD_SIZE > 1
    param_dtype: str = "float32"  # FSDP2 MixedPrecisionPolicy param dtype ("bfloat16" on GPUs)
    reduce_dtype: str = "float32"
    activation_checkpointing: bool = False


@dataclass(frozen=True)
class ArtifactsConfig:
    root: str | None = None  # write per-rollout trajectory sidecars under this directory
    keep: int = 2  # rollouts kept


@dataclass(frozen=True)
class SFTConfig:
    steps: int = 1000
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 50
    eval_every: int = 100
    cond_dropout: float = 0.1  # drop the text condition this often (keeps guidance > 1 usable)
    output: str = "runs/sft-base"


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    grpo_guard: GuardConfig = field(default_factory=GuardConfig)
    forward: ForwardConfig = field(default_factory=ForwardConfig)
    nft: NFTConfig = field(default_factory=NFTConfig)
    awm: AWMConfig = field(default_factory=AWMConfig)
    dgpo: DGPOConfig = field(default_factory=DGPOConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    crd: CRDConfig = field(default_factory=CRDConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    artifacts: ArtifactsConfig = field(default_factory=ArtifactsConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)


# ----------------------------------------------------------------------------------------------- coercion


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str, problems: list[str]) -> Any:
    """Coerce a YAML value to ``tp``; append a problem (and return None) when it does not fit."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(value, inner[0], where, problems)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            problems.append(f"{where}: expected a mapping of {sorted(f.name for f in dataclasses.fields(tp))}, "
                            f"got {type(value).__name__}")
            return None
        return _build(tp, value, where, problems)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            problems.append(f"{where}: expected a list, got {type(value).__name__} {value!r}")
            return None
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{where}[{i}]", problems) for i, v in enumerate(value))
        if len(value) != len(args):
            problems.append(f"{where}: expected a list of {len(args)} items, got {len(value)}")
            return None
        return tuple(_coerce(v, a, f"{where}[{i}]", problems) for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, Mapping):
            problems.append(f"{where}: expected a mapping, got {type(value).__name__} {value!r}")
            return None
        kt, vt = args
        return {_coerce(k, kt, f"{where} key", problems): _coerce(v, vt, f"{where}.{k}", problems)
                for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    problems.append(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return None


def _build(cls: type, data: Mapping[str, Any], where: str, problems: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            problems.append(f"unknown key '{where + '.' if where else ''}{key}'; allowed: {', '.join(names)}")
    kwargs = {}
    for name in names:
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], f"{where + '.' if where else ''}{name}", problems)
    return cls(**kwargs)


def _merge(base: dict, override: Mapping) -> dict:
    out = dict(base)
    for k, v in override.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_overrides(overrides: Sequence[str]) -> tuple[dict, list[str]]:
    """``["train.lr=1e-4", "sampler.trained_indices=[1,2]"]`` -> nested dict; values are YAML literals."""
    nested: dict = {}
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            problems.append(f"override '{item}': expected section.key=value")
            continue
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            problems.append(f"override '{item}': value is not a YAML literal ({exc.__class__.__name__})")
            continue
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                problems.append(f"override '{item}': '{part}' is set to a value and a section at once")
                break
        else:
            node[parts[-1]] = value
    return nested, problems


def from_dict(data: Mapping[str, Any]) -> Config:
    """Build a :class:`Config` from a nested mapping; raises :class:`ConfigError` listing every problem."""
    problems: list[str] = []
    if not isinstance(data, Mapping):
        raise ConfigError([f"top level: expected a mapping of sections, got {type(data).__name__}"])
    cfg = _build(Config, data, "", problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults < YAML file at ``path`` < ``section.key=value`` overrides.

    Raises:
        ConfigError: unreadable YAML, unknown keys (with the allowed names) or wrong types — all at once.
    """
    data: dict = {}
    problems: list[str] = []
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError([f"cannot read config file {path}: {exc.strerror}"]) from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError([f"{path} is not valid YAML: {exc}"]) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError([f"{path}: expected a mapping of sections at the top level"])
        data = loaded or {}
    nested, override_problems = parse_overrides(overrides)
    problems += override_problems
    data = _merge(data, nested)
    try:
        cfg = from_dict(data)
    except ConfigError as exc:
        problems += exc.problems
    if problems:
        raise ConfigError(problems)
    return cfg


def to_dict(cfg: Any) -> Any:
    """Plain nested dict / list form of a config (tuples become lists), for YAML and fingerprints."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML; ``from_dict(yaml.safe_load(dump_config(c))) == c``."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def fingerprint(cfg: Any) -> str:
    """sha256 of the canonical YAML of a config or section (first 16 hex digits)."""
    return hashlib.sha256(yaml.safe_dump(to_dict(cfg), sort_keys=True).encode()).hexdigest()[:16]


def replace(cfg: Config, **sections: Mapping[str, Any]) -> Config:
    """Copy of ``cfg`` with some keys of some sections changed, e.g. ``replace(cfg, train={"steps": 2})``."""
    return from_dict(_merge(to_dict(cfg), sections))
