"""The trainer's flags: each bad value gives one clear error naming the flag; the SLURM environment
becomes torch.distributed's; --true-on-policy-mode's check."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from contract.job_dir import JOB_DIR_ENV, TRAINER_FATAL_EXIT, JobDir, read_trainer_fatal
from rollout.tiny_model import write_tiny_model
from trainer import dist_env
from trainer.args import ArgsError, check_model_flags, parse_args
from trainer.batch import TrainSample
from trainer.train_step import OffPolicyError, check_on_policy, logp_mismatch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("args") / "model")


def _base(model: Path, tmp_path: Path) -> list[str]:
    data = tmp_path / "data.jsonl"
    data.write_text('{"input": "repeat 1\\n", "label": "1"}\n')
    return ["--hf-checkpoint", str(model), "--num-rollout", "2", "--prompt-data", str(data),
            "--sglang-router-ip", "127.0.0.1", "--sglang-router-port", "30000", "--n-samples-per-prompt", "4"]


@pytest.mark.parametrize("flags, message", [
    (["--lrr", "1e-6"], "unknown flag --lrr (did you mean --lr?)"),
    (["--global-batch-size", "3"], "--global-batch-size 3 must divide"),
    (["--pipeline-model-parallel-size", "0"], "--pipeline-model-parallel-size must be 1 or more"),
    (["--context-parallel-size", "0"], "--context-parallel-size must be 1 or more"),
    (["--eps-clip-c", "0.5"], "--eps-clip-c must be > 1"),
    (["--n-samples-per-prompt", "1"], "--advantage-estimator grpo needs --n-samples-per-prompt >= 2"),
    (["--custom-rm-path", "nodots"], "--custom-rm-path must be module.function"),
    (["--train-backend", "fsdp", "--ref-load", "x"], "--ref-load: the fsdp backend"),
    (["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method"),
    (["--opd-teacher-load", "t"], "take effect only with --use-opd"),
    (["--use-opd"], "--use-opd needs --opd-type megatron"),
    (["--use-opd", "--opd-type", "megatron"], "needs --opd-teacher-load"),
    (["--use-opd", "--opd-type", "sglang", "--opd-teacher-load", "t"], "--opd-type sglang: teacher log-probs"),
    (["--ref-ckpt-step", "3"], "--ref-ckpt-step needs --ref-load"),
    (["--disable-rollout-global-dataset"], "--disable-rollout-global-dataset: --rollout-function-path supplies"),
    (["--rollout-max-context-len", "10", "--rollout-max-prompt-len", "10"], "must be below --rollout-max-context-len"),
    (["--data-source-path", "my.Source"], "--data-source-path my.Source: prompts come from"),
    (["--train-backend", "fsdp", "--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size is the "
                                                                        "megatron backend's"),
    (["--train-backend", "fsdp", "--recompute-granularity", "selective"], "--recompute-granularity is the megatron"),
    (["--train-backend", "fsdp", "--context-parallel-size", "2"], "--context-parallel-size is the megatron"),
    (["--train-backend", "fsdp", "--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size is the"),
    (["--num-steps-per-rollout", "3"], "--num-steps-per-rollout 3 must divide"),
    (["--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1"], "not both"),
    (["--use-dynamic-batch-size"], "--use-dynamic-batch-size needs --max-tokens-per-gpu"),
    (["--max-tokens-per-gpu", "4096"], "--max-tokens-per-gpu only applies with --use-dynamic-batch-size"),
    (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "64", "--micro-batch-size", "2"],
     "--micro-batch-size 2 is not used with --use-dynamic-batch-size"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be 1 or more"),
    (["--hidden-dropout", "0.1"], "--hidden-dropout 0.1: dropout is not supported in RL training; use 0.0"),
    (["--attention-dropout", "0.05"], "--attention-dropout 0.05: dropout is not supported in RL training"),
    (["--balance-by-flops"], "--balance-by-flops: micro-batches are packed first-fit by tokens"),
    (["--use-rollout-logprobs", "--use-tis"], "--use-rollout-logprobs and --use-tis cannot be set together"),
    (["--kl-coef", "0.1", "--kl-loss-coef", "0.1"], "only one of --kl-coef and --kl-loss-coef"),
    (["--attention-backend", "triton"], "invalid choice: 'triton'"),
    (["--eval-interval", "2"], "--eval-interval needs eval sets: give --eval-prompt-data"),
    (["--eval-interval", "0"], "--eval-interval must be 1 or more"),
    (["--eval-prompt-data", "math", "missing.jsonl"], "--eval-prompt-data math missing.jsonl: no such file"),
    (["--eval-prompt-data", "a", "b", "c"], "--eval-prompt-data takes NAME PATH pairs"),
    (["--n-samples-per-eval-prompt", "0"], "--n-samples-per-eval-prompt must be 1 or more"),
    (["--eval-config", "eval.yaml"], "--eval-config eval.yaml: no such file"),
    (["--eval-max-prompt-len", "512"], "--eval-max-prompt-len 512: slurmrl does not drop long prompts"),
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


def test_every_problem_is_named_at_once(model: Path, tmp_path: Path) -> None:
    """Not only the first: one ArgsError, a line per problem (slime's own refusals among them)."""
    with pytest.raises(ArgsError) as err:
        parse_args(_base(model, tmp_path) + [
            "--rollout-temperature", "0", "--advantage-estimator", "reinforce_plus_plus", "--rollout-batch-size", "4",
            "--over-sampling-batch-size", "2", "--micro-batch-size", "0", "--eps-clip-c", "0.5",
            "--pipeline-model-parallel-size", "0"])
    expected = ["--rollout-temperature 0.0: must be > 0", "--advantage-estimator reinforce_plus_plus requires "
                "advantage normalization", "--over-sampling-batch-size 2 should be greater than or equal to "
                "--rollout-batch-size 4", "--micro-batch-size must be 1 or more", "--eps-clip-c must be > 1",
                "--pipeline-model-parallel-size must be 1 or more"]
    assert len(err.value.problems) == len(expected), err.value.problems
    for message in expected:
        assert sum(message in problem for problem in err.value.problems) == 1, (message, err.value.problems)
    assert str(err.value).splitlines() == err.value.problems


def test_a_refused_flag_accepts_only_what_slurmrl_does_anyway() -> None:
    from trainer.args_parser import Parser, refused

    parser = Parser()
    refused(parser, "--hidden-dropout", "dropout is not supported; use 0.0", allowed=0.0, type=float)
    refused(parser, "--use-wandb", "wandb is not supported; use --tensorboard-dir", switch=True)
    assert parser.parse_args(["--hidden-dropout", "0"]).hidden_dropout == 0.0
    assert parser.parse_args([]).use_wandb is None
    with pytest.raises(ArgsError, match=r"^--hidden-dropout 0.1: dropout is not supported; use 0.0$"):
        parser.parse_args(["--hidden-dropout", "0.1"])
    with pytest.raises(ArgsError, match=r"^--use-wandb: wandb is not supported"):
        parser.parse_args(["--use-wandb"])


def test_slime_recipe_batching_and_numerics_flags(model: Path, tmp_path: Path) -> None:
    """The batching, loss and numerics flags of slime's qwen3 recipes parse to their effect."""
    args = parse_args(_base(model, tmp_path) + [
        "--balance-data", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216", "--use-kl-loss",
        "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl", "--attention-dropout", "0.0", "--hidden-dropout",
        "0.0", "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32", "--attention-backend", "flash",
        "--deterministic-mode", "--calculate-per-token-loss"])
    batching = args.batching
    assert (batching.use_dynamic_batch_size, batching.max_tokens_per_gpu, batching.balance_data) == (True, 9216, True)
    assert args.loss.kl_loss_type == "low_var_kl" and args.loss.ref_model_needed and args.model.deterministic_mode
    # flash: SDPA (the layer spec's implementation) limited to its flash kernel.
    assert (args.model.attention_backend, args.model.attention_kernels) == ("sdpa", "flash")
    defaults = parse_args(_base(model, tmp_path))
    assert (defaults.batching.use_dynamic_batch_size, defaults.batching.micro_batch_size,
            defaults.batching.max_tokens_per_gpu) == (False, 1, None)
    assert (defaults.model.attention_backend, defaults.model.attention_kernels) == ("sdpa", "auto")
    assert parse_args(_base(model, tmp_path) + ["--attention-backend", "unfused"]).model.attention_backend == "local"


def test_a_checkpoint_with_dropout_is_refused(model: Path, tmp_path: Path) -> None:
    import json

    args = parse_args(_base(model, tmp_path))
    config = json.loads((model / "config.json").read_text())
    check_model_flags(args.shape, str(model), config)
    with pytest.raises(ArgsError, match="attention_dropout 0.1: dropout is not supported"):
        check_model_flags(args.shape, str(model), {**config, "attention_dropout": 0.1})


def test_missing_inputs_are_named(model: Path, tmp_path: Path) -> None:
    with pytest.raises(ArgsError, match="--hf-checkpoint .*: no config.json there"):
        parse_args(["--hf-checkpoint", str(tmp_path), "--num-rollout", "1"])
    with pytest.raises(ArgsError, match="--prompt-data .*: no such file"):
        parse_args(_base(model, tmp_path) + ["--prompt-data", str(tmp_path / "none.jsonl")])
    with pytest.raises(ArgsError, match="--sglang-router-ip and --sglang-router-port"):
        parse_args(_base(model, tmp_path)[:6] + ["--n-samples-per-prompt", "4"])
    with pytest.raises(ArgsError, match="--debug-train-only needs --load-debug-rollout-data"):
        parse_args(_base(model, tmp_path) + ["--debug-train-only"])


def test_model_flags_must_agree_with_the_checkpoint(model: Path, tmp_path: Path) -> None:
    import json

    config = json.loads((model / "config.json").read_text())
    args = parse_args(_base(model, tmp_path) + ["--num-layers", "2", "--hidden-size", "64", "--qk-layernorm"])
    check_model_flags(args.shape, str(model), config)  # slime's model flags for the same shape pass
    args = parse_args(_base(model, tmp_path) + ["--hidden-size", "128"])
    with pytest.raises(ArgsError, match="--hidden-size 128 disagrees with .*config.json \\(64\\)"):
        check_model_flags(args.shape, str(model), config)


def test_command_line_error_is_one_line_and_exit_2(model: Path, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "trainer", *_base(model, tmp_path), "--lrr", "1"],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["python -m trainer: error: unknown flag --lrr (did you mean --lr?)"]


def test_a_command_line_error_in_a_jobs_step_is_its_fatal_reason(model: Path, tmp_path: Path) -> None:
    """A restart would read the same flags: the supervisor is told (the fatal reason, a distinct
    exit code) to fail the job at once instead of restarting the trainer into the same error."""
    job_dir = tmp_path / "job"
    done = subprocess.run([sys.executable, "-m", "trainer", *_base(model, tmp_path), "--lrr", "1"],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120,
                          env={**os.environ, JOB_DIR_ENV: str(job_dir)})
    assert done.returncode == TRAINER_FATAL_EXIT, done.stderr
    assert read_trainer_fatal(JobDir(job_dir), launched=0) == \
        "the trainer's flags: unknown flag --lrr (did you mean --lr?)"


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
                         reward=1.0, group_index=0, rollout_log_probs=torch.tensor([-1.0, -2.0, -3.0]))
    sample.old_log_probs = torch.tensor([-1.0, -2.5, -9.0])  # the masked-out token does not count
    assert logp_mismatch([sample]) == pytest.approx(0.5)
    sample.sample_index, sample.weight_version = 7, 3
    with pytest.raises(OffPolicyError, match=r"= 0\.5 exceeds --true-on-policy-tolerance 0\.1: .* \(sample 7, "
                                             r"response token 1 \(id 3\): logp_train -2\.5, logp_rollout -2, "
                                             r"generated at weight version 3; the trainer's weight version 4\)"):
        check_on_policy([sample], 0.1, version=4)
    sample.rollout_log_probs = None
    with pytest.raises(OffPolicyError, match="needs the engines' log-prob"):
        logp_mismatch([sample])


