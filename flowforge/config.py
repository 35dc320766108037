"""The root config: the base sections plus every section the registered objectives declare.

Precedence is defaults < YAML < ``section.key=value`` overrides. Loading checks each section's *shape and values*
(unknown keys with the allowed names, wrong types, values a section refuses) and collects every such problem into
one :class:`ConfigError`; rules across sections and names owned by other modules (algorithm, kernel, adapter,
scorers, trained-step transition stds, batch divisibility, prompt files, ...) are checked by
:mod:`flowforge.train.preflight`, which also collects every violation before any model loads.

The schema machinery and the base sections live in :mod:`flowforge.settings` (standard library + PyYAML); the
algorithm sections (``grpo``, ``grpo_guard``, ``forward``, ``nft``, ``awm``, ``dgpo``, ``dpo``, ``crd``) live beside
their objectives in :mod:`flowforge.objectives` and are gathered from :data:`flowforge.objectives.OBJECTIVES`, so
adding an algorithm changes nothing here. A dumped config lists ``run`` ... ``train``, ``rollout``, then the
algorithm sections in registry order, then ``eval`` ... ``sft``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flowforge.objectives.registry import objective_sections
from flowforge.runtime.imports import add_import_dirs
from flowforge.settings import schema
from flowforge.settings.rollout import RolloutConfig
from flowforge.settings.schema import ConfigError, Section, fingerprint, parse_overrides, to_dict
from flowforge.settings.sections import (HEAD_SECTIONS, TAIL_SECTIONS, AdvantageConfig, ArtifactsConfig,
                                         CheckpointConfig, DataConfig, DistributedConfig, EvalConfig, LoraConfig,
                                         ModelConfig, RewardConfig, RunConfig, SamplerConfig, SFTConfig, TrainConfig)

__all__ = [
    "Config", "ConfigError", "Section", "config_class", "from_dict", "load_config", "dump_config", "to_dict",
    "fingerprint", "replace", "parse_overrides",
    "RunConfig", "ModelConfig", "LoraConfig", "DataConfig", "SamplerConfig", "RewardConfig", "AdvantageConfig",
    "TrainConfig", "RolloutConfig", "EvalConfig", "CheckpointConfig", "DistributedConfig", "ArtifactsConfig",
    "SFTConfig",
]


def config_class(objectives: Mapping[str, type] | None = None) -> type:
    """A frozen root dataclass ``Config`` with the base sections and the sections declared by ``objectives``
    (default: :data:`flowforge.objectives.OBJECTIVES`), one field per section named by its ``section_name``.

    Raises:
        ValueError: two different section classes share a name.
    """
    extra = objective_sections(None if objectives is None else dict(objectives))
    return schema.make_root("Config", (*HEAD_SECTIONS, RolloutConfig, *extra, *TAIL_SECTIONS), module=__name__,
                            doc="A whole run's configuration: one frozen section per field (see flowforge.config).")


Config = config_class()


def from_dict(data: Mapping[str, Any]) -> Config:
    """Build a :class:`Config` from a nested mapping; raises :class:`ConfigError` listing every problem."""
    return schema.build(Config, data)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults < YAML file at ``path`` < ``section.key=value`` overrides. Loading a file makes its folder and the
    working directory importable (appended to ``sys.path``: :mod:`flowforge.runtime.imports`), so ``pkg.module:name``
    references find modules next to the config. An override's mapping value merges into
    the file's mapping (``reward.weights={remote: 1.0}`` keeps the file's other weights); ``key=!{...}`` replaces
    it (:func:`flowforge.settings.schema.parse_overrides`).

    Raises:
        ConfigError: unreadable YAML, unknown keys (with the allowed names), wrong types or values a section
            refuses (with the allowed values) — all at once.
    """
    data = schema.read_yaml(path) if path is not None else {}
    if path is not None:
        # `pkg.module:name` references (reward components, model.adapter) may live next to the config or in the
        # working directory: both stay importable for the process (why: flowforge.runtime.imports)
        add_import_dirs(Path(path).parent, Path.cwd())
    nested, problems = parse_overrides(overrides)
    try:
        cfg = from_dict(schema.merge(data, nested))
    except ConfigError as exc:
        problems += exc.problems
    if problems:
        raise ConfigError(problems)
    return cfg


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML; ``from_dict(yaml.safe_load(dump_config(c))) == c``."""
    return schema.dump(cfg)


def replace(cfg: Config, **sections: Mapping[str, Any]) -> Config:
    """Copy of ``cfg`` with some keys of some sections changed, e.g. ``replace(cfg, train={"steps": 2})``."""
    return from_dict(schema.merge(to_dict(cfg), sections))


def __getattr__(name: str) -> type:
    """The algorithm section classes by class name (``from flowforge.config import NFTConfig``, their import path
    before they moved beside their objectives in :mod:`flowforge.objectives`)."""
    for section in objective_sections():
        if section.__name__ == name:
            return section
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
