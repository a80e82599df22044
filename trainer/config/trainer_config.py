"""TrainerConfig: the trainer's whole configuration, one frozen object of sections, built once by
trainer.config.build.build_config. Only plugin_namespace() turns it back into slime's Namespace."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

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

SECTIONS = (RunOptions, ModelOptions, ShapeFlags, ParallelOptions, OptimizerOptions, BatchingOptions, LossOptions,
            RolloutOptions, RewardOptions, EvalOptions, PublishOptions, AsyncOptions, CheckpointOptions, LoggingOptions)


@dataclass(frozen=True)
class TrainerConfig:
    run: RunOptions
    model: ModelOptions
    shape: ShapeFlags
    parallel: ParallelOptions
    optimizer: OptimizerOptions
    batching: BatchingOptions
    loss: LossOptions
    rollout: RolloutOptions
    reward: RewardOptions
    eval: EvalOptions
    publish: PublishOptions
    asynchronous: AsyncOptions
    checkpoint: CheckpointOptions
    logging: LoggingOptions
    # What only plug-ins read: slime's flags slurmrl refuses unless given as the one accepted value
    # (trainer.refused_flags), and --custom-config-path's own keys (trainer.custom_config); kept so
    # plug-ins see every name slime's Namespace has.
    plugin_only: tuple[tuple[str, Any], ...] = ()

    @property
    def steps_per_rollout(self) -> int:
        """Optimizer steps per rollout (build_config checked that the global batch divides it)."""
        rollout = self.rollout
        return max(1, rollout.rollout_batch_size * rollout.n_samples_per_prompt // self.batching.global_batch_size)

    def sections(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f.name) for f in fields(self) if f.name != "plugin_only")

    def flat(self) -> dict[str, Any]:
        """Every flag (and derived value) by slime's name: what the rollout journal's fingerprint
        and W&B's run config record. The values are the config's own (not copies)."""
        values = {f.name: getattr(section, f.name) for section in self.sections() for f in fields(section)}
        values.update(self.plugin_only)
        return values

    def plugin_namespace(self) -> argparse.Namespace:
        """The plug-in boundary: what slime's plug-ins (rollout and generate functions, reward
        models, filters, hooks) get as `args`, slime's Namespace with its flag names. Built here
        and nowhere else; the trainer itself reads the sections."""
        return argparse.Namespace(**self.flat())
