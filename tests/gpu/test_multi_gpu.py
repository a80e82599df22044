"""The megatron backend over 2 GPUs (NCCL), on the tiny Qwen3 in fp32: one RL step at TP=2 with
sequence parallelism (compiled with --torch-compile or not), at PP=2 and at DP=2 with the
distributed optimizer equals the step at TP=1 (log-probs, loss, grad norm, new weights), and a
checkpoint saved at TP=2 resumes at TP=1 and at PP=2 with the step the uninterrupted run takes.
The CPU tests' workers (tests/trainer), on cuda."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.rank_devices import rank_devices
from tests.trainer.test_megatron_backend import _run

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

ATOL = 1e-4  # fp32; the sharded GEMMs sum in another order than the whole ones
LAYOUTS = {"tp2_sp": (2, 2, ["--sequence-parallel"]), "pp2": (1, 2, ["--pipeline-model-parallel-size", "2"]),
           "dp2": (1, 2, ["--use-distributed-optimizer"]),
           # compiled: the layers' collectives once lost the gradient's path here (issue 29)
           "tp1_compiled": (1, 1, ["--torch-compile"]),
           "tp2_sp_compiled": (2, 2, ["--sequence-parallel", "--torch-compile"])}


@pytest.fixture(scope="module")
def results(tiny_megatron, tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("multi_gpu_runs")
    with rank_devices(2):  # every run on the GPUs, one a rank
        runs = {"tp1": _run(tiny_megatron, tmp, "tp1", 1, 1, "sdpa", [])}
        for name, (tp, world, extra) in LAYOUTS.items():
            runs[name] = _run(tiny_megatron, tmp, name, tp, world, "sdpa", extra)
    return runs


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_one_step_over_two_gpus_equals_tp1(results, name: str) -> None:
    base, other = results["tp1"], results[name]
    assert base["metrics"]["clipfrac"] > 0 and base["metrics"]["grad_norm"] > 0.5, "the step must clip to be a test"
    for i, (want, _) in base["logps"].items():
        assert (other["logps"][i][0] - want).abs().max() < ATOL, f"{name}: sample {i} log-probs"
    for key in ("loss", "pg_loss", "clipfrac", "grad_norm"):
        assert other["metrics"][key] == pytest.approx(base["metrics"][key], abs=ATOL), f"{name}: {key}"
    for hf_name, tensor in base["weights"].items():
        assert not torch.equal(tensor, base["before"][hf_name]), f"{hf_name} must move to be a test"
        assert (other["weights"][hf_name] - tensor).abs().max() < ATOL, f"{name}: {hf_name} after the step"


def test_a_tp2_checkpoint_resumes_at_tp1_and_pp2(tiny_megatron, tmp_path: Path) -> None:
    from bench.multigpu_layouts import RESHARD_ATOL, run_reshard

    rows = run_reshard(*tiny_megatron, tmp_path)
    assert [row["resumed_at"] for row in rows] == ["tp1", "pp2"]
    for row in rows:
        assert row["same_names"], row
        assert max(row["d_loss"], row["d_grad_norm"], row["d_weights_max"]) <= RESHARD_ATOL, row
