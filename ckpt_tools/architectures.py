"""The Hugging Face architectures slurmrl builds, by family; torch-free, so that flag checks at
submission can ask."""

from __future__ import annotations

from typing import Any

# Qwen3.5: Qwen3-Next's layers (its MLP dense or MoE), the gated delta nets projecting q/k/v, z, b and a apart;
# its released checkpoints are multimodal (the language model under model.language_model., a vision tower)
QWEN3_5_MOE_ARCHITECTURES = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
QWEN3_5_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", *QWEN3_5_MOE_ARCHITECTURES)
MULTIMODAL_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                           "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM", "GlmForCausalLM",
                           "Glm4ForCausalLM", "MiniMaxM2ForCausalLM", "Qwen3NextForCausalLM", *QWEN3_5_ARCHITECTURES)
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM",
                     "MiniMaxM2ForCausalLM", "Qwen3NextForCausalLM", *QWEN3_5_MOE_ARCHITECTURES)
# MiniMax-M2: every layer's MLP is the experts' (Mixtral's checkpoint names: block_sparse_moe, w1/w3/w2), routed
# by sigmoid scores with an expert bias, no shared experts; q/k norms over all heads at once, not per head
MINIMAX_ARCHITECTURES = ("MiniMaxM2ForCausalLM",)
# DeepSeek-V3's MoE: sigmoid expert-bias routing over groups, shared experts, dense first layers (GLM-4.5/4.7
# has it under standard attention, GLM-4.7-Flash under DeepSeek's multi-latent attention; MiniMax-M2 without
# groups, shared experts or dense layers)
EXPERT_BIAS_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM",
                             *MINIMAX_ARCHITECTURES)
MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM")
# Their checkpoints keep num_nextn_predict_layers multi-token prediction (MTP) layers after the decoder's
MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM")
# The dense GLM-4s (glm-4-9b-chat-hf; GLM-4-0414 and GLM-Z1): a q/k/v bias, one fused gate_up_proj, RoPE over
# interleaved pairs of the first part of each head; GLM-4-0414 also normalises the attention's and the MLP's
# outputs before each residual add (its post_self_attn_layernorm and post_mlp_layernorm)
DENSE_GLM_ARCHITECTURES = ("GlmForCausalLM", "Glm4ForCausalLM")
POST_NORM_ARCHITECTURES = ("Glm4ForCausalLM",)
# Their config.json's attention_bias is a bias on q, k and v only (megatron's add_qkv_bias)
QKV_BIAS_GLM_ARCHITECTURES = ("Glm4MoeForCausalLM", *DENSE_GLM_ARCHITECTURES)
# q/k norms whatever config.json says (Qwen3's per head, MiniMax-M2's over all heads)
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM", *QWEN3_5_ARCHITECTURES,
                         *MINIMAX_ARCHITECTURES)
# Said in errors: the families whose models slurmrl builds from config.json
BUILT_FAMILIES = ("Qwen2, Qwen3, Llama, Qwen3-MoE, Qwen3-Next, Qwen3.5 (dense and MoE), DeepSeek-V3, Kimi-K2, "
                  "GLM-4 (and GLM-4-0414), GLM-4.5/4.7, GLM-4.7-Flash and MiniMax-M2")
# slime's --spec layer specs (module, function) whose layers slurmrl builds itself, for these architectures
# Qwen3-Next: gated delta net (linear-attention) layers between full-attention ones whose output is gated
# (megatron's attention_output_gate), zero-centred norms (--apply-layernorm-1p), a gated shared expert
QWEN3_NEXT_ARCHITECTURES = ("Qwen3NextForCausalLM",)
GATED_DELTA_NET_ARCHITECTURES = (*QWEN3_NEXT_ARCHITECTURES, *QWEN3_5_ARCHITECTURES)
BUILT_SPECS = {("slime_plugins.models.glm4", "get_glm_spec"): DENSE_GLM_ARCHITECTURES,
               ("slime_plugins.models.minimax_m2", "get_minimax_m2_layer_spec"): MINIMAX_ARCHITECTURES,
               ("slime_plugins.models.qwen3_next", "get_qwen3_next_spec"): QWEN3_NEXT_ARCHITECTURES,
               ("slime_plugins.models.qwen3_5", "get_qwen3_5_spec"): QWEN3_5_ARCHITECTURES}


def routed_experts(config: dict[str, Any]) -> int:
    """A config.json's routed experts under its family's key (Qwen's num_experts, Mixtral's
    num_local_experts, DeepSeek's n_routed_experts); 0 for a dense model."""
    return int(config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0)


def expert_ffn_size(config: dict[str, Any]) -> int | None:
    """One expert's MLP width: moe_intermediate_size, or (Mixtral, MiniMax-M2) intermediate_size."""
    if not routed_experts(config):
        return None
    return config.get("moe_intermediate_size") or config["intermediate_size"]


def declared_mtp_layers(config: dict[str, Any]) -> int:
    """The MTP layers a config.json declares (DeepSeek's num_nextn_predict_layers); 0 for a family without."""
    archs = config.get("architectures") or []
    return int(config.get("num_nextn_predict_layers") or 0) if archs and archs[0] in MTP_ARCHITECTURES else 0


def mtp_layer_prefixes(config: dict[str, Any], kept: int = 0) -> tuple[str, ...]:
    """The HF name prefixes of the MTP layers config.json declares, after the first `kept`: HF keeps MTP
    layer k as decoder layer num_hidden_layers + k. Qwen3-Next's and Qwen3.5's released checkpoints keep
    theirs under mtp. (mtp.fc, mtp.layers.K, ...), which slurmrl does not build: always left out."""
    if (config.get("architectures") or [None])[0] in GATED_DELTA_NET_ARCHITECTURES:
        return ("mtp.",)
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


