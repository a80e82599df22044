"""--optimizer-cpu-offload (and --overlap-cpu-optimizer-d2h-h2d) on one GPU: the optimizer state
lives in host memory, the step equals the on-device optimizer's, and a checkpoint resumes exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.test_megatron_optimizer import _assert_same, _run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ATOL = 1e-5
OFFLOAD = ["--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d"]


@pytest.mark.parametrize("overlap", [False, True])
def test_cpu_offload_equals_the_device_optimizer_and_resumes(tiny_megatron, tmp_path: Path, overlap: bool) -> None:
    flags = OFFLOAD if overlap else OFFLOAD[:1]
    on_device = _run(tiny_megatron, tmp_path / "device", "uninterrupted", 1, [])[0]
    offloaded = _run(tiny_megatron, tmp_path / "offload", "uninterrupted", 1, flags)[0]
    assert on_device["state_devices"] == ["cuda"] and offloaded["state_devices"] == ["cpu"]
    _assert_same(offloaded, on_device, ATOL)
    resumed = _run(tiny_megatron, tmp_path / "offload", "resumed", 1, flags)[0]
    _assert_same(resumed, offloaded, 0.0)
