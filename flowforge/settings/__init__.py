"""The lowest config layer (standard library + PyYAML only): the schema machinery and the base sections.

:mod:`flowforge.settings.schema` coerces YAML into typed frozen dataclasses and collects every problem;
:mod:`flowforge.settings.sections` holds the base sections. The root ``Config``, which adds the sections declared
by the registered objectives, is assembled in :mod:`flowforge.config`.
"""

from flowforge.settings.schema import (ALLOW_INF, Checks, ConfigError, Section, build, config_diff, dump,
                                       fingerprint, flatten, make_root, merge, nonfinite_problems, parse_overrides,
                                       read_yaml, Replace, to_dict, without)
from flowforge.settings.sections import (HEAD_SECTIONS, LORA_MODES, LR_SCHEDULES, MAX_SAMPLER_STEPS, MODULE_MODES,
                                         RESUME_NEUTRAL_KEYS, SEED_LIMIT, SIGMA_SAMPLINGS, TAIL_SECTIONS,
                                         TRAINABLE_MODES,
                                         AdvantageConfig, ArtifactsConfig, CheckpointConfig, DataConfig,
                                         DistributedConfig, EvalConfig, LoraConfig, ModelConfig, RewardConfig,
                                         RunConfig, SamplerConfig, SFTConfig, TrainConfig, resume_fingerprint,
                                         resume_neutral_keys)

__all__ = [
    "ALLOW_INF", "Checks", "ConfigError", "Section", "build", "config_diff", "dump", "fingerprint", "flatten",
    "make_root", "merge", "nonfinite_problems", "parse_overrides", "read_yaml", "Replace", "to_dict", "without",
    "HEAD_SECTIONS", "LORA_MODES", "LR_SCHEDULES", "MODULE_MODES", "MAX_SAMPLER_STEPS", "RESUME_NEUTRAL_KEYS",
    "SEED_LIMIT", "SIGMA_SAMPLINGS", "TAIL_SECTIONS", "TRAINABLE_MODES", "resume_fingerprint", "resume_neutral_keys",
    "AdvantageConfig", "ArtifactsConfig", "CheckpointConfig", "DataConfig", "DistributedConfig", "EvalConfig",
    "LoraConfig", "ModelConfig", "RewardConfig", "RunConfig", "SamplerConfig", "SFTConfig", "TrainConfig",
]
