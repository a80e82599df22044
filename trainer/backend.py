"""The contract between the RL loop and a training backend (megatron, fsdp).

Every method is collective: every rank of the trainer calls it with the same arguments (the
whole batch is broadcast to every rank first). A backend splits the batch over its
data-parallel ranks itself; log-probs come back to every rank for the samples it was given.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor

from trainer.batch import Pack, TrainSample
from trainer.offload import Offloadable

# (pack, per-sample log-probs [R] with grad, per-sample entropies [R] or None) -> (loss, metrics)
# The loss is already scaled so that summing it over every micro-batch of every data-parallel
# rank gives the global batch's loss.
PackLoss = Callable[[Pack, list[Tensor], list[Tensor] | None], tuple[Tensor, dict[str, Tensor]]]


# In the trainer state a backend writes (common): False when the checkpoint holds no optimizer state
# (--no-save-optim), so a resume from it starts the optimizer afresh instead of failing.
OPTIMIZER_SAVED = "optimizer_saved"
log = logging.getLogger(__name__)


class NonFiniteGradient(FloatingPointError):
    """A NaN or infinite gradient norm: the step is not taken and the trainer stops (Megatron's
    check_for_nan_in_loss_and_grad, on by default), so no NaN ever reaches the weights or a checkpoint."""


_Part = TypeVar("_Part")


def built(part: _Part | None, what: str) -> _Part:
    """A part a backend builds only when this run's flags need it: asking for one they did not is a bug."""
    if part is None:
        raise RuntimeError(f"this run built no {what}")
    return part


def steps_on(grad_norm: float, role: str, check_nan: bool) -> bool:
    """Whether the optimizer steps on this gradient. A NaN or infinite norm raises NonFiniteGradient
    (Megatron's check_for_nan_in_loss_and_grad, the default); with --no-check-for-nan-in-loss-and-grad
    the step is skipped, as slime skips it: no optimizer and no learning-rate step, grad_norm nan in
    the metrics, and training goes on."""
    if math.isfinite(grad_norm):
        return True
    if check_nan:
        raise NonFiniteGradient(f"the {role}'s gradient norm is {grad_norm}; the optimizer step was not taken. "
                                "Lower --lr, check the rewards and the data (the last checkpoint is intact)")
    log.warning("the %s's gradient norm is %s: this optimizer step is skipped (--no-check-for-nan-in-loss-and-grad)",
                role, grad_norm)
    return False


class Backend(ABC):
    rank: int  # global rank in the trainer
    world_size: int
    dp_rank: int
    dp_size: int
    save_optimizer: bool = True  # False: --no-save-optim

    @abstractmethod
    def log_probs(self, samples: list[TrainSample], ids: list[int], model: str = "actor",
                  with_entropy: bool = False) -> dict[int, tuple[Tensor, Tensor | None]]:
        """No-grad per-token log-probs (and entropies) of the response tokens of samples `ids`
        under `model` ("actor", or "ref" when a reference model was loaded). Returns, on every
        rank, the result for every id (gathered over data-parallel ranks)."""

    @abstractmethod
    def train_step(self, samples: list[TrainSample], ids: list[int], loss: PackLoss,
                   need_entropy: bool, role: str = "actor", rollout_id: int = 0, step_id: int = 0) -> dict[str, float]:
        """One optimizer step on the global batch `ids`: forward/backward over micro-batches
        of this rank's share, gradient all-reduce, clipping, the optimizer and LR schedule.
        Returns metrics averaged over the batch, plus grad_norm and lr. role "critic" (PPO) trains
        the critic, whose per-sample outputs handed to `loss` are values instead of log-probs."""

    def values(self, samples: list[TrainSample], ids: list[int]) -> dict[int, Tensor]:
        """No-grad critic values [R] per sample (PPO), gathered like log_probs."""
        raise NotImplementedError(f"{type(self).__name__} has no critic: --advantage-estimator ppo needs "
                                  "--train-backend megatron")

    @abstractmethod
    def hf_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The actor's weights under Hugging Face names, full (gathered over model-parallel
        ranks), in the HF dtype, on the trainer's device (an NCCL publish sends them from there; disk
        writers move them to the host). Collective: yields on global rank 0 only, nothing elsewhere.
        The tensors may share memory with the live model: use them before the next step."""

    @abstractmethod
    def save(self, ckpt_dir: Path, common: dict[str, Any]) -> None:
        """Write model, optimizer (unless save_optimizer is False) and RNG state plus `common`
        (rank 0's loop state, with OPTIMIZER_SAVED) into the existing, empty folder ckpt_dir.
        Collective."""

    @abstractmethod
    def load(self, ckpt_dir: Path, weights_only: bool) -> dict[str, Any]:
        """Read what save() wrote (weights_only: only the model, e.g. --ref-load or a converted
        HF checkpoint) and return `common` ({} when weights_only); a checkpoint saved without its
        optimizer state leaves the optimizer fresh, its moments zero and its masters the weights.
        Collective."""

    def offloadable(self) -> Offloadable:
        """Its models and optimizers, for --offload-train (trainer.offload)."""
        raise NotImplementedError(f"{type(self).__name__} cannot offload: --offload-train needs the megatron "
                                  "or fsdp backend")

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's obj on every rank (over a CPU group, whatever the training backend)."""
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    cpu_group: Any = None  # a gloo group over all trainer ranks, set by the backend
    model: Any = None  # the actor's module, set by the backend

    def actor_tensors(self) -> list[Tensor]:
        """This rank's share of the actor's parameters, live: copying into them changes the model
        (--keep-old-actor swaps the weights that generated a sample in and out, trainer.old_actor)."""
        if not isinstance(self.model, torch.nn.Module):
            raise NotImplementedError(f"{type(self).__name__} has no actor module: --keep-old-actor needs the "
                                      "megatron or fsdp backend")
        return [_local(p.data) for p in self.model.parameters()]


def _local(tensor: Tensor) -> Tensor:
    """A sharded (DTensor) parameter's shard on this rank, sharing its storage."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
