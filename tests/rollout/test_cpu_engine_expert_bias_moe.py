"""The stand-in engine serves a tiny DeepSeek-V3 (MLA with YaRN), GLM-4.5 and GLM-4.7-Flash (all: shared
experts, expert-bias routing, a dense first layer as first_k_dense_replace gives real checkpoints) and
MiniMax-M2 (expert-bias routing in every layer, Mixtral's checkpoint names) through transformers: greedy
outputs with transformers' log-probs, and an update to other weights from disk and over a weight-update
group (experts under their per-expert checkpoint names, routing biases and the dense layer's MLP included)
serves those. The DeepSeek and GLM checkpoints carry a multi-token prediction layer, whose tensors the
engine passes over, as SGLang's main model does (its draft model would load them)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rollout.weight_group import create_group
from tests.ckpt_tools.tiny_hf import tiny_hf_with_tokenizer
from tests.rollout.cpu_engine_helpers import EngineProcess, free_port
from tests.rollout.test_cpu_engine_api import in_thread

GROUP_JOIN_S = 60  # the weight-update group's rendezvous and one update, each
PROMPT = [5, 17, 42, 9, 77, 3]
PROBE = {"input_ids": PROMPT, "return_logprob": True,
         "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}


_DENSE = {f"model.layers.0.mlp.{proj}.weight": None for proj in ("gate_proj", "up_proj", "down_proj")}
# tiny_hf arch: (its MTP layers; {a checkpoint name: the engine's name (None: the same)} the update must fill,
# besides the experts); the MiniMax-M2 ones are Mixtral's
FAMILIES = {
    "deepseek_v3_dense_first": (1, _DENSE), "glm4_moe": (1, _DENSE), "glm4_moe_lite": (1, _DENSE),
    "minimax_m2": (0, {"model.layers.0.block_sparse_moe.gate.weight": "model.layers.0.mlp.gate.weight",
                       "model.layers.1.block_sparse_moe.e_score_correction_bias":
                           "model.layers.1.mlp.e_score_correction_bias"}),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def models(arch: str, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("models")
    return {seed: tiny_hf_with_tokenizer(arch, root, seed, mtp_layers=FAMILIES[arch][0]) for seed in (0, 1, 2)}


def _assert_served(engine: EngineProcess, arch: str, tensors: dict[str, torch.Tensor]) -> None:
    for name, served in FAMILIES[arch][1].items():
        assert torch.equal(_served(engine, served or name, tensors[name]), tensors[name]), name


@pytest.fixture(scope="module")
def engine(models: dict[int, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    process = EngineProcess(models[0], tmp_path_factory.mktemp("engine") / "engine.log")
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def _expected_logprobs(model_dir: Path, output: list[int]) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + output])).logits[0, len(PROMPT) - 1:-1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0].tolist()


def test_serves_with_transformers_log_probs(engine: EngineProcess, models: dict[int, Path]) -> None:
    before = engine.generate(PROBE)
    logprobs = [p[0] for p in before["meta_info"]["output_token_logprobs"]]
    assert logprobs == pytest.approx(_expected_logprobs(models[0], before["output_ids"]), abs=1e-4)


def test_updates_from_disk(engine: EngineProcess, models: dict[int, Path], arch: str) -> None:
    """Per-expert checkpoint names fill transformers' fused expert parameters; the routing bias too."""
    before = engine.generate(PROBE)
    response = engine.post("/update_weights_from_disk", {"model_path": str(models[1]), "weight_version": "v1"})
    assert response.status_code == 200, response.text
    after = engine.generate(PROBE)
    assert after["output_ids"] != before["output_ids"]
    logprobs = [p[0] for p in after["meta_info"]["output_token_logprobs"]]
    assert logprobs == pytest.approx(_expected_logprobs(models[1], after["output_ids"]), abs=1e-4)
    _assert_served(engine, arch, load_file(models[1] / "model.safetensors"))


def _served(engine: EngineProcess, name: str, like: torch.Tensor) -> torch.Tensor:
    got = engine.post("/get_weights_by_name", {"name": name, "truncate_size": 10**6}).json()
    return torch.tensor(got, dtype=like.dtype).reshape(like.shape)


def test_updates_over_a_weight_update_group(engine: EngineProcess, models: dict[int, Path], arch: str) -> None:
    """The trainer's HF names (tests/trainer/test_megatron_expert_bias_moe and test_megatron_minimax_m2 publish
    exactly these), broadcast one by one: the dense layer's MLP (MiniMax-M2: the router) is filled, and the
    engine serves the new model."""
    tensors = load_file(models[2] / "model.safetensors")
    mtp, _ = FAMILIES[arch]
    expert = "block_sparse_moe.experts.0.w3" if arch == "minimax_m2" else "mlp.experts.0.up_proj"
    assert f"model.layers.1.{expert}.weight" in tensors
    assert ("model.layers.3.eh_proj.weight" in tensors) == bool(mtp)  # the MTP layer's, passed over
    port = free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "ds", "backend": "gloo"}
    thread, box = in_thread(engine.post, "/init_weights_update_group", init)
    group = create_group("127.0.0.1", port, rank=0, world_size=2, group_name="ds", timeout_s=GROUP_JOIN_S)
    try:
        thread.join(GROUP_JOIN_S)
        assert box["result"].status_code == 200, box["result"].text
        names = list(tensors)
        update = {"names": names, "dtypes": [str(tensors[n].dtype) for n in names],
                  "shapes": [list(tensors[n].shape) for n in names], "group_name": "ds", "weight_version": "v2"}
        assert engine.post("/begin_weight_update", {"selector": "all"}).json()["success"] is True
        thread, box = in_thread(engine.post, "/update_weights_from_distributed", update)
        for name in names:
            group.broadcast(tensors[name].clone(), src=0)
        thread.join(GROUP_JOIN_S)
        assert box["result"].status_code == 200, box["result"].text
        assert engine.post("/end_weight_update", {}).json()["success"] is True
        _assert_served(engine, arch, tensors)
        after = engine.generate(PROBE)
        logprobs = [p[0] for p in after["meta_info"]["output_token_logprobs"]]
        assert logprobs == pytest.approx(_expected_logprobs(models[2], after["output_ids"]), abs=1e-4)
    finally:
        engine.post("/destroy_weights_update_group", {"group_name": "ds"})
        group.close()
