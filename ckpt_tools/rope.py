"""RoPE as config.json gives it, in megatron-core's terms.

transformers >= 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`. Three kinds
are built: plain RoPE; Llama 3.1's scaling, of which megatron-core takes only the factor; and YaRN
under multi-latent attention (DeepSeek-V3, Kimi-K2), whose parameters megatron-core's
YarnRotaryEmbedding and MLA softmax scale take one for one. Anything else, or a YaRN setting that
megatron-core would compute otherwise than transformers, is a ValueError naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Megatron-core hard-codes these Llama-3 RoPE scaling parameters; only the factor is configurable.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    return dict(config.get("rope_parameters") or config.get("rope_scaling") or {})


def rope_type(config: dict[str, Any]) -> str:
    rope = rope_parameters(config)
    return str(rope.get("rope_type", rope.get("type", "default")))


def rope_theta(config: dict[str, Any]) -> float:
    return float(rope_parameters(config).get("rope_theta", config.get("rope_theta", 10000.0)))


def rotary_percent(config: dict[str, Any]) -> float:
    """The share of each head's dimensions that is rotated (GLM-4.5's 0.5: the first half, as megatron's);
    MiniMax-M2's own config.json gives rotary_dim instead (transformers reads it as this share)."""
    factor = rope_parameters(config).get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if factor is None and config.get("rotary_dim"):
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        factor = config["rotary_dim"] / head_dim
    return float(1.0 if factor is None else factor)


@dataclass(frozen=True)
class Yarn:
    """transformers' YaRN parameters (modeling_rope_utils._compute_yarn_parameters, and DeepseekV3's
    softmax scale by mscale_all_dim) as megatron-core's MLATransformerConfig fields."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    # megatron-core's concentration factor is always mscale(factor, mscale) / mscale(factor, mscale_all_dim);
    # transformers' is that only where both are set, else mscale(factor, 1): mscale 1.0 and mscale_all_dim 0
    mscale: float
    mscale_all_dim: float

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Yarn:
        rope = rope_parameters(config)
        if rope.get("attention_factor") is not None:
            raise ValueError("config.json: YaRN attention_factor is not supported: megatron-core derives it from "
                             "factor, mscale and mscale_all_dim")
        if rope.get("truncate", True) is False:
            raise ValueError("config.json: YaRN truncate false is not supported: megatron-core's MLA always "
                             "rounds the correction range to whole dimensions")
        original = rope.get("original_max_position_embeddings") or config.get("max_position_embeddings")
        if not original:
            raise ValueError("config.json: YaRN needs original_max_position_embeddings (or max_position_embeddings)")
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale_all_dim and not mscale:
            raise ValueError("config.json: YaRN mscale_all_dim without mscale is not supported: transformers then "
                             "scales cos/sin by mscale(factor, 1), which megatron-core's MLA cannot")
        # transformers: no factor means max_position_embeddings / original_max_position_embeddings
        factor = rope.get("factor") or config["max_position_embeddings"] / original
        return cls(factor=float(factor), original_max_position_embeddings=int(original),
                   beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                   mscale=float(mscale) if mscale and mscale_all_dim else 1.0,
                   mscale_all_dim=float(mscale_all_dim or 0.0))

    @property
    def scales(self) -> bool:
        """Whether it changes anything: with a factor of 1 or less, YaRN is plain RoPE and both mscales are 1."""
        return self.factor > 1


def gpt_rope_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """GPTModel's RoPE keyword arguments (standard attention): plain or Llama 3.1's scaling, over all of
    each head or its first part."""
    kind = rope_type(config)
    kwargs: dict[str, Any] = {"position_embedding_type": "rope", "rotary_base": rope_theta(config),
                              "rotary_percent": rotary_percent(config)}
    if kind == "llama3":
        rope = rope_parameters(config)
        fixed = {k: rope.get(k) for k in _LLAMA3_FIXED}
        if fixed != _LLAMA3_FIXED:
            raise ValueError(f"config.json: llama3 RoPE scaling needs {_LLAMA3_FIXED} in megatron-core, got {fixed}")
        kwargs.update(rope_scaling=True, rope_scaling_factor=rope["factor"])
    elif kind != "default":
        raise ValueError(f"config.json: RoPE type {kind!r} is not supported for this architecture; supported: "
                         "default, llama3 (and yarn with multi-latent attention)")
    return kwargs


def mla_rope_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """MLATransformerConfig's RoPE fields: plain RoPE, or YaRN."""
    kind = rope_type(config)
    if rotary_percent(config) != 1:
        raise ValueError(f"config.json: partial_rotary_factor {rotary_percent(config)} is not supported with "
                         "multi-latent attention: megatron-core's MLA rotates all of qk_rope_head_dim")
    if kind == "default":
        return {"rope_type": "rope", "rotary_scaling_factor": 1.0, "rotary_base": rope_theta(config)}
    if kind != "yarn":
        raise ValueError(f"config.json: RoPE type {kind!r} is not supported with multi-latent attention; "
                         "supported: default, yarn")
    yarn = Yarn.from_hf_config(config)
    return {"rope_type": "yarn", "rotary_base": rope_theta(config), "rotary_scaling_factor": yarn.factor,
            "original_max_position_embeddings": yarn.original_max_position_embeddings,
            "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow, "mscale": yarn.mscale,
            "mscale_all_dim": yarn.mscale_all_dim}
