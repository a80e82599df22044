"""The stand-in engine on a GPU (`python -m rollout.cpu_engine --device cuda`), no SLURM: it generates
what the CPU engine generates, --mem-fraction-static is a cap it enforces, --base-gpu-id picks among
the GPUs it sees, /release_memory_occupation frees the GPU memory it held and /resume_memory_occupation
takes it back, and (2 GPUs) a trainer-side NCCL group brings it new weights into CUDA tensors.
The CPU side of these flags: tests/rollout/test_cpu_engine_device.py."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rollout.cpu_engine.weights import read_safetensors_folder
from rollout.engine_client import EngineClient
from tests.gpu.gpu_cluster import needs_gpus
from tests.rollout.cpu_engine_helpers import REPO, EngineProcess, make_tiny_model

pytestmark = [pytest.mark.gpu, needs_gpus(1)]

PROBE = {"input_ids": [1, 5, 104, 7, 85], "return_logprob": True,
         "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}
# fp32 on both, GEMMs summed in another order: the same greedy tokens, log-probs ~1e-6 apart
GPU_VS_CPU_LOGPROB = 1e-4
ENGINE_START_S = 120
FREED_GB = 1e-3  # what "freed" leaves allocated: nothing of the model (the tiny model is ~10 MB)


def logprobs(out: dict) -> list[float]:
    return [row[0] for row in out["meta_info"]["output_token_logprobs"]]


def memory(engine: EngineProcess) -> dict[str, float]:
    return engine.stats()["memory_usage"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("models")
    return {seed: make_tiny_model(root / f"seed{seed}", seed=seed) for seed in (0, 1)}


@pytest.fixture(scope="module")
def engines(models: dict[int, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EngineProcess]]:
    logs = tmp_path_factory.mktemp("logs")
    started = {"cuda": EngineProcess(models[0], logs / "cuda.log", extra=["--device", "cuda", "--mem-fraction-static",
                                                                         "0.2", "--skip-server-warmup"]),
               "cpu": EngineProcess(models[0], logs / "cpu.log", extra=["--skip-server-warmup"])}
    try:
        for engine in started.values():
            engine.wait_ready(ENGINE_START_S)
        yield started
    finally:
        for engine in started.values():
            engine.stop()


def test_the_gpu_engine_generates_what_the_cpu_engine_does(engines: dict[str, EngineProcess]) -> None:
    gpu, cpu = engines["cuda"], engines["cpu"]
    info = gpu.get("/server_info").json()
    assert info["device"] == "cuda" and info["mem_fraction_static"] == 0.2
    usage = memory(gpu)
    assert usage["allocated_gb"] > 0 and usage["cap_gb"] == pytest.approx(
        0.2 * torch.cuda.get_device_properties(0).total_memory / 1024**3, rel=1e-6)
    on_gpu, on_cpu = gpu.generate(PROBE), cpu.generate(PROBE)
    assert on_gpu["output_ids"] == on_cpu["output_ids"]
    assert max(abs(a - b) for a, b in zip(logprobs(on_gpu), logprobs(on_cpu))) < GPU_VS_CPU_LOGPROB


def test_release_frees_the_gpu_and_resume_takes_it_back(engines: dict[str, EngineProcess]) -> None:
    gpu, client = engines["cuda"], EngineClient(None, 60.0)
    before, held = gpu.generate(PROBE), memory(gpu)
    client.release_memory(gpu.url, ["weights", "kv_cache"])
    freed = memory(gpu)
    assert freed["allocated_gb"] < FREED_GB and freed["reserved_gb"] < FREED_GB, (held, freed)
    assert "cpu_engine memory released tags=weights,kv_cache" in gpu.log_text()
    client.resume_memory(gpu.url, ["weights", "kv_cache"])
    after, back = gpu.generate(PROBE), memory(gpu)  # as held: after a generate (cuBLAS's workspaces made again)
    assert back["allocated_gb"] == pytest.approx(held["allocated_gb"], rel=0.05), (held, back)
    assert (after["output_ids"], logprobs(after)) == (before["output_ids"], logprobs(before)), "the same weights"


@pytest.mark.parametrize(("flags", "message"), [
    (["--mem-fraction-static", "0.000001"], "--mem-fraction-static 1e-06: the model's"),
    (["--base-gpu-id", "64"], "--base-gpu-id 64: this process sees"),
])
def test_what_the_gpu_cannot_take_stops_the_engine_at_start(models: dict[int, Path], flags: list[str],
                                                            message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "rollout.cpu_engine", "--model-path", str(models[0]), "--device",
                           "cuda", "--port", "1", *flags], cwd=REPO, capture_output=True, text=True,
                          timeout=ENGINE_START_S)
    errors = [line for line in done.stderr.splitlines() if line.startswith("cpu_engine: error:")]
    assert done.returncode == 1 and len(errors) == 1 and message in errors[0], done.stderr


@needs_gpus(2)
def test_nccl_weights_reach_the_gpu_engine(models: dict[int, Path], tmp_path: Path) -> None:
    """The trainer's publisher on GPU 0, the engine on GPU 1: an NCCL group (the engine says device
    cuda), the seed-1 weights broadcast into the engine's CUDA tensors, served as version 3."""
    from trainer.publish import WeightPublisher

    engine = EngineProcess(models[0], tmp_path / "engine.log", extra=["--device", "cuda", "--skip-server-warmup"],
                           env={"CUDA_VISIBLE_DEVICES": os.environ.get("SLURMRL_SECOND_GPU", "1")})
    publisher = WeightPublisher("nccl", tmp_path / "job", models[1], None, timeout_s=120)
    try:
        engine.wait_ready(ENGINE_START_S)
        torch.cuda.set_device(0)
        weights = [(name, t.to("cuda:0")) for name, t in read_safetensors_folder(models[1]).items()]
        result = publisher.publish(3, [engine.url], iter(weights))
        assert result.updated == [engine.url] and not result.dropped, result
        assert publisher._group is not None
        assert all(lane.backend == "nccl" for lane in publisher._group.lanes), "a cuda engine joins over NCCL"
        assert EngineClient(None, 60.0).weight_version(engine.url) == 3
        name, tensor = weights[0]
        row = engine.post("/get_weights_by_name", {"name": name, "truncate_size": 1}).json()
        assert torch.tensor(row, dtype=torch.float32).flatten().tolist() == \
            tensor[:1].float().flatten().cpu().tolist()
        reference = EngineProcess(models[1], tmp_path / "ref.log", extra=["--skip-server-warmup"])
        try:
            reference.wait_ready(ENGINE_START_S)
            assert engine.generate(PROBE)["output_ids"] == reference.generate(PROBE)["output_ids"]
        finally:
            reference.stop()
    finally:
        publisher.close()
        engine.stop()
