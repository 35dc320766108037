"""The lowest config layer (standard library + PyYAML only): the schema machinery and the base sections.

:mod:`flowforge.settings.schema` coerces YAML into typed frozen dataclasses and collects every problem;
:mod:`flowforge.settings.sections` holds the base sections. The root ``Config``, which adds the sections declared
by the registered objectives, is assembled in :mod:`flowforge.config`.
"""

from flowforge.settings.schema import (Checks, ConfigError, Section, build, dump, fingerprint, make_root, merge,
                                       parse_overrides, read_yaml, to_dict)
from flowforge.settings.sections import (HEAD_SECTIONS, LR_SCHEDULES, SIGMA_SAMPLINGS, TAIL_SECTIONS,
                                         TRAINABLE_MODES, AdvantageConfig, ArtifactsConfig, CheckpointConfig,
                                         DataConfig, DistributedConfig, EvalConfig, LoraConfig, ModelConfig,
                                         RewardConfig, RunConfig, SamplerConfig, SFTConfig, TrainConfig)

__all__ = [
    "Checks", "ConfigError", "Section", "build", "dump", "fingerprint", "make_root", "merge", "parse_overrides",
    "read_yaml", "to_dict",
    "HEAD_SECTIONS", "LR_SCHEDULES", "SIGMA_SAMPLINGS", "TAIL_SECTIONS", "TRAINABLE_MODES",
    "AdvantageConfig", "ArtifactsConfig", "CheckpointConfig", "DataConfig", "DistributedConfig", "EvalConfig",
    "LoraConfig", "ModelConfig", "RewardConfig", "RunConfig", "SamplerConfig", "SFTConfig", "TrainConfig",
]
