"""Context parallelism (--context-parallel-size) on a tiny Qwen3 in gloo processes: each CP rank
holds zigzag chunks of every packed sample, attention gathers K/V over the CP group, and the
loss is computed from log-probs gathered over it. One RL step at CP=2 (and TP=2 + SP + CP=2,
and the PPO critic at CP=2) gives the same log-probs, loss, grad norm and new weights as CP=1;
a checkpoint saved at CP=2 resumes at CP=1 with the step the uninterrupted CP=2 run takes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.rank_devices import rank_devices, start_ranks
from tests.rollout.servers import free_port
from tests.trainer.same_step import assert_same_critic_step, assert_same_step
from tests.trainer.test_megatron_backend import ATOL, _run, run_all
from tests.trainer.test_megatron_optimizer import _step
from trainer.args import ArgsError, build_config, build_parser

CP2 = ["--context-parallel-size", "2"]


@pytest.fixture(scope="module")
def results(tiny_megatron, tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("cp_runs")
    ppo = ["--advantage-estimator", "ppo"]
    with rank_devices(2):  # every layout on the same device
        return run_all(tiny_megatron, tmp, {"cp1": (1, 1, "sdpa", ppo), "cp2": (1, 2, "sdpa", CP2 + ppo)})


def test_one_step_at_cp2_equals_cp1(results) -> None:
    assert_same_step(results["cp1"], results["cp2"], "cp2")


def test_one_step_at_tp2_sp_cp2_equals_cp1(tiny_megatron, results, tmp_path: Path) -> None:
    with rank_devices(4):
        tp2_sp_cp2 = _run(tiny_megatron, tmp_path, "tp2_sp_cp2", 2, 4, "sdpa", CP2 + ["--sequence-parallel"])
    assert_same_step(results["cp1"], tp2_sp_cp2, "tp2_sp_cp2")


def test_the_critic_at_cp2_equals_cp1(results) -> None:
    assert_same_critic_step(results["cp1"], results["cp2"])


def _resume_worker(rank: int, world: int, port: int, phase: str, model: Path, ckpt: Path, out: Path) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from trainer import checkpoint, dist_env
    from trainer.megatron.backend import MegatronBackend

    args = build_parser().parse_args([
        "--hf-checkpoint", str(model), "--num-rollout", "1", "--n-samples-per-prompt", "2", "--debug-train-only",
        "--load-debug-rollout-data", "unused/{rollout_id}", "--lr", "1e-2", "--adam-eps", "1",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "24", "--context-parallel-size", str(world)])
    args = build_config(args)
    backend = MegatronBackend(args, json.loads((model / "config.json").read_text()))
    if phase == "uninterrupted":
        backend.load(ckpt, weights_only=True)
        _step(backend)
        checkpoint.save(out / "save", 1, lambda tmp: backend.save(tmp, {"rollout_id": 1}))
    else:
        assert backend.load(checkpoint.find_loadable(out / "save"), weights_only=False) == {"rollout_id": 1}
    result = {"metrics": _step(backend), "weights": dict(backend.hf_weights())}
    if rank == 0:
        torch.save(result, out / f"{phase}.pt")
    dist_env.shutdown()


def test_a_cp2_checkpoint_resumes_at_cp1(tiny_megatron, tmp_path: Path) -> None:
    model, ckpt = tiny_megatron
    for phase, world in (("uninterrupted", 2), ("resumed", 1)):
        with rank_devices(2):
            start_ranks(_resume_worker, (world, free_port(), phase, model, ckpt, tmp_path), world)
    before, resumed = (torch.load(tmp_path / f"{phase}.pt") for phase in ("uninterrupted", "resumed"))
    for key in ("loss", "pg_loss", "grad_norm"):
        assert resumed["metrics"][key] == pytest.approx(before["metrics"][key], abs=ATOL), key
    for name, tensor in before["weights"].items():
        assert (resumed["weights"][name] - tensor).abs().max() < ATOL, f"{name} after the resumed step"


def test_context_parallel_with_unfused_attention_is_refused(tiny_megatron) -> None:
    model, _ = tiny_megatron
    args = build_parser().parse_args(["--hf-checkpoint", str(model), "--num-rollout", "1", "--n-samples-per-prompt", "2",
                                      "--debug-train-only", "--load-debug-rollout-data", "x", *CP2,
                                      "--attention-backend", "local"])
    with pytest.raises(ArgsError, match="--context-parallel-size 2 needs a fused --attention-backend"):
        build_config(args)
