"""--update-weight-transport tensor on a GPU: the trainer's publisher hands the stand-in engine on its
own GPU every bucket by CUDA IPC handle (/update_weights_from_tensor); the engine serves exactly those
weights (bf16 and fp32 in the same buckets, several buckets) as the new version. With 2 GPUs the
engine sees the shared GPU under another index (CUDA_VISIBLE_DEVICES), which only the handles' GPU
UUID resolves. The CPU form: tests/trainer/test_publish.py and tests/rollout/test_tensor_handles.py."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest
import torch

from rollout.cpu_engine.weights import read_safetensors_folder
from rollout.engine_client import EngineClient
from tests.gpu.gpu_cluster import needs_gpus
from tests.rollout.cpu_engine_helpers import EngineProcess, make_tiny_model

pytestmark = [pytest.mark.gpu, needs_gpus(1)]

ENGINE_START_S = 120
BUCKET = 64 * 1024  # the tiny model is about 320 KiB: several buckets


def test_the_engine_on_the_trainers_gpu_takes_the_weights_by_ipc_handle(tmp_path: Path) -> None:
    from trainer.publish import WeightPublisher

    # children of this process before the test: e.g. torch.compile's worker pool, left by an earlier test
    earlier = {p.pid for p in psutil.Process().children(recursive=True)}
    start, new = make_tiny_model(tmp_path / "seed0", seed=0), make_tiny_model(tmp_path / "seed1", seed=1)
    shared = torch.cuda.device_count() - 1  # the last GPU: index 1 here, index 0 in the engine, with 2 or more
    # the engine's CUDA_VISIBLE_DEVICES names it as this process's own does (physical ids, where that is set)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    engine = EngineProcess(start, tmp_path / "engine.log", extra=["--device", "cuda", "--skip-server-warmup",
                                                                   "--mem-fraction-static", "0.2"],
                           env={"CUDA_VISIBLE_DEVICES": visible.split(",")[shared] if visible else str(shared)})
    publisher = WeightPublisher("tensor", tmp_path / "job", new, None, bucket_bytes=BUCKET, timeout_s=120)
    try:
        engine.wait_ready(ENGINE_START_S)
        weights = [(name, t.to(f"cuda:{shared}", torch.bfloat16 if i % 2 else torch.float32))
                   for i, (name, t) in enumerate(sorted(read_safetensors_folder(new).items()))]
        result = publisher.publish(5, [engine.url], iter(weights))
        assert result.updated == [engine.url] and not result.dropped, result
        assert result.bytes == sum(t.numel() * t.element_size() for _, t in weights)
        assert EngineClient(None, 60.0).weight_version(engine.url) == 5
        # no daemon of ours outlives the publish (torch's CPU sharing would start torch_shm_manager,
        # which holds a step's output open while engines hold its memory)
        engine_tree = {engine.proc.pid, *(p.pid for p in psutil.Process(engine.proc.pid).children(recursive=True))}
        assert [p.cmdline() for p in psutil.Process().children(recursive=True)
                if p.pid not in engine_tree | earlier] == []
        for name, tensor in weights:
            served = engine.post("/get_weights_by_name", {"name": name, "truncate_size": 10**6}).json()
            assert torch.equal(torch.tensor(served, dtype=torch.float32), tensor.float().cpu()), name
    finally:
        publisher.close()
        engine.stop()
