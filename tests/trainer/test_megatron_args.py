"""The megatron parallelism and optimizer flags of slime's recipes are accepted with their values,
and combinations slurmrl cannot honour are refused naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.args import ArgsError, parse_args

# slime's scripts/run-qwen3-30B-A3B.sh: PERF_ARGS' parallelism and OPTIMIZER_ARGS.
RECIPE_30B_A3B = ["--tensor-model-parallel-size", "4", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
                  "--context-parallel-size", "1", "--expert-model-parallel-size", "8",
                  "--expert-tensor-parallel-size", "1", "--optimizer", "adam", "--weight-decay", "0.1",
                  "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer"]


MOE = {True: {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128}, False: {"architectures": ["Qwen3ForCausalLM"]},
       "deepseek": {"architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": 256}}


def _base(tmp_path: Path, moe: bool | str) -> list[str]:
    model = tmp_path / "model"
    model.mkdir()
    config = MOE[moe]
    (model / "config.json").write_text(json.dumps(config))
    return ["--hf-checkpoint", str(model), "--num-rollout", "1", "--n-samples-per-prompt", "2", "--debug-train-only", "--load-debug-rollout-data", "x"]


def test_the_30b_a3b_recipe_is_accepted(tmp_path: Path) -> None:
    args = parse_args(_base(tmp_path, moe=True) + RECIPE_30B_A3B)
    parallel, optimizer = args.parallel, args.optimizer
    assert (parallel.tensor_model_parallel_size, parallel.sequence_parallel, parallel.expert_model_parallel_size,
            parallel.expert_tensor_parallel_size) == (4, True, 8, 1)
    assert (optimizer.optimizer_cpu_offload and optimizer.overlap_cpu_optimizer_d2h_h2d
            and optimizer.use_precision_aware_optimizer)
    assert optimizer.use_distributed_optimizer, "slime always uses megatron's distributed optimizer"


def test_defaults_are_slimes(tmp_path: Path) -> None:
    args = parse_args(_base(tmp_path, moe=False))
    optimizer, parallel = args.optimizer, args.parallel
    assert (optimizer.optimizer, optimizer.sgd_momentum, optimizer.use_distributed_optimizer,
            parallel.expert_tensor_parallel_size, parallel.sequence_parallel) == ("adam", 0.9, True, None, False)


@pytest.mark.parametrize("moe, flags, message", [
    (True, ["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size 2 with a MoE model needs --sequence-parallel"),
    ("deepseek", ["--tensor-model-parallel-size", "2"],  # DeepSeek's experts are n_routed_experts
     "--tensor-model-parallel-size 2 with a MoE model needs --sequence-parallel"),
    (False, ["--tensor-model-parallel-size", "4", "--expert-tensor-parallel-size", "3"],
     "--expert-tensor-parallel-size 3 must be 1 or more and divide --tensor-model-parallel-size 4"),
    (False, ["--overlap-cpu-optimizer-d2h-h2d"], "--overlap-cpu-optimizer-d2h-h2d needs --optimizer-cpu-offload"),
    (False, ["--train-backend", "fsdp", "--optimizer", "sgd"], "--optimizer sgd: the fsdp backend uses AdamW"),
    (False, ["--optimizer", "lion"], "argument --optimizer: invalid choice: 'lion'"),
])
def test_bad_combinations_are_named(tmp_path: Path, moe: bool | str, flags: list[str], message: str) -> None:
    with pytest.raises(ArgsError) as err:
        parse_args(_base(tmp_path, moe) + flags)
    assert message in str(err.value)
