"""Qwen3.5's config.json read as its language model's (ckpt_tools.qwen3_5_config), and the fields slurmrl would
compute otherwise than transformers refused by name."""

from __future__ import annotations

import pytest

from ckpt_tools.model_shape import ModelShape
from ckpt_tools.qwen3_5_config import language_model_config
from tests.ckpt_tools.tiny_hf import tiny_config


def _config(arch: str) -> dict:
    return tiny_config(arch).to_dict()


def test_a_multimodal_config_is_read_as_its_language_models() -> None:
    config = _config("qwen3_5_moe_vl")
    del config["text_config"]["rope_parameters"]["partial_rotary_factor"]
    config["text_config"].pop("partial_rotary_factor", None)  # where some transformers versions also write it
    text = language_model_config(config)
    assert text["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and text["model_type"] == "qwen3_5_moe"
    assert "text_config" not in text and "vision_config" not in text and text["hidden_size"] == 64
    # transformers' defaults where config.json says nothing: a quarter of each head rotated, top-k normalised,
    # megatron's (unused) dense width an expert's
    assert text["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert text["norm_topk_prob"] is True and text["intermediate_size"] == text["moe_intermediate_size"] == 32
    assert language_model_config(text) == text
    shape = ModelShape.from_hf_config(config)
    assert (shape.hf_prefix, shape.split_gdn_projections, shape.shared_expert_gate) == (
        "model.language_model.", True, True)
    dense = ModelShape.from_hf_config(_config("qwen3_5"))
    assert (dense.hf_prefix, dense.num_experts, dense.shared_experts, dense.linear_attention_layers) == (
        "model.", 0, False, (0, 1, 2))


@pytest.mark.parametrize(("arch", "field", "value", "message"), [
    ("qwen3_5", "attn_output_gate", False, "attn_output_gate false is not supported"),
    ("qwen3_5", "num_experts", 4, "num_experts 4 is not supported for Qwen3_5ForCausalLM, whose MLP is dense"),
    ("qwen3_5_moe", "norm_topk_prob", False, "norm_topk_prob False is not supported: transformers' Qwen3.5-MoE"),
    ("qwen3_5_moe", "mlp_only_layers", [1], "mlp_only_layers must make every layer's MLP the experts'"),
    ("qwen3_5_moe_vl", "tie_word_embeddings", True, "tie_word_embeddings False and text_config.tie_word_embeddings "
                                                    "True disagree"),
])
def test_a_config_slurmrl_would_compute_otherwise_is_named(arch: str, field: str, value: object,
                                                           message: str) -> None:
    config = _config(arch)
    (config.get("text_config") or config)[field] = value
    with pytest.raises(ValueError, match=f"^config.json: .*{message}"):
        ModelShape.from_hf_config(config)
