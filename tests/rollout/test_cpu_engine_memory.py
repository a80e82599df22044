"""The CPU engine's memory-saver routes (--colocate --offload-rollout), as SGLang's: release frees
the weights and holds new requests, the health probe fails while released, resume restores the
weights it had (the current version, not the initial checkpoint), and a tag not released cannot
be resumed."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout.engine_client import EngineClient, EngineError
from tests.rollout.cpu_engine_helpers import EngineProcess, make_tiny_model, wait_until

PROBE = {"input_ids": [1, 5, 104, 7, 85], "return_logprob": True,
         "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("models")
    return {seed: make_tiny_model(root / f"seed{seed}", seed=seed) for seed in (0, 1)}


@pytest.fixture(scope="module")
def engine(models: dict[int, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    proc = EngineProcess(models[0], tmp_path_factory.mktemp("log") / "engine.log",
                         extra=["--skip-server-warmup", "--enable-memory-saver"])
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def logprobs(out: dict[str, Any]) -> list[float]:
    return [row[0] for row in out["meta_info"]["output_token_logprobs"]]


def test_release_frees_and_resume_restores_the_current_version(engine: EngineProcess, models: dict[int, Path]) -> None:
    client = EngineClient(None, 30.0)
    client.load_from_disk(engine.url, models[1], 7, timeout_s=30)  # not the initial checkpoint
    before = engine.generate(PROBE)
    client.release_memory(engine.url, ["weights", "kv_cache"])
    info = engine.get("/server_info").json()
    name = "model.embed_tokens.weight"
    assert engine.post("/get_weights_by_name", {"name": name, "truncate_size": 2}).json() == []  # freed
    assert not client.healthy(engine.url)  # SGLang ignores health checks while released
    box: dict[str, Any] = {}
    waiting = threading.Thread(target=lambda: box.update(out=engine.generate(PROBE)), daemon=True)
    waiting.start()
    waiting.join(1.0)
    assert waiting.is_alive() and "out" not in box  # a request waits while the engine is released
    with pytest.raises(EngineError, match="cuda_graph is not released"):
        client.resume_memory(engine.url, ["weights", "cuda_graph"])
    client.resume_memory(engine.url, ["weights"])
    assert waiting.is_alive()  # the KV cache is still released
    client.resume_memory(engine.url, ["kv_cache"])
    waiting.join(30)
    assert logprobs(box["out"]) == logprobs(before)  # the same weights: version 7's, not seed 0's
    assert client.weight_version(engine.url) == 7 and info["weight_version"] == "7"  # an int here, a string on the wire
    assert len(engine.post("/get_weights_by_name", {"name": name, "truncate_size": 2}).json()) == 2
    assert wait_until(lambda: client.healthy(engine.url), 30, "healthy after resume")
    client.close()


def test_release_without_tags_releases_everything_and_bad_tags_are_refused(engine: EngineProcess) -> None:
    client = EngineClient(None, 30.0)
    with pytest.raises(EngineError, match="tags must be a list"):
        client.release_memory(engine.url, ["gpu"])
    before = engine.generate(PROBE)
    engine.post("/release_memory_occupation", {})
    client.resume_memory(engine.url, ["kv_cache", "weights", "cuda_graph"])
    assert logprobs(engine.generate(PROBE)) == logprobs(before)
    with pytest.raises(EngineError, match="kv_cache is not released"):
        client.resume_memory(engine.url, ["kv_cache"])
