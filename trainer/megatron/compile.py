"""--torch-compile for megatron-core's transformer layers (no TransformerEngine).

Each layer is compiled on its own (the layers are identical: one graph serves them all). megatron-core
0.16's RowParallelLinear hands its linear `tp_group=None`, whose lookup of the default group warns
through warnings.warn on rank 0, every call; torch.compile cannot trace that call, so every layer
broke into several graphs (two graph breaks per layer, each a guard check and a launch gap on the
host, which is what bounds a 0.6B step). The lookup is swapped for the same lookup without the
warning.

Where a layer's weights are split over ranks (TP, EP), its collectives stay out of the compiled
graphs. megatron wraps each in an autograd.Function that writes the collective's result into a
buffer it allocates; on a GPU torch.compile traces those functions, and the compiled layer's output
lost its link to the layer's inputs and weights: at TP=2 + SP every weight inside the layers got a
zero gradient while loss and log-probs were right (issue 29; bench/multigpu_grads.py). Run eagerly,
as they are on the CPU (where megatron's CPU buffer lookup already breaks the graph there), they
are right; the layers' GEMMs and elementwise work between them still compile.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FunctionType

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import layers, mappings

# megatron's collective entry points, each to its eager-only twin (made once per process)
_EAGER: dict[Callable[..., object], Callable[..., object]] = {}


def compile_layers(model: GPTModel, weights_split: bool) -> None:
    """Compile each transformer layer in place; `weights_split`: TP or EP > 1 (collectives inside
    the layers)."""
    layers.get_tensor_model_parallel_group_if_none = _tp_group
    if weights_split:
        collectives_outside_graphs()
    for layer in model.decoder.layers:
        layer.compile()


def collectives_outside_graphs() -> None:
    """Rebind every megatron module's name for a collective of megatron's tensor_parallel mappings
    (and the column-parallel linear that all-gathers its input under SP) to a twin torch.compile
    runs eagerly. Idempotent."""
    if not _EAGER:
        collectives = [f for name, f in vars(mappings).items() if isinstance(f, FunctionType)
                       and f.__module__ == mappings.__name__ and not name.startswith("_")]
        collectives.append(layers.linear_with_grad_accumulation_and_async_allreduce)
        _EAGER.update((f, torch.compiler.disable(f, recursive=True)) for f in collectives)
    for module in [m for name, m in sys.modules.items() if name.startswith("megatron.core") and m is not None]:
        for attr, value in list(vars(module).items()):
            if isinstance(value, FunctionType) and value in _EAGER:
                setattr(module, attr, _EAGER[value])


def _tp_group(tp_group: torch.distributed.ProcessGroup | None, is_expert: bool = False,
              check_initialized: bool = True) -> torch.distributed.ProcessGroup | None:
    """megatron.core.utils.get_tensor_model_parallel_group_if_none, without its deprecation warning."""
    if tp_group is not None or not torch.distributed.is_initialized() or not parallel_state.is_initialized():
        return tp_group
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
    return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)
