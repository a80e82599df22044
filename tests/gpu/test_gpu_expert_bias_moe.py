"""A DeepSeek-V3-style tiny model (MLA with YaRN, a shared expert, sigmoid expert-bias grouped routing,
a dense first layer, a multi-token prediction layer trained with --enable-mtp-training) in the RL loop
on one GPU: `python -m trainer` (megatron, from slime's model flags)
on the GPU and one stand-in engine on the same GPU (`--device cuda`) behind the real sglang-router,
new weights through disk each rollout. Every step checks that the engine's log-probs equal the
trainer's (--true-on-policy-mode), which holds only if each version reached the engine intact, routing
biases included; the MTP loss falls. The CPU twin of each part: tests/trainer/test_megatron_expert_bias_moe.py,
tests/trainer/test_megatron_mtp.py and tests/rollout/test_cpu_engine_expert_bias_moe.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout.toy_task import write_toy_data
from tests.ckpt_tools.tiny_hf import tiny_hf_with_tokenizer
from tests.gpu.gpu_cluster import needs_gpus
from tests.rollout.servers import engines_behind_router
from tests.trainer.test_megatron_expert_bias_moe import FAMILIES, MOE_FLAGS
from tests.trainer.test_megatron_mtp import MTP
from tests.trainer.test_rl_loop import metrics, trainer

pytestmark = [pytest.mark.gpu, needs_gpus(1)]

ARCH = "deepseek_v3_dense_first"
# Both on one GPU in fp32, GEMMs (and MLA's absorbed or unabsorbed products) summed in other orders:
# ~1e-6 apart. A version that did not arrive, or arrived without its routing biases, is off by the
# step's size (lr 1e-2): above 1e-2.
SAME_GPU = 1e-4


def test_a_deepseek_v3_style_model_trains_on_policy_with_its_engine_on_the_gpu(tmp_path: Path) -> None:
    model = tiny_hf_with_tokenizer(ARCH, tmp_path / "models", seed=0, mtp_layers=1)
    data = write_toy_data(tmp_path / "toy.jsonl", num_prompts=64)
    servers = tmp_path / "servers"
    servers.mkdir()
    engine_flags = ("--device", "cuda", "--mem-fraction-static", "0.2", "--skip-server-warmup")
    with engines_behind_router(model, servers, count=1, deterministic=True, flags=engine_flags) as (router, _):
        trainer((model, data), router, tmp_path / "job", "--num-rollout", "3", "--rollout-batch-size", "8",
                "--lr", "1e-2", "--train-backend", "megatron", "--update-weight-transport", "disk",
                *FAMILIES[ARCH], *MOE_FLAGS, *MTP, "--true-on-policy-mode", "--true-on-policy-tolerance", str(SAME_GPU))
    rows = metrics(tmp_path / "job")
    assert [m["rollout_id"] for m in rows] == [0, 1, 2]
    assert all(m["logp_mismatch_max"] < SAME_GPU and m["engines_updated"] == 1 for m in rows), rows
    assert rows[-1]["entropy"] < rows[0]["entropy"], "the weights the engine samples from did not change"
    assert rows[-1]["mtp_loss"] < rows[0]["mtp_loss"], [m["mtp_loss"] for m in rows]
