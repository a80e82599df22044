"""The megatron backend on one GPU: a bf16 step (bf16 weights, fp32 main grads and master weights)
takes the fp32 step within bf16's precision, its log-probs equal HF's (fp32) within bf16's
precision, and a checkpoint saved on the GPU resumes to the uninterrupted run's next step bit for
bit (fp32 and bf16: the checkpoint keeps the fp32 masters)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainer import test_megatron_optimizer as optimizer_runs
from tests.trainer.test_megatron_backend import _hf_logps, _run, _samples

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16_LOGP = 0.05  # per token: bf16 keeps 8 bits of mantissa
BF16_WEIGHTS = 1e-3  # lr 1e-2 with Adam eps 1: a step moves a weight by up to ~1e-2
BF16_ROUNDING = 2.0 ** -8  # relative: bf16 keeps 8 bits of mantissa (rounding to nearest: within 2^-9)


def test_a_bf16_step_is_the_fp32_step_and_its_log_probs_are_hfs(tiny_megatron, tmp_path: Path) -> None:
    fp32 = _run(tiny_megatron, tmp_path, "fp32", 1, 1, "local", [])
    bf16 = _run(tiny_megatron, tmp_path, "bf16", 1, 1, "sdpa", ["--bf16"])
    hf = _hf_logps(tiny_megatron[0], _samples(json.loads((tiny_megatron[0] / "config.json").read_text())["vocab_size"]))
    gaps = [(bf16["logps"][i][0] - want).abs().max().item() for i, want in enumerate(hf)]
    assert max(gaps) < BF16_LOGP, f"bf16 log-probs vs HF fp32: {gaps}"
    assert max((fp32["logps"][i][0] - want).abs().max().item() for i, want in enumerate(hf)) < 1e-4
    assert max(gaps) > 0, "bf16 must compute in bf16 to be a test"
    assert bf16["metrics"]["loss"] == pytest.approx(fp32["metrics"]["loss"], abs=BF16_LOGP)
    for name, tensor in fp32["weights"].items():
        # bf16 weights: the fp32 run's rounded (half a unit in the last place, 2^-9 relative), and the step's gap
        gap = (bf16["weights"][name] - tensor).abs() - BF16_ROUNDING * tensor.abs()
        assert gap.max() < BF16_WEIGHTS, f"{name} after the bf16 step"
    # Every fp32 master moved; the bf16 weights published from them may round back (1.0 + 1e-3 is 1.0).
    assert bf16["unmoved_masters"] == [] and fp32["unmoved_masters"] == []


@pytest.mark.parametrize("flags", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_a_checkpoint_saved_on_the_gpu_resumes_the_uninterrupted_run(tiny_megatron, tmp_path: Path,
                                                                    flags: list[str]) -> None:
    """One GPU, the same kernels in both runs: deterministic, so bit-exact in bf16 too."""
    whole = optimizer_runs._run(tiny_megatron, tmp_path, "uninterrupted", 1, flags)[0]
    assert whole["state_devices"] == ["cuda"]
    resumed = optimizer_runs._run(tiny_megatron, tmp_path, "resumed", 1, flags)[0]
    optimizer_runs._assert_same(resumed, whole, 0.0)
