"""The megatron backend's trainees (the actor; PPO's critic) and their checkpoints: each model
with its optimizer and LR schedule, saved through trainer.megatron.state (the critic in a
sub-folder), without the optimizer state under --no-save-optim; a resume from such a checkpoint
starts the optimizer afresh (its masters the loaded weights)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel

from trainer.backend import OPTIMIZER_SAVED
from trainer.grad_buckets import DataParallelGrads
from trainer.megatron import state as megatron_state
from trainer.megatron.optimizer import ShardedOptimizer

log = logging.getLogger(__name__)

CRITIC_DIR = "critic"  # PPO's critic is saved in this sub-folder of each checkpoint


@dataclass
class Trainee:
    """A model with its own optimizer and LR schedule (the actor; PPO's critic)."""

    model: GPTModel
    optimizer: ShardedOptimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    grads: DataParallelGrads  # the data-parallel sum of its gradients



def save(ckpt_dir: Path, actor: Trainee, critic: Trainee | None, common: dict[str, Any], with_optimizer: bool) -> None:
    actor_common = {**common, OPTIMIZER_SAVED: with_optimizer, "lr_scheduler": actor.scheduler.state_dict()}
    megatron_state.save_megatron(ckpt_dir, actor.model, actor.optimizer if with_optimizer else None, actor_common)
    if critic is not None:
        (ckpt_dir / CRITIC_DIR).mkdir(exist_ok=True)
        megatron_state.save_megatron(ckpt_dir / CRITIC_DIR, critic.model, critic.optimizer if with_optimizer else None,
                                     {"lr_scheduler": critic.scheduler.state_dict()})


def load(ckpt_dir: Path, actor: Trainee, critic: Trainee | None, weights_only: bool) -> dict[str, Any]:
    """What save wrote; weights_only (--ref-load, a converted checkpoint): the actor's weights, the
    critic the actor's backbone. Returns the loop state ({} when weights_only)."""
    with_optimizer = not weights_only and megatron_state.holds_optimizer(ckpt_dir)
    common = _load(ckpt_dir, actor, critic, weights_only, with_optimizer)
    if not with_optimizer:  # a load with the optimizer restored the masters with it
        for trainee in (actor, critic):
            if trainee is not None:
                trainee.optimizer.refresh_masters()
    return common


def _load(ckpt_dir: Path, actor: Trainee, critic: Trainee | None, weights_only: bool,
          with_optimizer: bool) -> dict[str, Any]:
    common = megatron_state.load_megatron(ckpt_dir, actor.model, actor.optimizer if with_optimizer else None,
                                          with_rng=not weights_only)
    if weights_only:
        if critic is not None:  # the critic starts as the initial policy with a zero value head
            backbone = {k: v for k, v in actor.model.state_dict().items() if not k.startswith("output_layer")}
            critic.model.load_state_dict(backbone, strict=False)
        return {}
    if not with_optimizer:
        if common.get(OPTIMIZER_SAVED) is not False:  # not a --no-save-optim checkpoint: a converted one
            raise RuntimeError(f"{ckpt_dir} holds no optimizer state and no trainer state (converted from HF?): "
                               "give it as --ref-load, not --load")
        log.warning("%s was saved with --no-save-optim: the optimizer starts afresh", ckpt_dir)
    common.pop(OPTIMIZER_SAVED, None)
    actor.scheduler.load_state_dict(common.pop("lr_scheduler"))
    if critic is not None:
        critic_state = megatron_state.load_megatron(ckpt_dir / CRITIC_DIR, critic.model,
                                                    critic.optimizer if with_optimizer else None)
        critic.scheduler.load_state_dict(critic_state["lr_scheduler"])
    return common
