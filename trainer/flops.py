"""A model's forward FLOPs for a list of sequence lengths, as slime counts them for its
perf/*_tflops metrics (slime/utils/flops_utils.py calculate_fwd_flops, dense layers): per layer
the QKV and output projections, causal attention (QK^T halved) and a SwiGLU MLP, then the LM head.
A backward pass is counted as twice the forward (slime's actor_train_tflops: 3x the forward)."""

from __future__ import annotations

from typing import Any

from ckpt_tools.architectures import expert_ffn_size


def fwd_flops(hf_config: dict[str, Any], seq_lens: list[int]) -> float:
    """Forward FLOPs of the model of HF config.json `hf_config` over sequences of `seq_lens` tokens.
    MoE layers count their routed experts (topk; Mixtral's and MiniMax-M2's width is intermediate_size) and shared
    expert as the MLP width."""
    hidden, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hidden // heads
    groups = hf_config.get("num_key_value_heads") or heads
    ffn = hf_config["intermediate_size"]
    if hf_config.get("num_experts") or hf_config.get("num_local_experts"):
        ffn = ((expert_ffn_size(hf_config) or 0) * hf_config["num_experts_per_tok"]
               + hf_config.get("shared_expert_intermediate_size", 0))
    total = 0.0
    for n in seq_lens:
        qkv = 2 * n * hidden * heads * head_dim + 2 * 2 * n * hidden * groups * head_dim
        attention = 2 * heads * n * n * head_dim / 2 + heads * n * n * head_dim
        output = 2 * n * hidden * hidden  # slime's: hidden x hidden, whatever heads x head_dim is
        mlp = 2 * n * hidden * ffn * 3
        total += hf_config["num_hidden_layers"] * (qkv + attention + output + mlp)
        total += 2 * n * hidden * hf_config["vocab_size"]
    return total
