"""The trainer's flags: each bad value gives one clear error naming the flag; the SLURM environment
becomes torch.distributed's; --true-on-policy-mode's check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollout.tiny_model import write_tiny_model
from trainer import dist_env
from trainer.args import ArgsError, check_model_flags, parse_args
from trainer.batch import TrainSample
from trainer.loop import OffPolicyError, logp_mismatch


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("args") / "model")


def _base(model: Path, tmp_path: Path) -> list[str]:
    data = tmp_path / "data.jsonl"
    data.write_text('{"input": "repeat 1\\n", "label": "1"}\n')
    return ["--hf-checkpoint", str(model), "--num-rollout", "2", "--prompt-data", str(data),
            "--sglang-router-ip", "127.0.0.1", "--sglang-router-port", "30000"]


@pytest.mark.parametrize("flags, message", [
    (["--lrr", "1e-6"], "unknown flag --lrr (did you mean --lr?)"),
    (["--global-batch-size", "3"], "--global-batch-size 3 must divide"),
    (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size > 1 is not supported"),
    (["--eps-clip-c", "0.5"], "--eps-clip-c must be > 1"),
    (["--n-samples-per-prompt", "1"], "--advantage-estimator grpo needs --n-samples-per-prompt >= 2"),
    (["--custom-rm-path", "nodots"], "--custom-rm-path must be module.function"),
    (["--train-backend", "fsdp", "--ref-load", "x"], "--ref-load: the fsdp backend"),
    (["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method"),
    (["--eval-interval", "2"], "--eval-interval needs eval sets: give --eval-prompt-data"),
    (["--eval-interval", "0"], "--eval-interval must be 1 or more"),
    (["--eval-prompt-data", "math", "missing.jsonl"], "--eval-prompt-data math missing.jsonl: no such file"),
    (["--eval-prompt-data", "a", "b", "c"], "--eval-prompt-data takes NAME PATH pairs"),
    (["--n-samples-per-eval-prompt", "0"], "--n-samples-per-eval-prompt must be 1 or more"),
    (["--eval-config", "eval.yaml"], "--eval-config eval.yaml: give the eval sets as --eval-prompt-data"),
    (["--eval-max-prompt-len", "512"], "--eval-max-prompt-len 512: slurmrl does not drop long prompts"),
    (["--eval-reward-key", "acc"], "--eval-reward-key acc: rewards are numbers"),
    (["--load-debug-rollout-data-subsample", "0.5"], "--load-debug-rollout-data-subsample 0.5: replaying part"),
    (["--debug-rollout-only", "--debug-train-only", "--load-debug-rollout-data", "x"], "exclude each other"),
    (["--debug-rollout-only", "--load-debug-rollout-data", "x"], "--debug-rollout-only generates its rollouts"),
    (["--debug-train-only", "--load-debug-rollout-data", "x", "--eval-interval", "1", "--eval-prompt-data", "PROMPTS"],
     "--debug-train-only has no engines to evaluate on"),
])
def test_bad_flags_are_named(model: Path, tmp_path: Path, flags: list[str], message: str) -> None:
    with pytest.raises(ArgsError) as err:
        parse_args(_base(model, tmp_path) + flags)
    assert message in str(err.value)


def test_a_refused_flag_accepts_only_what_slurmrl_does_anyway() -> None:
    from trainer.args import _Parser, refused

    parser = _Parser()
    refused(parser, "--hidden-dropout", "dropout is not supported; use 0.0", allowed=0.0, type=float)
    refused(parser, "--use-wandb", "wandb is not supported; use --tensorboard-dir", switch=True)
    assert parser.parse_args(["--hidden-dropout", "0"]).hidden_dropout == 0.0
    assert parser.parse_args([]).use_wandb is None
    with pytest.raises(ArgsError, match=r"^--hidden-dropout 0.1: dropout is not supported; use 0.0$"):
        parser.parse_args(["--hidden-dropout", "0.1"])
    with pytest.raises(ArgsError, match=r"^--use-wandb: wandb is not supported"):
        parser.parse_args(["--use-wandb"])


def test_missing_inputs_are_named(model: Path, tmp_path: Path) -> None:
    with pytest.raises(ArgsError, match="--hf-checkpoint .* has no config.json"):
        parse_args(["--hf-checkpoint", str(tmp_path), "--num-rollout", "1"])
    with pytest.raises(ArgsError, match="--prompt-data .* does not exist"):
        parse_args(_base(model, tmp_path) + ["--prompt-data", str(tmp_path / "none.jsonl")])
    with pytest.raises(ArgsError, match="--sglang-router-ip and --sglang-router-port"):
        parse_args(_base(model, tmp_path)[:6])
    with pytest.raises(ArgsError, match="--debug-train-only needs --load-debug-rollout-data"):
        parse_args(_base(model, tmp_path) + ["--debug-train-only"])


def test_model_flags_must_agree_with_the_checkpoint(model: Path, tmp_path: Path) -> None:
    import json

    config = json.loads((model / "config.json").read_text())
    args = parse_args(_base(model, tmp_path) + ["--num-layers", "2", "--hidden-size", "64", "--qk-layernorm"])
    check_model_flags(args, config)  # slime's model flags for the same shape pass
    args = parse_args(_base(model, tmp_path) + ["--hidden-size", "128"])
    with pytest.raises(ArgsError, match="--hidden-size 128 disagrees with .*config.json \\(64\\)"):
        check_model_flags(args, config)


def test_command_line_error_is_one_line_and_exit_2(model: Path, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "trainer", *_base(model, tmp_path), "--lrr", "1"],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["python -m trainer: error: unknown flag --lrr (did you mean --lr?)"]


def test_slurm_step_environment_becomes_torch_distributed() -> None:
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "localhost",
           "SLURM_JOB_ID": "1234"}
    dist_env.setup(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("3", "4", "1")
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == str(20000 + 1234)
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "5", "SLURM_STEP_NODELIST": "x"}
    dist_env.setup(torchrun)
    assert torchrun["RANK"] == "0", "torchrun's variables win over SLURM's"


def test_true_on_policy_check_measures_the_largest_gap() -> None:
    sample = TrainSample(tokens=torch.arange(5), response_length=3, loss_mask=torch.tensor([1.0, 1.0, 0.0]),
                         reward=1.0, rollout_log_probs=torch.tensor([-1.0, -2.0, -3.0]))
    sample.old_log_probs = torch.tensor([-1.0, -2.5, -9.0])  # the masked-out token does not count
    assert logp_mismatch([sample]) == pytest.approx(0.5)
    sample.rollout_log_probs = None
    with pytest.raises(OffPolicyError, match="needs the engines' log-prob"):
        logp_mismatch([sample])
