"""Tiny random Hugging Face models on disk (safetensors), for checkpoint-conversion tests."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import transformers

from rollout.tiny_model import write_tiny_model

_COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}
_ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_theta=500000.0)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(rope_theta=1000000.0)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(rope_theta=1000000.0)),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
        dict(rope_theta=1000000.0, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             norm_topk_prob=True),
    ),
    # MLA (with a q LoRA), one shared expert, sigmoid routing with bias over 4 groups of 2 experts; YaRN
    # as DeepSeek-V3's and Kimi-K2's (max_position_embeddings = factor x original), its two mscales unequal
    # so that both the cos/sin concentration and the softmax scale depart from 1.
    "deepseek_v3": (
        transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
        dict(rope_parameters=YARN, num_key_value_heads=4,
             q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8, v_head_dim=16,
             moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=4,
             n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=0),
    ),
}
# GLM-4.5/4.7: DeepSeek-V3's MoE (its first layer dense) under standard attention with a q/k/v bias, q/k norms
# and RoPE over half of each head
_ARCHS["glm4_moe"] = (
    transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM,
    dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
         attention_bias=True, use_qk_norm=True, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
         num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
         first_k_dense_replace=1, num_hidden_layers=3),
)
# GLM-4.7-Flash: DeepSeek-V3's multi-latent attention (plain RoPE) and MoE, its dense first layer given by
# mlp_layer_types; head_dim is qk_rope_head_dim there
_ARCHS["glm4_moe_lite"] = (
    transformers.Glm4MoeLiteConfig, transformers.Glm4MoeLiteForCausalLM,
    dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, num_key_value_heads=4, q_lora_rank=48,
         kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8, v_head_dim=16, moe_intermediate_size=32,
         n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
         routed_scaling_factor=2.5, norm_topk_prob=True, num_hidden_layers=3,
         mlp_layer_types=["dense", "sparse", "sparse"]),
)
# The dense GLM-4s: q/k/v bias, a fused gate_up_proj, RoPE over interleaved pairs of half of each head;
# GLM-4-0414 (glm4) also with norms of the attention's and the MLP's outputs
_GLM_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
_GLM = dict(rope_parameters=_GLM_ROPE, attention_bias=True, pad_token_id=0, eos_token_id=1)  # ids within the tiny vocab
_ARCHS["glm"] = (transformers.GlmConfig, transformers.GlmForCausalLM, _GLM)
_ARCHS["glm4"] = (transformers.Glm4Config, transformers.Glm4ForCausalLM, _GLM)
# MiniMax-M2: every layer MoE (sigmoid routing with an expert bias, no shared experts; intermediate_size is an
# expert's), q/k norms over all heads at once, RoPE over half of each head; saved under Mixtral's names
_ARCHS["minimax_m2"] = (
    transformers.MiniMaxM2Config, transformers.MiniMaxM2ForCausalLM,
    dict(rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
         intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, pad_token_id=0, eos_token_id=1,
         bos_token_id=None),
)
# Qwen3-Next: three gated delta net layers, then one of full attention (its output gated, RoPE over a quarter of
# each head); every layer MoE with a gated shared expert; zero-centred norms
_ARCHS["qwen3_next"] = (
    transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
    dict(rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
         num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
         linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
         moe_intermediate_size=32, shared_expert_intermediate_size=32, norm_topk_prob=True),
)
# Qwen3.5: Qwen3-Next's layers with the gated delta nets' q/k/v, z, b and a projected apart; its MLP dense, or
# (Qwen3.5-MoE) the experts' with a gated shared expert; RoPE over a quarter of each head by transformers' default
_QWEN3_5 = dict(rope_parameters={"rope_type": "default", "rope_theta": 10000000.0}, num_hidden_layers=4,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                linear_conv_kernel_dim=4)
_QWEN3_5_MOE = dict(_QWEN3_5, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=32)
_TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                    num_position_embeddings=16, patch_size=4)


def _qwen3_5_moe_text_config(intermediate_size: int, **text: Any) -> transformers.PretrainedConfig:
    """Qwen3.5-MoE's text config, which has no dense intermediate_size (every layer is MoE)."""
    return transformers.Qwen3_5MoeTextConfig(**text)


def _qwen3_5_moe_vl_config(tie_word_embeddings: bool, **text: Any) -> transformers.PretrainedConfig:
    """Qwen3.5-MoE's released layout: the language model's fields under text_config, a vision tower's beside."""
    return transformers.Qwen3_5MoeConfig(
        text_config=_qwen3_5_moe_text_config(**text, tie_word_embeddings=tie_word_embeddings).to_dict(),
        vision_config=_TINY_VISION, tie_word_embeddings=tie_word_embeddings)


_ARCHS["qwen3_5"] = (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, _QWEN3_5)
_ARCHS["qwen3_5_moe"] = (_qwen3_5_moe_text_config, transformers.Qwen3_5MoeForCausalLM, _QWEN3_5_MOE)


