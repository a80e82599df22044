"""HF <-> torch_dist conversion: bit-identical round trips, and clear errors with no output for
damaged or inconsistent input."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from ckpt_tools.convert import hf_to_torch_dist, torch_dist_to_hf
from ckpt_tools.hf_checkpoint import CheckpointError
from ckpt_tools.inspect import roundtrip_differences
from ckpt_tools.torch_dist import read_metadata
from ckpt_tools.tracker import TRACKER
from tests.ckpt_tools.tiny_hf import make_tiny_hf


def _roundtrip(hf: Path, tmp: Path, **kwargs) -> Path:
    hf_to_torch_dist(hf, tmp / "td", progress=False, **kwargs)
    return torch_dist_to_hf(tmp / "td", tmp / "back", hf, progress=False)


@pytest.mark.parametrize(("arch", "tied"), [("qwen3", False), ("qwen3", True), ("qwen2", False),
                                            ("llama", False), ("llama", True), ("qwen3_moe", False),
                                            ("deepseek_v3", False), ("glm4_moe", False),
                                            ("glm4_moe_lite", False), ("glm", False), ("glm4", False),
                                            ("minimax_m2", False), ("qwen3_next", False), ("qwen3_5", False),
                                            ("qwen3_5", True), ("qwen3_5_moe", False), ("qwen3_5_moe_vl", False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_roundtrip_is_bit_identical(tmp_path: Path, arch: str, tied: bool, dtype: torch.dtype) -> None:
    hf = make_tiny_hf(arch, tmp_path / "hf", tied, dtype=dtype)
    back = _roundtrip(hf, tmp_path, make_vocab_size_divisible_by=96)  # 128 -> 192: padding is exercised
    assert roundtrip_differences(hf, back) == []
    stored = read_metadata(tmp_path / "td" / "iter_0000000").state_dict_metadata
    assert stored["embedding.word_embeddings.weight"].size[0] == 192
    assert ("output_layer.weight" in stored) == (not tied)
    assert (tmp_path / "td" / TRACKER).read_text() == "0"


def test_fp16_and_release_layout(tmp_path: Path) -> None:
    hf = make_tiny_hf("qwen3", tmp_path / "hf", tied=False, dtype=torch.float16)
    hf_to_torch_dist(hf, tmp_path / "td", iteration=None, progress=False)
    assert (tmp_path / "td" / TRACKER).read_text() == "release"
    assert (tmp_path / "td" / "release" / "common.pt").is_file()
    back = torch_dist_to_hf(tmp_path / "td", tmp_path / "back", hf, progress=False)
    assert roundtrip_differences(hf, back) == []


def test_sharded_input_and_sharded_output(tmp_path: Path) -> None:
    hf = make_tiny_hf("qwen3", tmp_path / "hf", tied=False)
    sharded = tmp_path / "sharded"
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(hf).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    hf_to_torch_dist(sharded, tmp_path / "td", progress=False)
    back = torch_dist_to_hf(tmp_path / "td", tmp_path / "back", hf, shard_bytes=100_000, progress=False)
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert roundtrip_differences(hf, back) == []


def test_cast_dtype(tmp_path: Path) -> None:
    hf = make_tiny_hf("llama", tmp_path / "hf", tied=False)
    hf_to_torch_dist(hf, tmp_path / "td", dtype=torch.bfloat16, progress=False)
    md = read_metadata(tmp_path / "td" / "iter_0000000").state_dict_metadata
    assert md["decoder.layers.mlp.linear_fc1.weight"].properties.dtype == torch.bfloat16


def _no_output(tmp_path: Path) -> None:
    assert not (tmp_path / "td").exists()
    assert not list(tmp_path.glob(".td.partial-*"))


def test_truncated_safetensors_is_refused(tmp_path: Path) -> None:
    hf = make_tiny_hf("qwen3", tmp_path / "hf", tied=False)
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="truncated|damaged"):
        hf_to_torch_dist(hf, tmp_path / "td", progress=False)
    _no_output(tmp_path)


def test_missing_shard_is_refused(tmp_path: Path) -> None:
    hf = make_tiny_hf("qwen3", tmp_path / "hf", tied=False)
    from transformers import AutoModelForCausalLM
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(hf).save_pretrained(sharded, max_shard_size="100KB")
    victim = sorted(sharded.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"shard .*{victim.name}.* missing"):
        hf_to_torch_dist(sharded, tmp_path / "td", progress=False)
    _no_output(tmp_path)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("hidden_size", 96, "config.json and weights disagree"),
    ("num_hidden_layers", 3, "weights lack model.layers.2"),
    ("num_hidden_layers", 1, "tensors config.json does not describe"),
    ("architectures", ["GPT2LMHeadModel"], "GPT2LMHeadModel is not supported"),
    ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
    ("use_sliding_window", True, "use_sliding_window=true is not supported"),
])
def test_config_that_disagrees_with_weights_is_refused(tmp_path: Path, field: str, value, message: str) -> None:
    hf = make_tiny_hf("qwen3", tmp_path / "hf", tied=False)
    config = json.loads((hf / "config.json").read_text())
    config[field] = value
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        hf_to_torch_dist(hf, tmp_path / "td", progress=False)
    _no_output(tmp_path)


def test_cli_errors_are_one_line_and_exit_nonzero(tmp_path: Path) -> None:
    hf = make_tiny_hf("qwen3", tmp_path / "hf", tied=False)
    (tmp_path / "td").mkdir()
    result = subprocess.run([sys.executable, "-m", "ckpt_tools", "hf-to-torch-dist", "--hf", str(hf),
                             "--out", str(tmp_path / "td")], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr == f"python -m ckpt_tools: error: --out {tmp_path / 'td'} already exists; remove it or choose another folder\n"


def test_cli_converts_inspects_and_verifies(tmp_path: Path) -> None:
    hf = make_tiny_hf("qwen3_moe", tmp_path / "hf", tied=False)
    cli = [sys.executable, "-m", "ckpt_tools"]
    run = lambda *a: subprocess.run([*cli, *a], capture_output=True, text=True, check=True).stdout  # noqa: E731
    run("hf-to-torch-dist", "--hf", str(hf), "--out", str(tmp_path / "td"), "--no-progress")
    listing = run("inspect", str(tmp_path / "td"))
    assert "iteration 0" in listing
    assert re.search(r"decoder\.layers\.mlp\.experts\.experts\.linear_fc1\.weight +\[2, 4, 64, 64\] +float32 +8 chunks", listing)
    run("torch-dist-to-hf", "--ckpt", str(tmp_path / "td"), "--ckpt-step", "0", "--out", str(tmp_path / "back"),
        "--hf-config", str(hf), "--no-progress")
    assert roundtrip_differences(hf, tmp_path / "back") == []
    verdict = run("verify", "--hf", str(hf))
    assert "bit-identical" in verdict and "Megatron logits equal HF's" in verdict
    # The logits check can fail: no float32 pipeline is exact to zero.
    strict = subprocess.run([*cli, "verify", "--hf", str(hf), "--atol", "0"], capture_output=True, text=True)
    assert strict.returncode == 1 and "Megatron logits differ from HF by" in strict.stderr


def test_cli_shards_as_hf_and_transformers_loads_the_shards(tmp_path: Path) -> None:
    """--max-shard-size takes HF's spelling; the shards, their index and the weights match what
    huggingface_hub's own splitter plans, and transformers loads the sharded folder."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = make_tiny_hf("qwen3", tmp_path / "hf", tied=False)
    hf_to_torch_dist(hf, tmp_path / "td", progress=False)
    subprocess.run([sys.executable, "-m", "ckpt_tools", "torch-dist-to-hf", "--ckpt", str(tmp_path / "td"),
                    "--out", str(tmp_path / "back"), "--hf-config", str(hf), "--max-shard-size", "100KB",
                    "--threads", "3", "--no-progress"], check=True, capture_output=True)
    back = tmp_path / "back"
    index = json.loads((back / "model.safetensors.index.json").read_text())
    ours = {name: load_file(back / file)[name] for name, file in index["weight_map"].items()}
    plan = split_torch_state_dict_into_shards(ours, max_shard_size="100KB")
    assert len(plan.filename_to_tensors) > 2
    assert index["weight_map"] == plan.tensor_to_filename
    assert index["metadata"]["total_size"] == plan.metadata["total_size"]
    assert sorted(p.name for p in back.glob("*.safetensors")) == sorted(plan.filename_to_tensors)
    assert roundtrip_differences(hf, back) == []
    original = AutoModelForCausalLM.from_pretrained(hf).state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(back).state_dict()
    assert loaded.keys() == original.keys()
    assert all(torch.equal(loaded[k], original[k]) for k in original)


