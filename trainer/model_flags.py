"""The model-shape flags slime's scripts give, each with what config.json implies of it: the trainer checks
a flag given against its value here (trainer.config.model_checks), so a script and a checkpoint that disagree
stop at submission."""

from __future__ import annotations

from typing import Any

from ckpt_tools import rope
from ckpt_tools.architectures import (
    DENSE_GLM_ARCHITECTURES,
    EXPERT_BIAS_ARCHITECTURES,
    GATED_DELTA_NET_ARCHITECTURES,
    MLA_ARCHITECTURES,
    POST_NORM_ARCHITECTURES,
    QK_NORM_ARCHITECTURES,
    QKV_BIAS_GLM_ARCHITECTURES,
    dense_first_layers,
    expert_ffn_size,
    routed_experts,
)
from trainer.args_actions import LayerPattern


def _deepseek(c: dict[str, Any]) -> bool:
    """Multi-latent attention: DeepSeek-V3, Kimi-K2, GLM-4.7-Flash."""
    return c["architectures"][0] in MLA_ARCHITECTURES


def _expert_bias(c: dict[str, Any]) -> bool:
    """DeepSeek-V3's MoE (GLM-4.5's too): sigmoid expert-bias routing, shared experts, dense first layers."""
    return c["architectures"][0] in EXPERT_BIAS_ARCHITECTURES


def _qwen3_next(c: dict[str, Any]) -> bool:
    """Qwen3-Next's layers (Qwen3.5's too): gated delta nets, gated attention, zero-centred norms."""
    return c["architectures"][0] in GATED_DELTA_NET_ARCHITECTURES


def _gated_shared_expert(c: dict[str, Any]) -> bool:
    """Qwen3-Next's MoE (Qwen3.5-MoE's): a shared expert scaled by a sigmoid gate."""
    return _qwen3_next(c) and bool(routed_experts(c))


