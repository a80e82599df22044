"""DeepSeek-V3 (MLA, shared experts, sigmoid expert-bias grouped routing) through `ckpt verify`,
and the config.json fields where megatron-core would compute something else, refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckpt_tools.convert import hf_to_torch_dist, torch_dist_to_hf
from ckpt_tools.hf_checkpoint import CheckpointError, HFCheckpoint
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


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_mtp_layers_convert_both_ways_and_verify(arch: str, tmp_path: Path) -> None:
    """DeepSeek-V3's and GLM-4.5's multi-token prediction layer (HF: decoder layer num_hidden_layers,
    with its norms, input projection and copies of the embedding and head) becomes megatron's
    mtp.layers.0 and back bit for bit; the logits (which do not go through it) match transformers'."""
    hf = make_tiny_hf(arch, tmp_path / "hf", tied=False, mtp_layers=1)
    verdict = verify(hf)
    assert verdict.roundtrip_problems == []
    assert verdict.logits_max_diff is not None and verdict.logits_max_diff <= ATOL
    stored = tensor_entries(read_metadata(hf_to_torch_dist(hf, tmp_path / "td", mtp_layers=1, progress=False)))
    mtp = {key for key in stored if key.startswith("mtp.")}
    assert {"mtp.layers.0.eh_proj.weight", "mtp.layers.0.enorm.weight", "mtp.layers.0.final_layernorm.weight",
            "mtp.layers.0.transformer_layer.mlp.router.expert_bias"} <= mtp, sorted(mtp)
    assert list(stored["mtp.layers.0.eh_proj.weight"].size) == [64, 128]
    assert list(stored["mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight"].size) == [8, 64, 64]


def test_mtp_layers_left_out_unless_asked(tmp_path: Path) -> None:
    """A checkpoint with an MTP layer converts without it (the trainer keeps it only with
    --mtp-num-layers), and back to HF without it; more MTP layers than config.json declares, or any on
    a family without them, are refused by name before anything is written."""
    hf = make_tiny_hf("deepseek_v3", tmp_path / "hf", tied=False, mtp_layers=1)
    stored = tensor_entries(read_metadata(hf_to_torch_dist(hf, tmp_path / "td", progress=False)))
    assert not [key for key in stored if key.startswith("mtp.")]
    back = HFCheckpoint(torch_dist_to_hf(tmp_path / "td", tmp_path / "back", hf, progress=False))
    assert not [name for name in back.shapes if name.startswith("model.layers.2.")]
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers is 1, below --mtp-num-layers 2"):
        hf_to_torch_dist(hf, tmp_path / "td2", mtp_layers=2, progress=False)
    qwen = make_tiny_hf("qwen3", tmp_path / "qwen", tied=False)
    with pytest.raises(CheckpointError, match="--mtp-num-layers 1: Qwen3ForCausalLM has no multi-token prediction"):
        hf_to_torch_dist(qwen, tmp_path / "td3", mtp_layers=1, progress=False)
    assert not (tmp_path / "td2").exists() and not (tmp_path / "td3").exists()
