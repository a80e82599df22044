"""trainer.flops counts a model's forward FLOPs as slime does (perf/*_tflops). Checked against an
independent count, bench_gpu_megatron's model_flops (6 x matmul parameters x tokens + causal
attention, forward and backward): for a model whose heads x head_dim is its hidden size the two
must agree exactly at 3x, and by hand on a tiny shape."""

from __future__ import annotations

import pytest

from bench.bench_gpu_megatron import model_flops
from trainer.flops import fwd_flops

# Qwen2.5-0.5B's shape: 14 heads x 64 = 896 = hidden, 2 KV heads.
QWEN25_05B = {"hidden_size": 896, "num_attention_heads": 14, "head_dim": 64, "num_key_value_heads": 2,
              "intermediate_size": 4864, "num_hidden_layers": 24, "vocab_size": 151936}


def test_forward_and_backward_agree_with_the_bench_count() -> None:
    lengths = [17, 512, 4096]
    assert 3 * fwd_flops(QWEN25_05B, lengths) == pytest.approx(model_flops(QWEN25_05B, lengths), rel=1e-12)


def test_a_tiny_shape_by_hand() -> None:
    # hidden 4, 2 heads of 2 (no head_dim: hidden / heads), 1 KV head, MLP 8, 1 layer, vocab 10; n = 3
    config = {"hidden_size": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 8,
              "num_hidden_layers": 1, "vocab_size": 10}
    qkv = 2 * 3 * 4 * 2 * 2 + 4 * 3 * 4 * 1 * 2  # Q: n h heads d; K and V: 2 n h groups d each
    attention = 2 * 2 * 9 * 2 / 2 + 2 * 9 * 2  # causal QK^T, then AV
    output, mlp, head = 2 * 3 * 16, 6 * 3 * 4 * 8, 2 * 3 * 4 * 10
    assert fwd_flops(config, [3]) == qkv + attention + output + mlp + head
    assert fwd_flops(config, [3, 3]) == 2 * fwd_flops(config, [3])


def test_an_experts_width_is_intermediate_size_without_moe_intermediate_size() -> None:
    """Mixtral's and MiniMax-M2's config.json: intermediate_size is one expert's; top-k of them make the MLP."""
    dense = {"hidden_size": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 16,
             "num_hidden_layers": 1, "vocab_size": 10}
    minimax = {**dense, "intermediate_size": 8, "num_local_experts": 4, "num_experts_per_tok": 2}
    assert fwd_flops(minimax, [3]) == fwd_flops(dense, [3])
