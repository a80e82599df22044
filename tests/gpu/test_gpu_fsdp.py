"""The fsdp backend on one GPU in bf16 (fp32 master weights, fp32 gradient reduction): its
log-probs equal plain HF's in fp32 within bf16's precision, and a step lowers the loss."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.trainer.test_fsdp_backend import (  # noqa: F401  (models: a fixture)
    PACKED,
    _hf_alone,
    _hf_model,
    _mean_nll,
    _nll_loss,
    _samples,
    models,
)
from trainer.fsdp_backend import FSDPBackend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16_LOGP = 0.05  # per token: bf16 keeps 8 bits of mantissa


@pytest.fixture(scope="module", autouse=True)
def nccl_process_group(tmp_path_factory):
    """One rank over NCCL: the fsdp backend runs on the GPU when its process group is NCCL's."""
    init = tmp_path_factory.mktemp("pg") / "rendezvous"
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_bf16_log_probs_equal_hfs_and_a_step_lowers_the_loss(models) -> None:  # noqa: F811
    samples, ids = _samples(), list(range(5))
    backend = FSDPBackend(models["actor"], lr=1e-2, batching=PACKED, dtype=torch.bfloat16)
    assert backend.device.type == "cuda" and backend.dtype == torch.bfloat16
    before = backend.log_probs(samples, ids)
    hf = _hf_model(models["actor"])
    gaps = [(before[i][0].cpu() - _hf_alone(hf, s)[0]).abs().max().item() for i, s in zip(ids, samples)]
    assert 0 < max(gaps) < BF16_LOGP, f"bf16 log-probs vs HF fp32: {gaps}"
    metrics = backend.train_step(samples, ids, _nll_loss(len(ids)), need_entropy=False)
    assert metrics["nll"] == pytest.approx(_mean_nll(before), abs=1e-3) and metrics["grad_norm"] > 0
    assert _mean_nll(backend.log_probs(samples, ids)) < metrics["nll"] - 0.1
