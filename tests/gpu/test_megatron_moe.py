"""A Qwen3-MoE on one GPU: the router runs without TransformerEngine (megatron-core 0.16.1 leaves
te_general_gemm undefined there), and slime's --moe-token-dispatcher-type alltoall with
--moe-router-dtype fp32 gives the same step as the allgather dispatcher."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt_tools.convert import hf_to_torch_dist
from tests.ckpt_tools.tiny_hf import make_tiny_hf
from tests.trainer.test_megatron_backend import _run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ATOL = 1e-4  # two dispatchers, two GEMM orders on the GPU


def test_alltoall_and_an_fp32_router_equal_allgather(tmp_path: Path) -> None:
    model = make_tiny_hf("qwen3_moe", tmp_path / "model", tied=False)
    tiny = (model, hf_to_torch_dist(model, tmp_path / "torch_dist", iteration=None, progress=False))
    base = _run(tiny, tmp_path, "allgather", 1, 1, "local", ["--moe-token-dispatcher-type", "allgather"])
    other = _run(tiny, tmp_path, "alltoall", 1, 1, "local",
                 ["--moe-token-dispatcher-type", "alltoall", "--moe-router-dtype", "fp32"])
    for i, (want, _) in base["logps"].items():
        assert (other["logps"][i][0] - want).abs().max() < ATOL, f"sample {i} log-probs"
    assert other["metrics"]["loss"] == pytest.approx(base["metrics"]["loss"], abs=ATOL)
    for name, tensor in base["weights"].items():
        assert (other["weights"][name] - tensor).abs().max() < ATOL, f"{name} after the step"
    router = "model.layers.0.mlp.gate.weight"
    assert not torch.equal(base["weights"][router], base["before"][router]), "the router must train to be a test"
