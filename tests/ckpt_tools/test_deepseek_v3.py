"""DeepSeek-V3 (MLA, shared experts, sigmoid expert-bias grouped routing) through `ckpt verify`,
and the config.json fields where megatron-core would compute something else, refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckpt_tools.convert import hf_to_torch_dist
from ckpt_tools.hf_checkpoint import CheckpointError
from ckpt_tools.torch_dist import read_metadata, tensor_entries
from ckpt_tools.verify import verify
from tests.ckpt_tools.test_megatron_parity import ATOL
from tests.ckpt_tools.tiny_hf import YARN, make_tiny_hf


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory) -> Path:
    return make_tiny_hf("deepseek_v3", tmp_path_factory.mktemp("deepseek") / "hf", tied=False)


def test_verify_passes(tiny_deepseek: Path) -> None:
    verdict = verify(tiny_deepseek)
    assert verdict.roundtrip_problems == []
    assert verdict.logits_max_diff is not None and verdict.logits_max_diff <= ATOL


def test_dense_first_layers_verify_and_are_keyed_per_layer(tmp_path: Path) -> None:
    """first_k_dense_replace (real DeepSeek-V3: 3, Kimi-K2: 1): the dense layer's MLP (intermediate_size)
    converts both ways bit for bit, with HF's logits; megatron keys each layer apart when dense and
    MoE layers mix (decoder.layers.N.*), as its own saves do."""
    hf = make_tiny_hf("deepseek_v3_dense_first", tmp_path / "hf", tied=False)
    verdict = verify(hf)
    assert verdict.roundtrip_problems == []
    assert verdict.logits_max_diff is not None and verdict.logits_max_diff <= ATOL
    stored = tensor_entries(read_metadata(hf_to_torch_dist(hf, tmp_path / "td", progress=False)))
    assert list(stored["decoder.layers.0.mlp.linear_fc1.weight"].size) == [2 * 128, 64]  # [gate; up] of intermediate
    assert list(stored["decoder.layers.2.mlp.experts.experts.linear_fc2.weight"].size) == [8, 64, 32]
    assert not any(key.startswith("decoder.layers.1.mlp.linear_fc") or key.startswith("decoder.layers.0.mlp.router")
                   or key.startswith("decoder.layers.mlp") for key in stored)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("first_k_dense_replace", 2, r"first_k_dense_replace 2 must be 0 or more and below num_hidden_layers \(2\)"),
    ("norm_topk_prob", False, "norm_topk_prob false is not supported"),
    ("topk_group", 1, "num_experts_per_tok 4 must be twice topk_group"),
    ("rope_interleave", False, "rope_interleave false is not supported"),
    ("rope_parameters", {**YARN, "truncate": False}, "YaRN truncate false is not supported"),
    ("rope_parameters", {**YARN, "mscale": None}, "YaRN mscale_all_dim without mscale is not supported"),
    ("rope_parameters", {**YARN, "attention_factor": 1.5}, "YaRN attention_factor is not supported"),
    ("rope_parameters", {**YARN, "rope_type": "llama3"}, "RoPE type 'llama3' is not supported with multi-latent"),
])
def test_config_megatron_cannot_match_is_refused(tiny_deepseek: Path, tmp_path: Path, field: str, value,
                                                  message: str) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    config = json.loads((tiny_deepseek / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, field: value}))
    (hf / "model.safetensors").symlink_to(tiny_deepseek / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"config.json: {message}"):
        hf_to_torch_dist(hf, tmp_path / "td", progress=False)
    assert not (tmp_path / "td").exists()
