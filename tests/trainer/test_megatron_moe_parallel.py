"""MoE with TP = 2 needs sequence parallelism (megatron-core's MoE layer): on a tiny Qwen3-MoE,
TP=2 + SP with expert weights unsplit (--expert-tensor-parallel-size 1, as slime's 30B-A3B recipe),
alone and with experts spread too (EP 2), one RL step gives the same log-probs,
loss, grad norm and new weights as TP=1 (so the router's sequence-parallel gradient is summed over
TP, and expert gradients over the expert-data-parallel group)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt_tools.convert import hf_to_torch_dist
from tests.ckpt_tools.tiny_hf import make_tiny_hf
from tests.rank_devices import rank_devices
from tests.trainer.test_megatron_backend import ATOL, run_all

SP = ["--sequence-parallel"]
LAYOUTS = {
    "tp2_sp_etp1": (2, 2, "sdpa", [*SP, "--expert-tensor-parallel-size", "1"]),
    "tp2_sp_ep2_etp1": (2, 2, "local", [*SP, "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("moe")
    model = make_tiny_hf("qwen3_moe", root / "model", tied=False)
    ckpt = hf_to_torch_dist(model, root / "torch_dist", iteration=None, progress=False)
    runs = {"tp1": (1, 1, "local", [])} | LAYOUTS
    with rank_devices(2):  # every layout on the same device
        return run_all((model, ckpt), root, runs)


def test_moe_tp2_with_sequence_parallel_matches_tp1(results) -> None:
    base = results["tp1"]
    assert base["metrics"]["grad_norm"] > 0.5, "the step must clip to be a test"
    for name in LAYOUTS:
        other = results[name]
        for i, (want, _) in base["logps"].items():
            assert (other["logps"][i][0] - want).abs().max() < ATOL, f"{name}: sample {i} log-probs"
        for key in ("loss", "pg_loss", "clipfrac", "grad_norm"):
            assert other["metrics"][key] == pytest.approx(base["metrics"][key], abs=ATOL), f"{name}: {key}"
        assert other["weights"].keys() == base["weights"].keys()
        for hf_name, tensor in base["weights"].items():
            assert (other["weights"][hf_name] - tensor).abs().max() < ATOL, f"{name}: {hf_name} after the step"
    router = "model.layers.0.mlp.gate.weight"
    assert not torch.equal(base["weights"][router], base["before"][router]), "the router must train to be a test"


def test_moe_tp2_without_sequence_parallel_is_refused(tmp_path: Path) -> None:
    from trainer.args import ArgsError, build_config, build_parser

    model = make_tiny_hf("qwen3_moe", tmp_path / "model", tied=False)
    args = build_parser().parse_args(["--hf-checkpoint", str(model), "--num-rollout", "1", "--n-samples-per-prompt", "2", "--debug-train-only",
                                      "--load-debug-rollout-data", "x", "--tensor-model-parallel-size", "2"])
    with pytest.raises(ArgsError, match="needs --sequence-parallel"):
        build_config(args)
