"""A tiny MiniMax-M2 (q/k norms over all heads, sigmoid expert-bias MoE in every layer, Mixtral's checkpoint
names) in the RL loop on one GPU, from slime's scripts/models/minimax-m2.sh flags as they are (its alltoall
dispatcher included, which runs on CUDA only): `python -m trainer` and one stand-in engine on the same GPU behind the
real sglang-router, new weights through disk each rollout, the engine's log-probs the trainer's at every step.
The CPU twin: tests/trainer/test_megatron_minimax_m2.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout.toy_task import write_toy_data
from tests.ckpt_tools.tiny_hf import tiny_hf_with_tokenizer
from tests.gpu.gpu_cluster import needs_gpus
from tests.gpu.test_gpu_expert_bias_moe import SAME_GPU
from tests.rollout.servers import engines_behind_router
from tests.trainer.test_megatron_minimax_m2 import MINIMAX_FLAGS
from tests.trainer.test_rl_loop import metrics, trainer

pytestmark = [pytest.mark.gpu, needs_gpus(1)]


def test_a_minimax_m2_trains_on_policy_with_its_engine_on_the_gpu(tmp_path: Path) -> None:
    model = tiny_hf_with_tokenizer("minimax_m2", tmp_path / "models", seed=0)
    data = write_toy_data(tmp_path / "toy.jsonl", num_prompts=64)
    servers = tmp_path / "servers"
    servers.mkdir()
    engine_flags = ("--device", "cuda", "--mem-fraction-static", "0.2", "--skip-server-warmup")
    with engines_behind_router(model, servers, count=1, deterministic=True, flags=engine_flags) as (router, _):
        trainer((model, data), router, tmp_path / "job", "--num-rollout", "3", "--rollout-batch-size", "8",
                "--lr", "1e-2", "--train-backend", "megatron", "--update-weight-transport", "disk",
                *MINIMAX_FLAGS, "--moe-token-dispatcher-type", "alltoall",
                "--true-on-policy-mode", "--true-on-policy-tolerance", str(SAME_GPU))
    rows = metrics(tmp_path / "job")
    assert [m["rollout_id"] for m in rows] == [0, 1, 2]
    assert all(m["logp_mismatch_max"] < SAME_GPU and m["engines_updated"] == 1 for m in rows), rows
    assert rows[-1]["entropy"] < rows[0]["entropy"], "the weights the engine samples from did not change"
