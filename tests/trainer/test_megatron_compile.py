"""--torch-compile (trainer/megatron/compile.py): megatron-core's row-parallel linear compiles into
one graph once its default-group lookup no longer warns; with megatron's own lookup it breaks. Where
weights are split over ranks, megatron's collectives run outside the compiled graphs (traced, they
cut the gradient's path on a GPU: tests/gpu/test_multi_gpu.py's compiled layouts); at TP=1 they stay
inside (one graph a layer)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import layers
from megatron.core.transformer import TransformerConfig

from ckpt_tools import megatron_compat
from trainer.megatron import compile as megatron_compile

megatron_compat.apply()


@pytest.fixture()
def one_rank_megatron() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1)
    original = layers.get_tensor_model_parallel_group_if_none
    try:
        yield
    finally:
        layers.get_tensor_model_parallel_group_if_none = original
        _collectives_back_in_graphs()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _graph_breaks() -> int:
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    linear = layers.RowParallelLinear(16, 16, config=config, init_method=torch.nn.init.normal_, bias=False,
                                      input_is_parallel=True, skip_bias_add=True)
    torch._dynamo.reset()
    return torch._dynamo.explain(linear)(torch.randn(4, 1, 16)).graph_break_count


def test_the_row_parallel_linear_compiles_without_a_graph_break(one_rank_megatron) -> None:
    assert _graph_breaks() > 0, "megatron's lookup warns on rank 0: the break this module removes"
    megatron_compile.compile_layers(_no_layers(), weights_split=False)
    assert layers.get_tensor_model_parallel_group_if_none(None) is parallel_state.get_tensor_model_parallel_group()
    assert _graph_breaks() == 0


def _no_layers() -> torch.nn.Module:
    """A model with no transformer layers: compile_layers then only swaps the lookup."""
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList()
    return model


def _reduce_breaks() -> int:
    """Graph breaks of a function that sums over the TP group through megatron's mapping (a
    1-rank group here: megatron returns the input, so a traced call leaves no break)."""
    group = parallel_state.get_tensor_model_parallel_group()

    def f(x: torch.Tensor) -> torch.Tensor:
        return layers.reduce_from_tensor_model_parallel_region(x * 2, group=group) + 1

    torch._dynamo.reset()
    return torch._dynamo.explain(f)(torch.randn(4)).graph_break_count


def test_collectives_run_outside_the_graphs_only_where_weights_are_split(one_rank_megatron) -> None:
    megatron_compile.compile_layers(_no_layers(), weights_split=False)
    assert _reduce_breaks() == 0, "at TP=1 the layer stays one graph"
    megatron_compile.compile_layers(_no_layers(), weights_split=True)
    assert _reduce_breaks() == 1, "the collective runs eagerly, between two graphs"
    megatron_compile.compile_layers(_no_layers(), weights_split=True)  # idempotent: still one break
    assert _reduce_breaks() == 1


def _collectives_back_in_graphs() -> None:
    """Undo collectives_outside_graphs (process-wide rebinding) for the next test."""
    originals = {eager: f for f, eager in megatron_compile._EAGER.items()}
    for module in [m for name, m in sys.modules.items() if name.startswith("megatron.core") and m is not None]:
        for attr, value in list(vars(module).items()):
            if callable(value) and value in originals:
                setattr(module, attr, originals[value])
