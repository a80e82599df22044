"""The Hugging Face architectures slurmrl builds, by family; torch-free, so that flag checks at
submission can ask."""

from __future__ import annotations

from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                           "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")
# DeepSeek-V3's MoE: sigmoid expert-bias routing over groups, shared experts, first_k_dense_replace dense layers
# (GLM-4.5/4.7 has it too, under standard attention)
EXPERT_BIAS_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")


def routed_experts(config: dict[str, Any]) -> int:
    """A config.json's routed experts under its family's key (Qwen's num_experts, Mixtral's
    num_local_experts, DeepSeek's n_routed_experts); 0 for a dense model."""
    return int(config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0)
