"""The run config: component dataclasses composed with OmegaConf, YAML files and dotlist overrides.

One job per module: ``schema`` (the dataclasses and ``RunConfig``), ``load`` (YAML files, overrides, the shape
limits and the one bounded reader of every YAML file a user names), ``validate`` (each block's bounds and the
checks that tie blocks together), ``registries`` (the registries a config names, asked through ``registry``, and the
modes that own knobs) and ``resume`` (the config as its records hold it, and what a resume may change). A config
fails one way: ``require(cond, key, message)`` raises ``ConfigError`` ("config error at '<key>': <message>").

Everything a caller needs is importable from here.
"""

from dcmdp.config.load import (MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH, MAX_CONFIG_NODES, UNIT_CLOSED_KEYS,
                               compose_with_problems, load_config, read_yaml_file, read_yaml_text, yaml_shape,
                               yaml_value)
from dcmdp.config.registries import MODE_SELECTORS, ModeSelector, mode_knobs, registry
from dcmdp.config.resume import (NOT_ON_RESUME, RESUMABLE_IN_BLOCKS, RESUME_KEYS, URI_KEYS, flatten, public_config,
                                 resume_conflicts, to_yaml)
from dcmdp.config.schema import (RENAMED_KEYS, CheckpointConfig, DistConfig, GuardConfig, RunConfig, TrackingConfig,
                                 nearest)
from dcmdp.config.validate import (INF_ALLOWED, MAX_BATCH_SAMPLES, MAX_BATCH_TOKENS, MAX_EVAL_SIZE,
                                   MAX_REWARD_TIMEOUT, MAX_SEED, MIN_REWARD_TIMEOUT, MIN_TEMPERATURE, NAME_MAX,
                                   STALENESS_SLACK, check_finite, file_in_the_way, never_reached, validate)
from dcmdp.async_config import AsyncRolloutConfig
from dcmdp.dual_config import CONTEXT_KINDS, ContextConfig, CouplingConfig, DualConfig, PIDConfig
from constraints.config import ConstraintConfig
from trainers.config import AlgoConfig, ColdStartConfig, ModelConfig, OptimConfig, RolloutConfig, TaskConfig
from trainers.errors import ConfigError, config_error, require

__all__ = [
    "AlgoConfig", "AsyncRolloutConfig", "CONTEXT_KINDS", "CheckpointConfig", "ColdStartConfig", "ConfigError",
    "ConstraintConfig", "ContextConfig", "CouplingConfig", "DistConfig", "DualConfig", "GuardConfig", "INF_ALLOWED",
    "MAX_BATCH_SAMPLES", "MAX_BATCH_TOKENS", "MAX_CONFIG_BYTES", "MAX_CONFIG_DEPTH", "MAX_CONFIG_NODES",
    "MAX_EVAL_SIZE", "MAX_REWARD_TIMEOUT", "MAX_SEED", "MIN_REWARD_TIMEOUT", "MIN_TEMPERATURE", "MODE_SELECTORS",
    "ModeSelector", "ModelConfig", "NAME_MAX", "NOT_ON_RESUME", "OptimConfig", "PIDConfig", "RENAMED_KEYS",
    "RESUMABLE_IN_BLOCKS", "RESUME_KEYS", "RolloutConfig", "RunConfig", "STALENESS_SLACK", "TaskConfig",
    "TrackingConfig", "UNIT_CLOSED_KEYS", "URI_KEYS", "check_finite", "compose_with_problems", "config_error",
    "file_in_the_way", "flatten", "load_config", "mode_knobs", "nearest", "never_reached", "public_config",
    "read_yaml_file", "read_yaml_text", "registry", "require", "resume_conflicts", "to_yaml", "validate",
    "yaml_shape", "yaml_value",
]
