"""Qwen3-Next on a GPU with flash-linear-attention's kernel (--qwen-gdn-backend fla, slime's default): the fla
gated delta rule over packed rows computes what slurmrl's torch kernel computes (fp32 and bf16; gradients where fla
trains); and a tiny Qwen3-Next trains in the RL loop on one GPU (`python -m trainer` from slime's model flags, the
torch kernel) with one stand-in engine on the same GPU (transformers' Qwen3Next, which decodes with fla's kernels
where installed) behind the real sglang-router, new weights through disk each rollout, each version on policy.
Qwen3.5 likewise: its gated delta nets' separate projections under fla, and its multimodal MoE checkpoint in the RL
loop (the engine serving its language model). The CPU twins: tests/ckpt_tools/test_gated_delta_net.py and
tests/trainer/test_megatron_qwen3_next.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from ckpt_tools.gated_delta_net import LinearAttention
from ckpt_tools.gated_delta_rule import check_fla_trains
from rollout.toy_task import write_toy_data
from tests.ckpt_tools.test_gated_delta_net import LENGTHS, SHAPE
from tests.ckpt_tools.tiny_hf import tiny_hf_with_tokenizer
from tests.gpu.gpu_cluster import needs_gpus
from tests.rollout.servers import engines_behind_router
from tests.trainer.test_megatron_qwen3_next import QWEN3_5_FLAGS, QWEN3_NEXT_FLAGS
from tests.trainer.test_rl_loop import metrics, trainer

pytestmark = [pytest.mark.gpu, needs_gpus(1),
              pytest.mark.skipif(importlib.util.find_spec("fla") is None,
                                 reason="needs flash-linear-attention (scripts/fetch_device_wheels.sh carries it)")]

# The engine runs fla's kernels (Triton's dot products in TF32: 5.3e-3 from the trainer's fp32 log-probs on one H200,
# weight version 0), the trainer its torch kernel in fp32: a version that did not arrive is off by the step's size
# (lr 5e-2), far above this
SAME_GPU = 2e-2


def _kernels(dtype: torch.dtype, split: bool = False
             ) -> tuple[LinearAttention, LinearAttention, torch.Tensor, torch.Tensor]:
    """The torch and the fla kernel's layers (`split`: Qwen3.5's projections), the same weights; packed rows and
    their bounds."""
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, num_attention_heads=4, layernorm_epsilon=1e-6, params_dtype=dtype,
                               **SHAPE)
    torch_kernel = LinearAttention(config, "torch", split).cuda()
    fla = LinearAttention(config, "fla", split).cuda()
    fla.load_state_dict(torch_kernel.state_dict())
    rows = torch.randn(sum(LENGTHS), SHAPE["hidden_size"], device="cuda", dtype=dtype)
    return torch_kernel, fla, rows, torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("split", [False, True], ids=["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 5e-3), (torch.bfloat16, 3e-2)])
def test_fla_computes_the_torch_kernel_over_packed_rows(dtype: torch.dtype, atol: float, split: bool) -> None:
    torch_kernel, fla, rows, cu = _kernels(dtype, split)
    with torch.no_grad():
        want, got = torch_kernel(rows, cu).float(), fla(rows, cu).float()
    assert (got - want).abs().max() < atol * want.abs().max(), f"max |fla - torch| {(got - want).abs().max():.3g}"


def test_fla_trains_as_the_torch_kernel_or_the_trainer_says_why_not() -> None:
    """fla refuses its backward on Hopper GPUs under Triton < 3.7.1 (wrong results there): the trainer then stops at
    start naming --qwen-gdn-backend; where fla trains, its gradients are the torch kernel's."""
    try:
        check_fla_trains()
    except RuntimeError as e:
        assert str(e).startswith("--qwen-gdn-backend fla: fla cannot train on this machine") and "torch" in str(e)
        pytest.skip(f"fla does not train here: {e}")
    torch_kernel, fla, rows, cu = _kernels(torch.float32)
    for module in (torch_kernel, fla):
        module(rows, cu).square().sum().backward()
    fla_params = dict(fla.named_parameters())
    for name, param in torch_kernel.named_parameters():
        theirs, ours = fla_params[name].grad, param.grad
        assert theirs is not None and ours is not None
        diff = (theirs - ours).abs().max()
        assert diff < 2e-2 * ours.abs().max(), f"{name}: gradients {diff:.3g} apart"


@pytest.mark.parametrize(("arch", "flags"), [("qwen3_next", QWEN3_NEXT_FLAGS), ("qwen3_5_moe_vl", QWEN3_5_FLAGS)])
def test_a_qwen3_next_trains_on_policy_with_its_engine_on_the_gpu(tmp_path: Path, arch: str, flags: list[str]) -> None:
    model = tiny_hf_with_tokenizer(arch, tmp_path / "models", seed=0)
    data = write_toy_data(tmp_path / "toy.jsonl", num_prompts=64)
    servers = tmp_path / "servers"
    servers.mkdir()
    engine_flags = ("--device", "cuda", "--mem-fraction-static", "0.2", "--skip-server-warmup")
    with engines_behind_router(model, servers, count=1, deterministic=True, flags=engine_flags) as (router, _):
        trainer((model, data), router, tmp_path / "job", "--num-rollout", "3", "--rollout-batch-size", "8",
                "--lr", "5e-2", "--train-backend", "megatron", "--update-weight-transport", "disk", *flags,
                "--true-on-policy-mode", "--true-on-policy-tolerance", str(SAME_GPU))
    rows = metrics(tmp_path / "job")
    assert [m["rollout_id"] for m in rows] == [0, 1, 2]
    assert all(m["logp_mismatch_max"] < SAME_GPU and m["engines_updated"] == 1 for m in rows), \
        [m["logp_mismatch_max"] for m in rows]
    assert rows[-1]["entropy"] != rows[0]["entropy"], "the weights the engine samples from did not change"
