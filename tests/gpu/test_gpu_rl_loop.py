"""The whole loop with the trainer on one GPU: `python -m trainer` (fp32) + 2 CPU engines behind
the real sglang-router, on the toy task. Every step checks that the engines' log-probs equal the
trainer's (--true-on-policy-mode, to a tolerance for two devices), which holds only if each new
version reached the engines intact: over the disk (megatron) and over the engines' weight-update
group (fsdp; the CPU engines say device cpu, so the group is gloo: NCCL refuses two ranks on one
GPU, and a CPU engine cannot join NCCL)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.test_rl_loop import cluster, files, metrics, trainer  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# The trainer (GPU) and the engines (CPU) differ in the order of float32 sums: ~1e-6. A version that
# did not arrive, or arrived damaged, is off by the step's size (lr 1e-2): above 1e-2.
TWO_DEVICES = 1e-4


@pytest.mark.parametrize("backend, transport", [("megatron", "disk"), ("fsdp", "nccl")])
def test_the_gpu_trainer_keeps_cpu_engines_on_policy(files, cluster, tmp_path: Path, backend: str,  # noqa: F811
                                                     transport: str) -> None:
    router, _ = cluster
    trainer(files, router, tmp_path / "job", "--num-rollout", "3", "--rollout-batch-size", "8", "--lr", "1e-2",
            "--train-backend", backend, "--update-weight-transport", transport, "--true-on-policy-mode",
            "--true-on-policy-tolerance", str(TWO_DEVICES))
    rows = metrics(tmp_path / "job")
    assert [m["rollout_id"] for m in rows] == [0, 1, 2]
    assert all(m["logp_mismatch_max"] < TWO_DEVICES and m["engines_updated"] == 2 for m in rows), rows
    assert rows[-1]["entropy"] < rows[0]["entropy"], "the weights the engines sample from did not change"