def test_the_schedule_spans_the_run_and_steps_follow_num_steps_per_rollout(model: Path, tmp_path: Path) -> None:
    args = parse_args(_base(model, tmp_path) + ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
                                                "--num-steps-per-rollout", "2", "--lr-warmup-fraction", "0.25"])
    assert args.batching.global_batch_size == 4
    assert args.optimizer.lr_decay_iters == 2 * 2  # --num-rollout 2 x 2 steps
    assert args.optimizer.lr_warmup_iters == 1


def test_ckpt_step_flags_pick_that_iteration_of_ref_load(tmp_path: Path) -> None:
    from ckpt_tools.tracker import iteration_dirname, write_tracker
    from trainer.config import CheckpointOptions
    from trainer.setup import initial_weights

    ref = tmp_path / "ref"
    for step in (1, 2):
        (ref / iteration_dirname(step)).mkdir(parents=True)
        (ref / iteration_dirname(step) / ".metadata").write_bytes(b"")
    write_tracker(ref, 2)
    ckpt = CheckpointOptions(load=None, ckpt_step=None, ref_load=str(ref), ref_ckpt_step=None, opd_teacher_load=None,
                             opd_teacher_ckpt_step=None, save=None, save_interval=0, keep_checkpoints=None,
                             no_save_optim=False, save_hf=None)

    def initial(step: int | None) -> Path:
        return initial_weights(dataclasses.replace(ckpt, ref_ckpt_step=step), "unused", "unused", True, None)

    assert initial(None) == ref / iteration_dirname(2)  # the tracker's
    assert initial(1) == ref / iteration_dirname(1)
    with pytest.raises(ArgsError, match="--ref-load: .*iter_0000003 is not a complete torch_dist checkpoint"):
        initial(3)


