"""What the HF <-> megatron mapping needs to know of a model, read from its config.json (validated here)."""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_tools.architectures import (
    DENSE_GLM_ARCHITECTURES,
    EXPERT_BIAS_ARCHITECTURES,
    GATED_DELTA_NET_ARCHITECTURES,
    MINIMAX_ARCHITECTURES,
    MLA_ARCHITECTURES,
    MOE_ARCHITECTURES,
    MTP_ARCHITECTURES,
    MULTIMODAL_ARCHITECTURES,
    POST_NORM_ARCHITECTURES,
    QK_NORM_ARCHITECTURES,
    QKV_BIAS_GLM_ARCHITECTURES,
    QWEN3_5_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    check_deepseek_v3,
    check_expert_bias_moe,
    check_minimax_m2,
    check_qwen3_next,
    declared_mtp_layers,
    dense_first_layers,
    linear_attention_layers,
    routed_experts,
)
from ckpt_tools.qwen3_5_config import language_model_config
from ckpt_tools.rope import gpt_rope_kwargs, mla_rope_kwargs


@dataclass(frozen=True)
class MLAShape:
    """DeepSeek's multi-latent attention (config.json names); q_lora_rank None: a plain q_proj."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelShape:
    """What the mapping needs to know of an HF config."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int  # 0 for dense models
    mla: MLAShape | None = None
    shared_experts: bool = False
    expert_bias: bool = False  # the router's e_score_correction_bias (DeepSeek-V3's aux-loss-free balancing)
    dense_layers: int = 0  # DeepSeek's first_k_dense_replace: the first layers' MLP is dense (intermediate_size)
    # Multi-token prediction layers kept (--mtp-num-layers): megatron's mtp.layers.K, HF's decoder layer
    # num_layers + K (a MoE layer with its own norms and input projection)
    mtp_layers: int = 0
    # The dense GLM-4s: HF fuses gate_proj and up_proj into mlp.gate_up_proj (megatron's linear_fc1 layout),
    # rotates interleaved pairs, and (GLM-4-0414) normalises the attention's and the MLP's outputs
    fused_gate_up: bool = False
    rotary_interleaved: bool = False
    post_norms: bool = False
    # MiniMax-M2: q/k norms over all heads' dimensions at once, and Mixtral's checkpoint names for the MoE
    full_qk_norm: bool = False
    mixtral_names: bool = False
    # Qwen3-Next: these layers' token mixer is a gated delta net (ckpt_tools.gated_delta_net, copied by HF's
    # names); the others' attention output is gated (HF's q_proj gives each head's query, then its gate);
    # one shared expert (HF's shared_expert) scaled by a sigmoid gate; zero-centred norms
    linear_attention_layers: tuple[int, ...] = ()
    attention_output_gate: bool = False
    shared_expert_gate: bool = False
    zero_centered_norms: bool = False
    # Qwen3.5: the gated delta nets' in_proj_qkv, in_proj_z, in_proj_b and in_proj_a (Qwen3-Next's fuse them);
    # a multimodal checkpoint's language model under model.language_model. (hf_prefix), beside its vision tower
    split_gdn_projections: bool = False
    hf_prefix: str = "model."
    # The checkpoint keeps each layer's experts in two 3-D tensors (mlp.experts.gate_up_proj [E, 2I, H], down_proj
    # [E, H, I]; released Qwen3.5-MoE checkpoints), not each expert's projections apart: set from its tensor names
    fused_experts: bool = False

    @classmethod
    def from_hf_config(cls, config: dict, make_vocab_size_divisible_by: int = 1, mtp_layers: int = 0) -> ModelShape:
        config = language_model_config(config)
        archs = config.get("architectures") or []
        arch = archs[0] if archs else "(none)"
        if len(archs) > 1 or arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"config.json architectures: {', '.join(archs) or arch} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        glm = arch in QKV_BIAS_GLM_ARCHITECTURES
        # GLM's attention_bias is on q, k and v only (Qwen2's qkv bias)
        for flag in ("mlp_bias", "use_sliding_window") if glm else ("attention_bias", "mlp_bias", "use_sliding_window"):
            if config.get(flag):
                raise ValueError(f"config.json: {flag}=true is not supported for {arch}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act {config['hidden_act']!r} is not supported (only silu)")
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(f"config.json: num_attention_heads ({heads}) is not a multiple of "
                             f"num_key_value_heads ({kv_heads})")
        experts = routed_experts(config)
        mixed = config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1
        if arch == "Qwen3MoeForCausalLM" and mixed:
            raise ValueError("config.json: mlp_only_layers / decoder_sparse_step mix dense and MoE layers, "
                             "which is not supported; every layer must be MoE")
        deepseek = arch in MLA_ARCHITECTURES
        expert_bias = arch in EXPERT_BIAS_ARCHITECTURES
        if expert_bias:
            check_expert_bias_moe(config)
        if deepseek:
            check_deepseek_v3(config)
        minimax = arch in MINIMAX_ARCHITECTURES
        if minimax:
            check_minimax_m2(config)
        gated_delta_net = arch in GATED_DELTA_NET_ARCHITECTURES
        if gated_delta_net:
            check_qwen3_next(config)
        (mla_rope_kwargs if deepseek else gpt_rope_kwargs)(config)  # a RoPE megatron-core computes as transformers
        if mtp_layers and arch not in MTP_ARCHITECTURES:
            raise ValueError(f"--mtp-num-layers {mtp_layers}: {arch} has no multi-token prediction layers; "
                             f"those that do: {', '.join(MTP_ARCHITECTURES)}")
        if mtp_layers > declared_mtp_layers(config):
            raise ValueError(f"num_nextn_predict_layers is {declared_mtp_layers(config)}, below --mtp-num-layers "
                             f"{mtp_layers}: the checkpoint must hold every MTP layer trained")
        vocab = config["vocab_size"]
        multiple = max(1, make_vocab_size_divisible_by)
        return cls(
            architecture=arch,
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=config["qk_nope_head_dim"] + config["qk_rope_head_dim"] if deepseek
            else config.get("head_dim") or config["hidden_size"] // heads,
            vocab_size=vocab,
            padded_vocab_size=-(-vocab // multiple) * multiple,
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or (glm and bool(config.get("attention_bias"))),
            qk_norm=arch in QK_NORM_ARCHITECTURES or (glm and bool(config.get("use_qk_norm"))),
            num_experts=experts if arch in MOE_ARCHITECTURES else 0,
            mla=MLAShape(config.get("q_lora_rank"), config["kv_lora_rank"], config["qk_nope_head_dim"],
                         config["qk_rope_head_dim"], config["v_head_dim"]) if deepseek else None,
            shared_experts=((expert_bias and bool(config.get("n_shared_experts")))
                            or (gated_delta_net and bool(experts))),
            expert_bias=expert_bias,
            dense_layers=dense_first_layers(config) if expert_bias else 0,
            mtp_layers=mtp_layers,
            fused_gate_up=arch in DENSE_GLM_ARCHITECTURES,
            rotary_interleaved=arch in DENSE_GLM_ARCHITECTURES,
            post_norms=arch in POST_NORM_ARCHITECTURES,
            full_qk_norm=minimax,
            mixtral_names=minimax,
            linear_attention_layers=linear_attention_layers(config),
            attention_output_gate=gated_delta_net,
            shared_expert_gate=gated_delta_net and bool(experts),
            zero_centered_norms=gated_delta_net,
            split_gdn_projections=arch in QWEN3_5_ARCHITECTURES,
            hf_prefix="model.language_model." if arch in MULTIMODAL_ARCHITECTURES else "model.",
        )

    @property
    def layers_differ(self) -> bool:
        """Whether megatron keys each layer apart (dense and MoE ones mixed, or linear and full attention)."""
        return bool(self.dense_layers or self.linear_attention_layers)

    @property
    def first_full_attention_layer(self) -> int:
        return next(i for i in range(self.num_layers) if i not in self.linear_attention_layers)

    def moe_layer_pattern(self) -> list[int]:
        """Megatron's --moe-layer-freq as a per-layer list: 1 for a MoE layer, 0 for a dense one."""
        return [0] * self.dense_layers + [1] * (self.num_layers - self.dense_layers)