# saved as the released checkpoints keep it: each layer's experts fused (mlp.experts.gate_up_proj, down_proj)
_ARCHS["qwen3_5_moe_vl"] = (_qwen3_5_moe_vl_config, transformers.Qwen3_5MoeForConditionalGeneration, _QWEN3_5_MOE)
ZERO_CENTRED_NORMS = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_vl")
# As real DeepSeek-V3 (3) and Kimi-K2 (1) checkpoints: the first layer's MLP is dense (intermediate_size), the
# next two are MoE.
_ARCHS["deepseek_v3_dense_first"] = (*_ARCHS["deepseek_v3"][:2],
                                     {**_ARCHS["deepseek_v3"][2], "first_k_dense_replace": 1, "num_hidden_layers": 3})
ARCHS = tuple(_ARCHS)


def tiny_config(arch: str, tied: bool = False, layers: int | None = None) -> transformers.PretrainedConfig:
    """make_tiny_hf's config (architectures set), without the weights."""
    config_cls, model_cls, extra = _ARCHS[arch]
    config = config_cls(**{**_COMMON, **extra, **({"num_hidden_layers": layers} if layers else {})},
                        tie_word_embeddings=tied)
    config.architectures = [model_cls.__name__]
    return config


def make_tiny_hf(arch: str, out_dir: str | Path, tied: bool, seed: int = 0,
                 dtype: torch.dtype = torch.float32, layers: int | None = None, mtp_layers: int = 0) -> Path:
    """Save a random tiny `arch` model (one of ARCHS; `layers` layers, default the arch's) to out_dir with
    save_pretrained; returns out_dir. With `mtp_layers`, DeepSeek-V3's multi-token prediction layers
    after the decoder's (which transformers does not build: they are written beside its weights).

    Every parameter is random, norm weights included (around 1), and large enough that a
    transposed, swapped or misplaced tensor changes the logits well beyond float32 noise."""
    config = tiny_config(arch, tied, layers)
    torch.manual_seed(seed)
    model = _ARCHS[arch][1](config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # Qwen3-Next's zero-centred norms scale by 1 + weight (its gated one by weight)
                centre = 0.0 if arch in ZERO_CENTRED_NORMS and "linear_attn.norm" not in name else 1.0
                param.copy_(centre + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's routing bias: on the scale of sigmoid scores
                buffer.copy_(0.1 * torch.randn_like(buffer))
    out_dir = Path(out_dir)
    model.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    if mtp_layers:
        _add_mtp_layers(out_dir, mtp_layers, config.num_hidden_layers)
    if arch == "qwen3_5_moe_vl":
        fuse_experts(out_dir)
    return out_dir


def fuse_experts(hf_dir: Path) -> None:
    """Rewrite a single-file checkpoint's per-expert tensors (transformers' save) as each layer's two fused ones:
    mlp.experts.gate_up_proj [E, 2I, H] (an expert's gate rows, then its up rows) and down_proj [E, H, I]."""
    weights = safetensors.torch.load_file(hf_dir / "model.safetensors")
    layers = sorted({name.split(".experts.")[0] for name in weights if ".mlp.experts.0.gate_proj" in name})
    for layer in layers:
        down = re.compile(rf"{re.escape(layer)}\.experts\.\d+\.down_proj\.weight")
        count = sum(1 for name in weights if down.fullmatch(name))
        projections = ("gate_proj", "up_proj", "down_proj")
        experts = [{proj: weights.pop(f"{layer}.experts.{e}.{proj}.weight") for proj in projections}
                   for e in range(count)]
        weights[f"{layer}.experts.gate_up_proj"] = torch.stack([torch.cat([x["gate_proj"], x["up_proj"]])
                                                                for x in experts])
        weights[f"{layer}.experts.down_proj"] = torch.stack([x["down_proj"] for x in experts])
    safetensors.torch.save_file(weights, hf_dir / "model.safetensors", metadata={"format": "pt"})


def _add_mtp_layers(hf_dir: Path, count: int, layers: int) -> None:
    """DeepSeek-V3's MTP layers as its checkpoints keep them: decoder layers `layers`.. (random, shaped
    as the last decoder layer) with their input norms and projection, final norm, and copies of the
    embedding and the output head; config.json's num_nextn_predict_layers says how many."""
    weights = safetensors.torch.load_file(hf_dir / "model.safetensors")
    last = f"model.layers.{layers - 1}."
    for k in range(count):
        mtp = f"model.layers.{layers + k}."
        for name, tensor in list(weights.items()):
            if name.startswith(last):
                weights[mtp + name[len(last):]] = tensor + 0.05 * torch.randn_like(tensor)
        hidden = weights["model.embed_tokens.weight"].shape[1]
        dtype = weights["model.embed_tokens.weight"].dtype
        for norm in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            weights[mtp + norm] = (1.0 + 0.2 * torch.randn(hidden)).to(dtype)
        weights[mtp + "eh_proj.weight"] = (0.15 * torch.randn(hidden, 2 * hidden)).to(dtype)
        weights[mtp + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
        head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
        weights[mtp + "shared_head.head.weight"] = head.clone()
    safetensors.torch.save_file(weights, hf_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": count}, indent=2))


def tiny_hf_with_tokenizer(arch: str, root: Path, seed: int, mtp_layers: int = 0) -> Path:
    """make_tiny_hf's `arch` (vocab 128) under root, with the tiny tokenizer (105 tokens): a model
    the stand-in engine serves."""
    model = make_tiny_hf(arch, root / f"{arch}{seed}", tied=False, seed=seed, mtp_layers=mtp_layers)
    tokenizer = write_tiny_model(root / f"tokenizer{seed}")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, model / name)
    return model
