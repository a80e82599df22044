"""The trainer's configuration: frozen sections (trainer.config.sections) in one TrainerConfig,
built and validated once from the parsed flags by build_config."""

from trainer.config.build import build_config
from trainer.config.model_checks import check_model_flags, read_hf_config
from trainer.config.sections import (
    AsyncOptions,
    BatchingOptions,
    CheckpointOptions,
    EvalOptions,
    LoggingOptions,
    LossOptions,
    ModelOptions,
    OptimizerOptions,
    ParallelOptions,
    PublishOptions,
    RewardOptions,
    RolloutOptions,
    RunOptions,
    ShapeFlags,
)
from trainer.config.trainer_config import TrainerConfig

__all__ = ["AsyncOptions", "BatchingOptions", "CheckpointOptions", "EvalOptions", "LoggingOptions", "LossOptions",
           "ModelOptions", "OptimizerOptions", "ParallelOptions", "PublishOptions", "RewardOptions", "RolloutOptions",
           "RunOptions", "ShapeFlags", "TrainerConfig", "build_config", "check_model_flags", "read_hf_config"]