UNCHECKED = object()  # a model flag without effect for this model: any value is accepted
# flag -> how to read the same quantity from an HF config
MODEL_FLAGS: dict[str, Any] = {
    "num_layers": lambda c: c["num_hidden_layers"],
    "hidden_size": lambda c: c["hidden_size"],
    "ffn_hidden_size": lambda c: c["intermediate_size"],
    "num_attention_heads": lambda c: c["num_attention_heads"],
    "num_query_groups": lambda c: c.get("num_key_value_heads") or c["num_attention_heads"],
    # DeepSeek: megatron's MLA never reads kv_channels (--qk-head-dim, --qk-pos-emb-head-dim and --v-head-dim
    # give its widths), and slime's scripts give any value (DeepSeek-V3 128, Kimi-K2 64)
    "kv_channels": lambda c: UNCHECKED if _deepseek(c) else (
        c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]),
    "vocab_size": lambda c: c["vocab_size"],
    "rotary_base": rope.rope_theta,
    "rotary_percent": rope.rotary_percent,
    "norm_epsilon": lambda c: c.get("rms_norm_eps", 1e-6),
    "max_position_embeddings": lambda c: c.get("max_position_embeddings"),
    # DeepSeek: the norms of MLA's q and kv latents (q_a_layernorm, kv_a_layernorm)
    "qk_layernorm": lambda c: (c["architectures"][0] in QK_NORM_ARCHITECTURES or _deepseek(c)
                               or bool(c.get("use_qk_norm"))),
    "untie_embeddings_and_output_weights": lambda c: not c.get("tie_word_embeddings", False),
    "swiglu": lambda c: c.get("hidden_act", "silu") == "silu",
    # MLA has no q/k/v projections (megatron's ignores it; slime's GLM-4.7-Flash script gives it)
    "add_qkv_bias": lambda c: UNCHECKED if _deepseek(c) else (
        c["architectures"][0] == "Qwen2ForCausalLM" or bool(c.get("attention_bias"))),
    # no bias on any linear but (Qwen2's, GLM's) q/k/v, which --add-qkv-bias covers
    "disable_bias_linear": lambda c: not c.get("mlp_bias") and (
        not c.get("attention_bias") or c["architectures"][0] in ("Qwen2ForCausalLM", *QKV_BIAS_GLM_ARCHITECTURES)),
    # MoE (Qwen3-MoE, DeepSeek-V3): every layer's MLP is the experts'
    "num_experts": lambda c: routed_experts(c) or None,
    "moe_ffn_hidden_size": expert_ffn_size,
    "moe_router_topk": lambda c: c.get("num_experts_per_tok"),
    "moe_router_score_function": lambda c: ("sigmoid" if _expert_bias(c)
                                            else "softmax" if c.get("num_experts") else None),
    # DeepSeek, GLM: slime's scripts give it; megatron's sigmoid router has no pre-softmax
    "moe_router_pre_softmax": lambda c: _expert_bias(c) or (bool(c.get("num_experts"))
                                                         and not c.get("norm_topk_prob", False)),
    "moe_layer_freq": lambda c: _moe_layer_pattern(c) if routed_experts(c) and not c.get("mlp_only_layers") else None,
    # DeepSeek-V3: multi-latent attention; it and GLM-4.5: shared experts, expert-bias grouped routing
    "multi_latent_attention": _deepseek,
    "q_lora_rank": lambda c: c["q_lora_rank"],
    "kv_lora_rank": lambda c: c["kv_lora_rank"],
    "qk_head_dim": lambda c: c["qk_nope_head_dim"],
    "qk_pos_emb_head_dim": lambda c: c["qk_rope_head_dim"],
    "v_head_dim": lambda c: c["v_head_dim"],
    "moe_shared_expert_intermediate_size": lambda c: (c["shared_expert_intermediate_size"] if _qwen3_next(c)
                                                      else c["n_shared_experts"] * c["moe_intermediate_size"]),
    "moe_router_enable_expert_bias": _expert_bias,
    "moe_router_num_groups": lambda c: c["n_group"],
    "moe_router_group_topk": lambda c: c["topk_group"],
    "moe_router_topk_scaling_factor": lambda c: c["routed_scaling_factor"],
    # the dense GLM-4s: RoPE over interleaved pairs (MLA's own, whatever the flag); GLM-4-0414's post norms
    "rotary_interleaved": lambda c: UNCHECKED if _deepseek(c) else c["architectures"][0] in DENSE_GLM_ARCHITECTURES,
    "post_self_attn_layernorm": lambda c: c["architectures"][0] in POST_NORM_ARCHITECTURES,
    "post_mlp_layernorm": lambda c: c["architectures"][0] in POST_NORM_ARCHITECTURES,
    # Qwen3-Next, Qwen3.5: zero-centred norms, gated attention (slime's fork names it --use-gated-attention,
    # megatron-core --attention-output-gate: one layout, HF's q_proj split into query and gate per head), and in
    # their MoE a gated shared expert
    "apply_layernorm_1p": _qwen3_next,
    "attention_output_gate": _qwen3_next,
    "use_gated_attention": _qwen3_next,
    "moe_shared_expert_gate": _gated_shared_expert,
    # RoPE scaling (ckpt_tools.rope builds it from config.json): Llama 3.1's, or YaRN under MLA (DeepSeek-V3,
    # Kimi-K2); no scaling is factor 1, where YaRN's mscales have no effect (Moonlight's scripts give 1.0)
    "use_rope_scaling": lambda c: rope.rope_type(c) == "llama3",
    "rotary_scaling_factor": lambda c: (float(rope.rope_parameters(c)["factor"]) if rope.rope_type(c) == "llama3"
                                        else _yarn(c).factor if rope.rope_type(c) == "yarn" else 1.0),
    "mscale": lambda c: _yarn(c).mscale if _yarn_scales(c) else UNCHECKED,
    "mscale_all_dim": lambda c: _yarn(c).mscale_all_dim if _yarn_scales(c) else UNCHECKED,
}


def _yarn(c: dict[str, Any]) -> rope.Yarn:
    return rope.Yarn.from_hf_config(c)


def _yarn_scales(c: dict[str, Any]) -> bool:
    return rope.rope_type(c) == "yarn" and _yarn(c).scales


def _moe_layer_pattern(c: dict[str, Any]) -> int | LayerPattern:
    """1 (every layer MoE), or DeepSeek's first_k_dense_replace dense layers then MoE ones."""
    dense = dense_first_layers(c) if _expert_bias(c) else 0
    return LayerPattern([0] * dense + [1] * (c["num_hidden_layers"] - dense)) if dense else 1