def test_deterministic_mode_turns_on_deterministic_algorithms() -> None:
    # In a fresh process: the switch is process-wide.
    code = ("import os, torch; from trainer.numerics import apply_deterministic_mode; apply_deterministic_mode(True); "
            "print(torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic, "
            "torch.backends.cudnn.benchmark, os.environ['CUBLAS_WORKSPACE_CONFIG'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["True", "True", "False", ":4096:8"]


def test_help_shows_every_flags_default() -> None:
    from trainer.args import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "--adam-beta2 ADAM_BETA2 Megatron's default, as in slime (default: 0.999)" in text
    assert "--seed SEED as in slime (default: 1234)" in text
    assert "--train-backend {megatron,fsdp} as in slime (default: megatron)" in text


def test_the_rendezvous_store_listens_on_the_master_address_only() -> None:
    code = ("import os, psutil; from trainer import dist_env; "
            "dist_env.setup(); "
            "dist_env.init_process_group(); port = int(os.environ['MASTER_PORT']); "
            "print(sorted({c.laddr.ip for c in psutil.net_connections('tcp') if c.pid == os.getpid() "
            "and c.status == psutil.CONN_LISTEN and c.laddr.port == port})); dist_env.shutdown()")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC", "MASTER_", "RANK", "WORLD_SIZE"))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "['127.0.0.1']"


def test_gloo_binds_the_interface_on_the_route_to_the_master() -> None:
    # Loopback here; on an isolated devcluster node its veth (tests/integration/test_isolated_job.py).
    assert dist_env._interface_towards("127.0.0.1", 29500) == "lo"
