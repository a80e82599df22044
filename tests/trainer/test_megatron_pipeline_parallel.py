"""Pipeline parallelism (--pipeline-model-parallel-size) on a tiny Qwen3 (2 layers, tied
embeddings) in gloo processes, through megatron-core's schedules with variable-length packs:
one RL step at PP=2 (with the fused attention and the PPO critic; and with the unfused one)
gives the same log-probs, loss, grad norm and new weights as PP=1 (so the tied embedding's
gradient is summed over the first and last stages, and log-probs computed on the last stage
reach every rank), so do TP=2 + SP with PP=2 and DP=2 with PP=2, and 3 layers split 2 + 1 over two stages;
publishing gathers every stage's weights, and a checkpoint saved at PP=2
resumes at PP=1 and one saved at PP=1 at PP=2, each with the step the uninterrupted run takes."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch

from ckpt_tools.convert import hf_to_torch_dist
from tests.ckpt_tools.tiny_hf import make_tiny_hf
from tests.rank_devices import rank_devices, start_ranks
from tests.rollout.servers import free_port
from tests.trainer.same_step import assert_same_critic_step, assert_same_step
from tests.trainer.test_megatron_backend import ATOL, run_all_models
from tests.trainer.test_megatron_optimizer import _step
from trainer.args import ArgsError, build_config, build_parser

PP2 = ["--pipeline-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def results(tiny_megatron, tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("pp_runs")
    ppo = ["--advantage-estimator", "ppo"]
    # 3 layers over 2 stages, the last with one (--decoder-last-pipeline-num-layers, as slime's recipes)
    model3 = make_tiny_hf("qwen3", tmp / "model3", tied=True, layers=3)
    tiny3 = (model3, hf_to_torch_dist(model3, tmp / "torch_dist3", iteration=None, progress=False))
    layouts = {"pp1": (tiny_megatron, 1, 1, "sdpa", ppo), "pp2": (tiny_megatron, 1, 2, "sdpa", PP2 + ppo),
               "pp2_local": (tiny_megatron, 1, 2, "local", PP2), "pp1_3": (tiny3, 1, 1, "sdpa", []),
               "pp2_2_1": (tiny3, 1, 2, "sdpa", [*PP2, "--decoder-last-pipeline-num-layers", "1"])}
    with rank_devices(2):  # every layout on the same device; those of one world size in one spawn
        return run_all_models(tmp, layouts)


def test_one_step_at_pp2_equals_pp1(results) -> None:
    for name in ("pp2", "pp2_local"):
        assert_same_step(results["pp1"], results[name], name)


def test_one_step_on_four_ranks_over_two_stages_equals_pp1(tiny_megatron, results, tmp_path: Path) -> None:
    """TP=2 + SP with PP=2; and DP=2 with PP=2, where the tied embedding's gradient is summed over the
    data-parallel ranks and over the two stages, and each stage's distributed optimizer gives it to another
    owner (the first stage's first weight, the last stage's last)."""
    with rank_devices(4):
        runs = run_all_models(tmp_path, {"tp2_sp_pp2": (tiny_megatron, 2, 4, "sdpa", PP2 + ["--sequence-parallel"]),
                                         "dp2_pp2": (tiny_megatron, 1, 4, "sdpa", PP2)})
    for name, run in runs.items():
        assert_same_step(results["pp1"], run, name)


def test_uneven_stages_equal_one_stage(results) -> None:
    """3 layers over 2 stages, the last with one (--decoder-last-pipeline-num-layers, as slime's recipes)."""
    assert_same_step(results["pp1_3"], results["pp2_2_1"], "pp2_2_1")


def test_the_critic_at_pp2_equals_pp1(results) -> None:
    assert_same_critic_step(results["pp1"], results["pp2"])


def _resume_worker(rank: int, world: int, port: int, phase: str, model: Path, ckpt: Path, out: Path) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from trainer import checkpoint, dist_env
    from trainer.megatron.backend import MegatronBackend

    args = build_parser().parse_args([
        "--hf-checkpoint", str(model), "--num-rollout", "1", "--n-samples-per-prompt", "2", "--debug-train-only",
        "--load-debug-rollout-data", "unused/{rollout_id}", "--lr", "1e-2", "--adam-eps", "1",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "24", "--pipeline-model-parallel-size", str(world)])
    args = build_config(args)
    backend = MegatronBackend(args, json.loads((model / "config.json").read_text()))
    save = out / f"save_{phase.split('_')[-1]}"
    if phase.startswith("uninterrupted"):
        backend.load(ckpt, weights_only=True)
        _step(backend)
        checkpoint.save(save, 1, lambda tmp: backend.save(tmp, {"rollout_id": 1}))
    else:
        assert backend.load(checkpoint.find_loadable(save), weights_only=False) == {"rollout_id": 1}
    result = {"metrics": _step(backend), "weights": dict(backend.hf_weights())}
    if rank == 0:
        torch.save(result, out / f"{phase}.pt")
    dist_env.shutdown()


@pytest.mark.parametrize("saved_at, resumed_at", [(2, 1), (1, 2)])
def test_a_checkpoint_resumes_at_another_pipeline_size(tiny_megatron, tmp_path: Path, saved_at: int,
                                                       resumed_at: int) -> None:
    model, ckpt = tiny_megatron
    for phase, world in ((f"uninterrupted_{saved_at}", saved_at), (f"resumed_{saved_at}", resumed_at)):
        with rank_devices(2):
            start_ranks(_resume_worker, (world, free_port(), phase, model, ckpt, tmp_path), world)
    before, resumed = (torch.load(tmp_path / f"{phase}_{saved_at}.pt") for phase in ("uninterrupted", "resumed"))
    for key in ("loss", "pg_loss", "grad_norm"):
        assert resumed["metrics"][key] == pytest.approx(before["metrics"][key], abs=ATOL), key
    assert resumed["weights"].keys() == before["weights"].keys()
    for name, tensor in before["weights"].items():
        assert (resumed["weights"][name] - tensor).abs().max() < ATOL, f"{name} after the resumed step"


def _train_only_args(model: Path, *flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["--hf-checkpoint", str(model), "--num-rollout", "1", "--n-samples-per-prompt",
                                      "2", "--debug-train-only", "--load-debug-rollout-data", "x", *flags])


def test_a_pipeline_size_that_does_not_divide_the_layers_is_refused(tiny_megatron) -> None:
    model, _ = tiny_megatron
    args = _train_only_args(model, "--pipeline-model-parallel-size", "3")
    with pytest.raises(ArgsError, match="--pipeline-model-parallel-size 3 cannot split the model's 2 layers"):
        build_config(args)
    args = _train_only_args(model, "--decoder-last-pipeline-num-layers", "1")
    with pytest.raises(ArgsError, match="--decoder-last-pipeline-num-layers needs --pipeline-model-parallel-size > 1"):
        build_config(args)


def test_pipeline_parallel_moe_with_the_allgather_dispatcher_is_refused(tmp_path: Path) -> None:
    model = make_tiny_hf("qwen3_moe", tmp_path / "model", tied=False)
    args = _train_only_args(model, *PP2)
    with pytest.raises(ArgsError, match="needs --moe-token-dispatcher-type alltoall"):
        build_config(args)
