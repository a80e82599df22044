"""The stand-in engine serves a tiny DeepSeek-V3 (MLA, shared experts, expert-bias routing) through
transformers: greedy outputs with transformers' log-probs, and a disk update to other weights (experts
under their per-expert checkpoint names, routing biases included) serves those."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.tiny_model import write_tiny_model
from tests.ckpt_tools.tiny_hf import make_tiny_hf
from tests.rollout.cpu_engine_helpers import EngineProcess

PROMPT = [5, 17, 42, 9, 77, 3]
PROBE = {"input_ids": PROMPT, "return_logprob": True,
         "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}


def _deepseek_with_tokenizer(root: Path, seed: int) -> Path:
    """make_tiny_hf's DeepSeek-V3 (vocab 128) with the tiny tokenizer (105 tokens)."""
    model = make_tiny_hf("deepseek_v3", root / f"deepseek{seed}", tied=False, seed=seed)
    tokenizer = write_tiny_model(root / f"tokenizer{seed}")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, model / name)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("deepseek_models")
    return {seed: _deepseek_with_tokenizer(root, seed) for seed in (0, 1)}


@pytest.fixture(scope="module")
def engine(models: dict[int, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    process = EngineProcess(models[0], tmp_path_factory.mktemp("deepseek_engine") / "engine.log")
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


def test_updates_from_disk(engine: EngineProcess, models: dict[int, Path]) -> None:
    """Per-expert checkpoint names fill transformers' fused expert parameters; the routing bias too."""
    before = engine.generate(PROBE)
    response = engine.post("/update_weights_from_disk", {"model_path": str(models[1]), "weight_version": "v1"})
    assert response.status_code == 200, response.text
    after = engine.generate(PROBE)
    assert after["output_ids"] != before["output_ids"]
    logprobs = [p[0] for p in after["meta_info"]["output_token_logprobs"]]
    assert logprobs == pytest.approx(_expected_logprobs(models[1], after["output_ids"]), abs=1e-4)
