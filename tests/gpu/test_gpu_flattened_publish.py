"""The NCCL publish on 2 GPUs, as the CPU tests check it over gloo: trainer (this process) on GPU 0,
an engine-side process (bench/multigpu_engine.py) on GPU 1; fp32 and bf16 tensors in the same
buckets, sent as flattened buckets (one broadcast each, packed on GPU 0), then one broadcast per
tensor when the engine says it is an SGLang older than that format (0.5.5). Each time the engine's
weights must equal the trainer's exactly (the engine starts from zeros, and each publish sends new
values)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.multigpu_weights import post, start_engine, stop_engine
from rollout.weight_group import free_port
from trainer.publish import WeightPublisher

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (trainer on 0, engine on 1)")]
TIMEOUT_S = 120.0  # every engine call and broadcast
BUCKET = 1024 * 1024  # several buckets for the tensors below


def test_flattened_and_per_tensor_nccl_publish_are_bit_exact(tmp_path: Path) -> None:
    torch.cuda.set_device(0)
    shapes = {f"layer.{i}.{kind}": (dtype, [64 + i, 96]) for i in range(12)
              for kind, dtype in (("w", "float32"), ("b", "bfloat16"))}
    shapes_file = tmp_path / "shapes.json"
    shapes_file.write_text(json.dumps({name: [dtype, shape] for name, (dtype, shape) in shapes.items()}))
    port = free_port("127.0.0.1")
    engine = start_engine(port, ["--param-shapes", str(shapes_file)], 1, tmp_path / "engine.log")
    url = f"http://127.0.0.1:{port}"
    publisher = WeightPublisher("nccl", tmp_path, tmp_path, None, bucket_bytes=BUCKET, timeout_s=TIMEOUT_S)
    try:
        assert publisher.backend == "nccl"
        for version, sglang_version in ((1, None), (2, "0.5.5")):
            post(url, "/bench_sglang_version", {"version": sglang_version})
            gen = torch.Generator(device="cuda").manual_seed(version)
            weights = {name: torch.randn(shape, generator=gen, device="cuda").to(getattr(torch, dtype))
                       for name, (dtype, shape) in shapes.items()}
            result = publisher.publish(version, [url], iter(weights.items()))
            assert result.updated == [url], result.dropped
            want = sum(float(t.float().sum()) for t in weights.values())
            got = post(url, "/bench_checksum", {})["checksum"]
            assert got == pytest.approx(want, rel=1e-6, abs=1e-3), sglang_version
    finally:
        publisher.close()
        stop_engine(engine)