# MiniMax-M2 config.json fields (its remote code's) whose other values transformers' MiniMaxM2 would not
# compute as the checkpoint means, or megatron-core could not: (field, the value taken, why)
_MINIMAX_FIXED = (
    ("scoring_func", "sigmoid", "the router scores experts by sigmoid"),
    ("use_routing_bias", True, "the router adds e_score_correction_bias to choose experts"),
    ("use_qk_norm", True, "q and k are normalised"),
    ("qk_norm_type", "per_layer", "the q/k norms are over all heads at once"),
    ("shared_intermediate_size", 0, "there are no shared experts"),
    # megatron's moe_input_jitter_eps would be the same noise, but a random forward (as dropout) makes the
    # trainer's log-probs differ from those of the same weights
    ("router_jitter_noise", 0.0, "RL training runs without the router's input jitter, as without dropout"),
    ("routed_scaling_factor", 1.0, "transformers' MiniMaxM2 does not scale the routing weights"),
)


def check_minimax_m2(config: dict) -> None:
    """What megatron-core computes like transformers' MiniMaxM2 does, or ValueError naming the config.json field."""
    for field, value, why in _MINIMAX_FIXED:
        if config.get(field, value) != value:
            raise ValueError(f"config.json: {field} {config[field]!r} is not supported: only {value!r} ({why})")
    kinds = config.get("attn_type_list") or []
    if any(kind != 1 for kind in kinds):
        raise ValueError(f"config.json: attn_type_list {kinds} is not supported: every layer must be full "
                         "attention (1); MiniMax-01's lightning attention (0) is not built")


def check_deepseek_v3(config: dict) -> None:
    """What megatron-core's MLA computes like transformers' DeepseekV3 does, or ValueError naming the
    config.json field."""
    if not config.get("rope_interleave", True):
        raise ValueError("config.json: rope_interleave false is not supported: megatron-core's MLA rotates "
                         "interleaved pairs, as DeepSeek's checkpoints do")


def check_expert_bias_moe(config: dict) -> None:
    """What megatron-core's router and layer pattern compute like transformers' DeepseekV3 and Glm4Moe
    (the same TopkRouter) do, or ValueError naming the config.json field."""
    dense, layers = dense_first_layers(config), config["num_hidden_layers"]
    if not 0 <= dense < layers:
        raise ValueError(f"config.json: first_k_dense_replace {dense} must be 0 or more and below "
                         f"num_hidden_layers ({layers}): at least one layer is MoE")
    # MiniMax-M2's router always normalises them
    minimax = config["architectures"][0] in MINIMAX_ARCHITECTURES
    if config["num_experts_per_tok"] > 1 and not config.get("norm_topk_prob", minimax):
        raise ValueError("config.json: norm_topk_prob false is not supported: megatron-core's sigmoid router "
                         "always normalises the top-k scores")
    groups, group_topk = config.get("n_group") or 1, config.get("topk_group") or 1
    if groups > 1 and config["num_experts_per_tok"] != 2 * group_topk:
        raise ValueError(f"config.json: num_experts_per_tok {config['num_experts_per_tok']} must be twice "
                         f"topk_group ({group_topk}): transformers scores a group by its top 2 experts, "
                         "megatron-core by its top num_experts_per_tok / topk_group")


def linear_attention_layers(config: dict[str, Any]) -> tuple[int, ...]:
    """The layers whose token mixer is a gated delta net (Qwen3-Next's and Qwen3.5's layer_types
    "linear_attention", or all but every full_attention_interval-th); () for a model without."""
    if config["architectures"][0] not in GATED_DELTA_NET_ARCHITECTURES:
        return ()
    layers = config["num_hidden_layers"]
    kinds = config.get("layer_types") or ["full_attention" if (i + 1) % config.get("full_attention_interval", 4) == 0
                                          else "linear_attention" for i in range(layers)]
    if len(kinds) != layers or set(kinds) - {"linear_attention", "full_attention"}:
        raise ValueError(f"config.json: layer_types {kinds} must give each of the {layers} layers "
                         "'linear_attention' or 'full_attention'")
    return tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention")


def check_qwen3_next(config: dict[str, Any]) -> None:
    """What slurmrl's Qwen3-Next (and Qwen3.5) computes like transformers' does, or ValueError naming the
    config.json field."""
    linear_attention_layers(config)
    if not config.get("attn_output_gate", True):
        raise ValueError("config.json: attn_output_gate false is not supported: the full-attention layers' output "
                         "is gated (q_proj gives each head's query, then its gate)")
    if config["linear_num_value_heads"] % config["linear_num_key_heads"]:
        raise ValueError(f"config.json: linear_num_value_heads ({config['linear_num_value_heads']}) must be a "
                         f"multiple of linear_num_key_heads ({config['linear_num_key_heads']})")
    if config["architectures"][0] not in MOE_ARCHITECTURES:  # Qwen3.5's dense models
        if routed_experts(config):
            raise ValueError(f"config.json: num_experts {routed_experts(config)} is not supported for "
                             f"{config['architectures'][0]}, whose MLP is dense (Qwen3.5's MoE is "
                             "Qwen3_5MoeForCausalLM)")
        return
    if not config.get("num_experts") or config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
        raise ValueError("config.json: num_experts, decoder_sparse_step and mlp_only_layers must make every layer's "
                         "MLP the experts' (num_experts > 0, decoder_sparse_step 1, no mlp_only_layers)")
    if not config.get("shared_expert_intermediate_size"):
        raise ValueError("config.json: shared_expert_intermediate_size must be above 0: Qwen3-Next's MoE has a gated "
                         "shared expert")
