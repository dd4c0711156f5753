"""The job's configuration: its schema (ptdp/config/schema.py), loading with overrides
(loading.py), validation (validation.py), the schedule catalogue (catalogue.py) and the model
catalogue (models.py). Torch-free.
"""

from ptdp.config.loading import (config_from_dict, load_config, load_model_yaml, parse_config,
                                 parse_overrides, read_yaml)
from ptdp.config.schema import (CheckpointConfig, Config, ConfigError, DataConfig, LogConfig,
                                ModelConfig, ParallelConfig, ScheduleConfig, TrainConfig,
                                padded_vocab_size)
from ptdp.config.validation import parse_paths, parse_split, validate, validate_model

__all__ = ["CheckpointConfig", "Config", "ConfigError", "DataConfig", "LogConfig", "ModelConfig",
           "ParallelConfig", "ScheduleConfig", "TrainConfig", "config_from_dict", "load_config",
           "load_model_yaml", "padded_vocab_size", "parse_config", "parse_overrides", "parse_paths",
           "parse_split", "read_yaml", "validate", "validate_model"]
