"""The stand-in engine's weight loading (rollout.cpu_engine.weights) fills the text model transformers loads from a
multimodal Qwen3.5 checkpoint (Qwen3_5MoeForCausalLM) from that checkpoint's own tensors, as transformers would:
the language model's names (model.language_model.), its fused experts, the vision tower and mtp. passed over as the
class ignores them. The trainer's names (per expert) reach it in tests/trainer/test_megatron_qwen3_next's RL loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM

from rollout.cpu_engine.weights import WeightError, load_into, read_safetensors_folder
from tests.ckpt_tools.tiny_hf import make_tiny_hf


def test_a_multimodal_checkpoint_fills_the_text_model(tmp_path: Path) -> None:
    served = AutoModelForCausalLM.from_pretrained(make_tiny_hf("qwen3_5_moe_vl", tmp_path / "a", tied=False))
    other = make_tiny_hf("qwen3_5_moe_vl", tmp_path / "b", tied=False, seed=1)
    tensors = read_safetensors_folder(other)
    assert any(name.startswith("model.visual.") for name in tensors)
    load_into(served, {**tensors, "mtp.fc.weight": torch.zeros(1)}, complete=True)
    want = AutoModelForCausalLM.from_pretrained(other).state_dict()
    got = served.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[name], want[name]) for name in want)


def test_a_text_model_takes_no_vision_tower(tmp_path: Path) -> None:
    qwen3 = AutoModelForCausalLM.from_pretrained(make_tiny_hf("qwen3", tmp_path / "qwen3", tied=False))
    weights = safetensors.torch.load_file(tmp_path / "qwen3" / "model.safetensors")
    with pytest.raises(WeightError, match="unexpected tensor model.visual.patch_embed.proj.weight"):
        load_into(qwen3, {**weights, "model.visual.patch_embed.proj.weight": torch.zeros(1)}, complete=True)
