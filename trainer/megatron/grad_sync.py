"""The megatron backend's gradients after the backward (megatron's finalize_model_grads): summed
where several ranks hold parts of one, and their global norm."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import param_is_not_shared
from torch.nn import Parameter

from trainer import main_grads
from trainer.grad_buckets import DataParallelGrads, default_bucket_numel
from trainer.megatron import pipeline as megatron_pipeline


def is_expert(name: str) -> bool:
    """An expert weight, held by the expert grid (EP x expert-TP): megatron marks these
    allreduce=False only when EP > 1, but with --expert-tensor-parallel-size != TP their
    data-parallel group differs from the dense weights' at EP 1 too."""
    return ".mlp.experts." in name


def data_parallel_group(expert: bool) -> dist.ProcessGroup:
    return ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group(with_context_parallel=True)


def data_parallel_grads(named: list[tuple[str, Parameter]], bucket_numel: int | None,
                        overlap: bool) -> DataParallelGrads:
    """The data-parallel sum of these parameters' gradients, dense weights over the DP x CP group,
    expert weights over the expert-DP group; bucket_numel None: megatron's default."""
    runs = [([p for n, p in named if is_expert(n) == expert], data_parallel_group(expert)) for expert in (False, True)]
    size = ps.get_data_parallel_world_size(with_context_parallel=True)
    return DataParallelGrads(runs, {id(p): i for i, (_, p) in enumerate(named)},
                             bucket_numel or default_bucket_numel(size), overlap)


def reduce_gradients(model: GPTModel, data_parallel: DataParallelGrads, sequence_parallel: bool) -> None:
    """Sum gradients where several ranks hold parts of one: every replica over data-parallel x
    context-parallel ranks (the loss is already scaled for a sum; each CP rank holds the gradient of
    its own rows), expert weights over the expert-DP group (data_parallel: launched during the
    backward with --overlap-grad-reduce, waited for here); the tied embedding over the pipeline's
    ends; and over the TP group q/k layernorm weights (each rank normalises only its own heads;
    MiniMax-M2's q_norm and k_norm scale them by its slice of the weight: ckpt_tools.full_qk_norm)
    and, under sequence parallelism, weights marked sequence_parallel (norms, router: each rank
    sees its own slice of the sequence). Sums commute: the order of the groups does not matter."""
    data_parallel.finish()
    megatron_pipeline.reduce_embedding_grads(model)
    head_norms = () if model.config.multi_latent_attention else (  # MLA's: whole latents, partial only under SP
        "q_layernorm.weight", "k_layernorm.weight", "q_norm.weight", "k_norm.weight")
    partial = [g for n, p in model.named_parameters() if (g := main_grads.grad_of(p)) is not None
               and (n.endswith(head_norms) or (sequence_parallel and getattr(p, "sequence_parallel", False)))]
    main_grads.all_reduce_sum(partial, ps.get_tensor_model_parallel_group())


def grad_norm(model: GPTModel, tp_rank: int, device: torch.device) -> float:
    """The global L2 norm: each TP shard once, replicated weights (norms) once per TP group,
    expert weights summed over the expert-parallel ranks that hold different experts."""
    squares = []
    for expert, group in ((False, ps.get_model_parallel_group()),
                          (True, ps.get_expert_tensor_model_pipeline_parallel_group())):
        grads = [g for n, p in model.named_parameters()
                 if (g := main_grads.grad_of(p)) is not None and param_is_not_shared(p) and is_expert(n) == expert
                 and (getattr(p, "tensor_model_parallel", False) or tp_rank == 0 or expert)]
        sq = torch.zeros((), dtype=torch.float32, device=device)
        if grads:  # one kernel for all the per-tensor norms, not three per tensor
            sq += torch.stack(torch._foreach_norm([g.float() for g in grads])).pow(2).sum()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(sq, group=group)
        squares.append(sq)
    return float(torch.stack(squares).sum().sqrt())