@pytest.mark.parametrize(("text", "size"), [("5GB", 5 * 10**9), ("100KB", 100_000), ("2GiB", 2 * 2**30),
                                            ("1.5MB", 1_500_000), ("123456", 123456), ("7 mib", 7 * 2**20)])
def test_max_shard_size_takes_hf_units(text: str, size: int) -> None:
    from ckpt_tools.shard_size import parse_shard_size
    assert parse_shard_size(text) == size


def test_bad_max_shard_size_is_one_line(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "ckpt_tools", "torch-dist-to-hf", "--ckpt", str(tmp_path),
                             "--out", str(tmp_path / "o"), "--hf-config", str(tmp_path), "--max-shard-size", "5 gigs"],
                            capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert "--max-shard-size '5 gigs' is not a size" in result.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_qwen3_next_mtp_module_is_left_out(tmp_path: Path, arch: str) -> None:
    """Qwen3-Next's (and Qwen3.5's) released checkpoints keep a multi-token prediction module under mtp. (which
    slurmrl does not build): it converts without it, and back to HF with it copied from --hf-config's weights (a
    --hf-config without weights: without it); another stray tensor is still refused."""
    hf = make_tiny_hf(arch, tmp_path / "hf", tied=False)
    weights = safetensors.torch.load_file(hf / "model.safetensors")
    hidden = weights["model.norm.weight"].shape[0]
    mtp = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden), "mtp.norm.weight": torch.randn(hidden),
           "mtp.layers.0.input_layernorm.weight": torch.randn(hidden)}
    safetensors.torch.save_file({**weights, **mtp}, hf / "model.safetensors", metadata={"format": "pt"})
    stored = read_metadata(hf_to_torch_dist(hf, tmp_path / "td", progress=False)).state_dict_metadata
    assert not [key for key in stored if key.startswith("mtp.")]
    assert roundtrip_differences(hf, torch_dist_to_hf(tmp_path / "td", tmp_path / "back", hf, progress=False)) == []
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text((hf / "config.json").read_text())
    back = torch_dist_to_hf(tmp_path / "td", tmp_path / "back2", tmp_path / "config_only", progress=False)
    assert roundtrip_differences(hf, back) == [f"{name} only in {hf}" for name in sorted(mtp)]
    safetensors.torch.save_file({**weights, "model.stray.weight": torch.randn(hidden)}, hf / "model.safetensors",
                                metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.stray.weight"):
        hf_to_torch_dist(hf, tmp_path / "td2", progress=False)


def test_qwen3_5_multimodal_keeps_its_vision_tower_and_fused_experts(tmp_path: Path) -> None:
    """A released Qwen3.5-MoE checkpoint's layout: its language model converts (each layer's fused experts split
    into megatron's per-expert slices, as transformers' per-expert save would be); the vision tower is not
    converted but written back from --hf-config's weights, and the experts fused again (the round trip above);
    a --hf-config without weights is refused, naming the vision tower."""
    hf = make_tiny_hf("qwen3_5_moe_vl", tmp_path / "hf", tied=False)
    names = set(safetensors.torch.load_file(hf / "model.safetensors"))
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in names
    assert any(name.startswith("model.visual.") for name in names)
    stored = read_metadata(hf_to_torch_dist(hf, tmp_path / "td", progress=False)).state_dict_metadata
    assert list(stored["decoder.layers.0.mlp.experts.experts.linear_fc1.weight"].size) == [4, 64, 64]
    assert not [key for key in stored if "visual" in key]
    config = json.loads((hf / "config.json").read_text())
    (tmp_path / "more_experts").mkdir()
    for name in ("model.safetensors", "config.json"):
        (tmp_path / "more_experts" / name).write_bytes((hf / name).read_bytes())
    config["text_config"]["num_experts"] = 8
    (tmp_path / "more_experts" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"layers.0.mlp.experts.gate_up_proj is \[4, 64, 64\], the config "
                                              r"implies \[8, 64, 64\]"):
        hf_to_torch_dist(tmp_path / "more_experts", tmp_path / "td2", progress=False)
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text((hf / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"holds no weights: .*vision tower \(model.visual."):
        torch_dist_to_hf(tmp_path / "td", tmp_path / "back", config_only, progress=False)


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])  # glm4_moe: a dense first layer, layers keyed one by one
def test_a_moe_layers_pre_mlp_norm_is_keyed_as_slimes_and_older_checkpoints_still_load(
        tmp_path: Path, arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron's TransformerEngine spec (slime's) keys a MoE layer's pre-MLP norm pre_mlp_layernorm.weight, a dense
    layer's under its fused linear; slurmrl keyed both the dense way before, and its older checkpoints still load."""
    from ckpt_tools import mapping
    from ckpt_tools.verify import logits_max_diff

    def norm_keys(ckpt: Path) -> set[str]:
        stored = read_metadata(ckpt / "iter_0000000").state_dict_metadata
        return {k for k in stored if k.endswith(("pre_mlp_layernorm.weight", "linear_fc1.layer_norm_weight"))}

    hf = make_tiny_hf(arch, tmp_path / "hf", False)
    config = json.loads((hf / "config.json").read_text())
    dense = {f"decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight"
             for i in range(config.get("first_k_dense_replace", 0))}
    hf_to_torch_dist(hf, tmp_path / "td", progress=False)
    moe = norm_keys(tmp_path / "td") - dense
    assert moe and all(k.endswith("pre_mlp_layernorm.weight") for k in moe), norm_keys(tmp_path / "td")
    monkeypatch.setattr(mapping, "MOE_NORM_KEY", mapping.DENSE_NORM_KEY)  # as slurmrl wrote them before
    hf_to_torch_dist(hf, tmp_path / "legacy", progress=False)
    monkeypatch.undo()
    assert not any(k.endswith("pre_mlp_layernorm.weight") for k in norm_keys(tmp_path / "legacy"))
    back = torch_dist_to_hf(tmp_path / "legacy", tmp_path / "back", hf, progress=False)
    assert roundtrip_differences(hf, back) == []
    assert logits_max_diff(hf, tmp_path / "legacy" / "iter_0000000") < 1e-5
