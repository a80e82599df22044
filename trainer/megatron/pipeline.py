"""Pipeline parallelism (--pipeline-model-parallel-size) for the megatron backend.

Each stage holds a contiguous run of layers (megatron's even split, or --decoder-first/last-pipeline-
num-layers); the first also the embedding, the last the final norm and output layer (with tied
embeddings a copy of the embedding, whose gradient is summed with the first stage's over megatron's
embedding group). A rank's packed micro-batches go through megatron-core's schedules (1F1B when
training, forward only for log-probs) with variable sequence lengths. Each stage knows the shape of
every activation it will receive (all stages of a pipeline hold the same packs, in the same order),
so none is exchanged: megatron's exchange synchronises the whole device twice per transfer, and the
host could never run ahead of the GPU. Only the last stage sees logits: the loss, log-probs and
metrics are computed there, and the backend's all-gathers over every rank hand them to the whole
trainer. Weights for publishing come from every stage, passed to global rank 0 over its pipeline
group.

Without pipeline parallelism `each_pack` runs the same callbacks in a plain loop. Either way the
backward of every micro-batch but the last runs inside `no_sync` (megatron's config.no_sync_func),
where the data-parallel gradient reduce is not launched (trainer.grad_buckets).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection
from torch import Tensor

from trainer import main_grads
from trainer.batch import Pack
from trainer.context_parallel import RowLayout

# (pack, its rows, the model's output on the last stage) -> (loss to backpropagate, metrics)
PackStep = Callable[[Pack, RowLayout, Tensor], tuple[Tensor, dict[str, Tensor]]]
NoSync = Callable[[], AbstractContextManager[Any]]


def each_pack(model: GPTModel, packs: list[tuple[Pack, RowLayout]], run_model: Callable[[GPTModel, RowLayout], Tensor],
              step: PackStep, train: bool, no_sync: NoSync = contextlib.nullcontext) -> list[dict[str, Tensor]]:
    """Run every pack through `model` and `step` (and, when training, the backward of its loss);
    returns the metrics of each pack where they were computed (the last stage), else []."""
    if ps.get_pipeline_model_parallel_world_size() == 1:
        out = []
        for k, (pack, rows) in enumerate(packs):
            loss, metrics = step(pack, rows, run_model(model, rows))
            if train:
                with no_sync() if k < len(packs) - 1 else contextlib.nullcontext():
                    loss.backward()
            out.append(metrics)
        return out
    if not packs:  # every stage of this pipeline has the same (no) packs
        return []
    # Megatron's schedule scales nothing with per-token losses: `step`'s loss is already scaled.
    model.config.calculate_per_token_loss = True
    # Packs differ in length: stages send each activation's shape first. (Set here, not in the
    # config's constructor, which refuses it with MoE's allgather dispatcher: trainer.config refuses that.)
    model.config.variable_seq_lengths = True
    model.config.no_sync_func = no_sync  # the schedule leaves it before the last micro-batch's backward
    model.config.batch_p2p_sync = False  # a device-wide sync after each transfer, for a bug of torch < 1.11
    data = iter(packs)

    def forward_step(data_iterator: Iterator[tuple[Pack, RowLayout]], chunk: GPTModel):
        pack, rows = next(data_iterator)
        output = run_model(chunk, rows)

        def loss_func(output: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
            loss, metrics = step(pack, rows, output)
            return loss, torch.tensor(1, dtype=torch.int), metrics

        return output, loss_func

    config = model.config
    split = config.tensor_model_parallel_size if config.sequence_parallel else 1
    shapes = [(len(rows.tokens) // split, 1, config.hidden_size) for _, rows in packs]
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data, model=[model], num_microbatches=len(packs),
        seq_length=max(len(rows.tokens) for _, rows in packs), micro_batch_size=1, forward_only=not train,
        p2p_communicator=KnownShapes(ps.get_pipeline_model_parallel_group(), config, shapes),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(
            ["tp", "pp", "cp", "embd", "pos_embd", "dp_cp"]))  # the groups megatron takes when given none


class KnownShapes(P2PCommunicator):
    """megatron's point-to-point communicator, told each micro-batch's activation shape instead of
    receiving it first: activations (from the previous stage) and their gradients (from the next)
    each arrive in micro-batch order, so a queue of the packs' shapes per direction says them."""

    def __init__(self, pp_group: dist.ProcessGroup, config: Any, shapes: list[tuple[int, int, int]]) -> None:
        super().__init__(pp_group, config)
        self._activations, self._gradients = iter(shapes), iter(shapes)

    def _communicate_shapes(self, tensor_send_next: Tensor | None, tensor_send_prev: Tensor | None,
                            recv_prev: bool, recv_next: bool) -> tuple[list[int], list[int]]:
        return (list(next(self._activations)) if recv_prev else [0, 0, 0],
                list(next(self._gradients)) if recv_next else [0, 0, 0])


def reduce_embedding_grads(model: GPTModel) -> None:
    """With tied embeddings, the first stage's embedding and the last stage's output layer are one
    weight: sum their gradients over the embedding group (megatron's finalize_model_grads does it)."""
    if (ps.get_pipeline_model_parallel_world_size() == 1 or not model.share_embeddings_and_output_weights
            or not ps.is_rank_in_embedding_group(ignore_virtual=True)):
        return
    grad = main_grads.grad_of(model.shared_embedding_or_output_weight())
    if grad is not None:
        dist.all_reduce(grad, group=ps.get_embedding_group())


def is_stage_leader() -> bool:
    """This rank speaks for its stage when weights are published: TP, CP and DP rank 0."""
    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0


def from_every_stage(local: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """Every stage's (name, tensor) pairs, on global rank 0 (stage by stage, one tensor at a time);
    nothing elsewhere. `local` is this stage's stream (a collective within the stage: every rank of
    the stage runs it, in turn); its leaders pass it down their pipeline group to global rank 0."""
    stages, me = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    leader = is_stage_leader()
    group = ps.get_pipeline_model_parallel_group()
    for stage in range(stages):
        src = dist.get_global_rank(group, stage)
        if stage == me:
            for name, tensor in local:
                if stage == 0 or not leader:
                    if dist.get_rank() == 0:
                        yield name, tensor
                    continue
                _broadcast_meta((name, tuple(tensor.shape), tensor.dtype), src, group)
                dist.broadcast(tensor.to(_device()).contiguous(), src=src, group=group)
            if stage and leader:
                _broadcast_meta(None, src, group)
        elif leader and stage:
            while (meta := _broadcast_meta(None, src, group)) is not None:
                name, shape, dtype = meta
                tensor = torch.empty(shape, dtype=dtype, device=_device())
                dist.broadcast(tensor, src=src, group=group)
                if dist.get_rank() == 0:
                    yield name, tensor  # on the GPU, as stage 0's own


def _broadcast_meta(obj: Any, src: int, group) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
