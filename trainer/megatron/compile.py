"""--torch-compile for megatron-core's transformer layers (no TransformerEngine).

Each layer is compiled on its own (the layers are identical: one graph serves them all). megatron-core
0.16's RowParallelLinear hands its linear `tp_group=None`, whose lookup of the default group warns
through warnings.warn on rank 0, every call; torch.compile cannot trace that call, so every layer
broke into several graphs (two graph breaks per layer, each a guard check and a launch gap on the
host, which is what bounds a 0.6B step). The lookup is swapped for the same lookup without the
warning.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import layers


def compile_layers(model: GPTModel) -> None:
    layers.get_tensor_model_parallel_group_if_none = _tp_group
    for layer in model.decoder.layers:
        layer.compile()


def _tp_group(tp_group: torch.distributed.ProcessGroup | None, is_expert: bool = False,
              check_initialized: bool = True) -> torch.distributed.ProcessGroup | None:
    """megatron.core.utils.get_tensor_model_parallel_group_if_none, without its deprecation warning."""
    if tp_group is not None or not torch.distributed.is_initialized() or not parallel_state.is_initialized():
        return tp_group
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
    return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)
