"""The trainer's configuration.

- schema: the dataclasses (one per section, defaults stated), ConfigError, dotted keys and YAML
- resolve: defaults < YAML < env < CLI, then validation (torch-free)
- checks: range and consistency checks (check_ranges torch-free; check_model reads the model's config)

May import: contract, and (lazily, for checks that need them) trainer.config.partition,
trainer.config.schedules, trainer.config.batches, trainer.config.hub_layout; never torch at
import time.
"""

from trainer.config.resolve import check_perseus, resolve, validate
from trainer.config.schema import (
    DICT_KEYS,
    DTYPES,
    LOG_LINES,
    SHARDING,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    ProfileConfig,
    ScheduleConfig,
    TrainConfig,
    apply_yaml,
    config_keys,
    get_key,
    set_key,
    unknown_key,
)

__all__ = ["DICT_KEYS", "DTYPES", "LOG_LINES", "SHARDING", "CheckpointConfig", "Config", "ConfigError", "DataConfig",
           "LoggingConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "ProfileConfig", "ScheduleConfig",
           "TrainConfig", "apply_yaml", "check_perseus", "config_keys", "get_key", "resolve", "set_key", "unknown_key",
           "validate"]
