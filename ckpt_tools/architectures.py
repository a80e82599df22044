"""The Hugging Face architectures slurmrl builds, by family; torch-free, so that flag checks at
submission can ask."""

from __future__ import annotations

from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                           "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM", "GlmForCausalLM",
                           "Glm4ForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM")
# DeepSeek-V3's MoE: sigmoid expert-bias routing over groups, shared experts, dense first layers (GLM-4.5/4.7
# has it under standard attention, GLM-4.7-Flash under DeepSeek's multi-latent attention)
EXPERT_BIAS_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM")
MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM")
# Their checkpoints keep num_nextn_predict_layers multi-token prediction (MTP) layers after the decoder's
MTP_ARCHITECTURES = EXPERT_BIAS_ARCHITECTURES
# The dense GLM-4s (glm-4-9b-chat-hf; GLM-4-0414 and GLM-Z1): a q/k/v bias, one fused gate_up_proj, RoPE over
# interleaved pairs of the first part of each head; GLM-4-0414 also normalises the attention's and the MLP's
# outputs before each residual add (its post_self_attn_layernorm and post_mlp_layernorm)
DENSE_GLM_ARCHITECTURES = ("GlmForCausalLM", "Glm4ForCausalLM")
POST_NORM_ARCHITECTURES = ("Glm4ForCausalLM",)
# Their config.json's attention_bias is a bias on q, k and v only (megatron's add_qkv_bias)
QKV_BIAS_GLM_ARCHITECTURES = ("Glm4MoeForCausalLM", *DENSE_GLM_ARCHITECTURES)
# Said in errors: the families whose models slurmrl builds from config.json
BUILT_FAMILIES = ("Qwen2, Qwen3, Llama, Qwen3-MoE, DeepSeek-V3, Kimi-K2, GLM-4 (and GLM-4-0414), GLM-4.5/4.7 and "
                  "GLM-4.7-Flash")
# slime's --spec layer specs (module, function) whose layers slurmrl builds itself, for these architectures
BUILT_SPECS = {("slime_plugins.models.glm4", "get_glm_spec"): DENSE_GLM_ARCHITECTURES}
# Hybrids whose linear-attention layers are gated delta nets: why slurmrl cannot build them yet
GATED_DELTA_NET_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
GATED_DELTA_NET_BLOCKER = (
    "Qwen3-Next and Qwen3.5 interleave gated delta net layers, which megatron-core 0.16.1 builds only with "
    "flash-linear-attention's Triton kernels (the fla package, absent from slurmrl's machines) and only "
    "without packed sequences (every slurmrl micro-batch is packed)")


def routed_experts(config: dict[str, Any]) -> int:
    """A config.json's routed experts under its family's key (Qwen's num_experts, Mixtral's
    num_local_experts, DeepSeek's n_routed_experts); 0 for a dense model."""
    return int(config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0)


def declared_mtp_layers(config: dict[str, Any]) -> int:
    """The MTP layers a config.json declares (DeepSeek's num_nextn_predict_layers); 0 for a family without."""
    archs = config.get("architectures") or []
    return int(config.get("num_nextn_predict_layers") or 0) if archs and archs[0] in MTP_ARCHITECTURES else 0


def mtp_layer_prefixes(config: dict[str, Any], kept: int = 0) -> tuple[str, ...]:
    """The HF name prefixes of the MTP layers config.json declares, after the first `kept`: HF keeps MTP
    layer k as decoder layer num_hidden_layers + k."""
    first = int(config.get("num_hidden_layers") or 0)
    return tuple(f"model.layers.{layer}." for layer in range(first + kept, first + declared_mtp_layers(config)))


def dense_first_layers(config: dict[str, Any]) -> int:
    """How many first layers have a dense MLP in an expert-bias MoE: DeepSeek's first_k_dense_replace, or
    GLM-4.7-Flash's mlp_layer_types ("dense" then "sparse"; ValueError for any other order)."""
    kinds = config.get("mlp_layer_types")
    if kinds is None:
        return int(config.get("first_k_dense_replace") or 0)
    dense = next((i for i, kind in enumerate(kinds) if kind != "dense"), len(kinds))
    if any(kind != "sparse" for kind in kinds[dense:]):
        raise ValueError(f"config.json: mlp_layer_types {kinds} is not supported: megatron-core's --moe-layer-freq "
                         "here takes dense layers first, then MoE ones")
    return dense
