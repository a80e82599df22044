"""--torch-compile (trainer/megatron/compile.py): megatron-core's row-parallel linear compiles into
one graph once its default-group lookup no longer warns; with megatron's own lookup it breaks."""

from __future__ import annotations

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
    megatron_compile.compile_layers(_no_layers())
    assert layers.get_tensor_model_parallel_group_if_none(None) is parallel_state.get_tensor_model_parallel_group()
    assert _graph_breaks() == 0


def _no_layers() -> torch.nn.Module:
    """A model with no transformer layers: compile_layers then only swaps the lookup."""
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList()
    return model
