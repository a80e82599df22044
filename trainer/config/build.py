"""build_config: the parsed flags -> a validated TrainerConfig, once. Every check runs and every
failed one is reported (one ArgsError, a line per problem), not only the first; checks of values
derived from a wrong one are skipped. The checks need no model but its config.json, for the
parallel layouts (model-shape flags are checked against it by trainer.args.check_model_flags);
derived values (the attention implementation, the global batch size, the reference model, the API
key, the eval sets...) are computed here into the config's fields. The Namespace is read, never
written."""

from __future__ import annotations

import argparse
import os
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

from ckpt_tools.architectures import MULTIMODAL_ARCHITECTURES
from contract.job_dir import API_KEY_ENV, JobDir, model_files_dir
from rollout.data import PROMPT_SUFFIXES
from rollout.ifbench import missing_evaluation_lib
from rollout.rewards import DICT_REWARDS
from trainer.config.async_checks import check_async
from trainer.config.checks import Checks
from trainer.config.model_checks import check_mtp, check_spec, read_hf_config, validate_megatron_parallel
from trainer.config.plugin_checks import check_loss_plugins, check_patterns, epoch_rollouts
from trainer.config.sections import (
    FULLY_ASYNC_ROLLOUT,
    AsyncOptions,
    BatchingOptions,
    CheckpointOptions,
    EvalOptions,
    LoggingOptions,
    LossOptions,
    ModelOptions,
    OptimizerOptions,
    ParallelOptions,
    PublishOptions,
    RewardOptions,
    RolloutOptions,
    RunOptions,
    ShapeFlags,
)
from trainer.config.trainer_config import SECTIONS, TrainerConfig

# slime's INT4 fake QAT switches (environment variables its INT4 recipes set for every Ray actor)
INT4_QAT_ENV = ("OPEN_TRAINING_INT4_FAKE_QAT_FLAG",)
# slime's default --rollout-function-path: given explicitly, it means the built-in rollout.
SLIME_ROLLOUT = "slime.rollout.sglang_rollout.generate_rollout"
_PLUGIN_PATH_FLAGS = ("custom_megatron_init_path", "custom_megatron_before_log_prob_hook_path",
                      "custom_megatron_before_train_step_hook_path", "custom_rm_path", "custom_generate_function_path",
                      "rollout_function_path", "dynamic_sampling_filter_path", "eval_function_path",
                      "custom_eval_rollout_log_function_path", "custom_loss_function_path",
                      "custom_advantage_function_path", "custom_tis_function_path",
                      "custom_pg_loss_reducer_function_path", "rollout_data_postprocess_path", "buffer_filter_path",
                      "custom_reward_post_process_path", "custom_convert_samples_to_train_data_path")
_WANDB_FLAGS = ("wandb_mode", "wandb_dir", "wandb_key", "wandb_host", "wandb_team", "wandb_project", "wandb_group",
                "wandb_run_id")

Section = TypeVar("Section")


def build_config(args: argparse.Namespace) -> TrainerConfig:
    """The flags as parsed by trainer.args_parser.build_parser -> TrainerConfig, or ArgsError
    with every problem, each naming the flag and the fix."""
    need = Checks()
    rollout_function_path = None if args.rollout_function_path == SLIME_ROLLOUT else args.rollout_function_path
    # Absolute: engines read published weights from here, from their own working directory.
    job_dir = str(Path(args.job_dir or args.save or os.getcwd()).resolve())
    # Supervised, the copy submission kept: the model folder may be gone by a restart.
    model_files = model_files_dir(JobDir(Path(job_dir)), args.hf_checkpoint) if args.supervised else args.hf_checkpoint
    hf_config = (read_hf_config(model_files)
                 if need(Path(model_files, "config.json").is_file(), f"--hf-checkpoint {args.hf_checkpoint}: "
                         "no config.json there; point it at a Hugging Face model folder") else None)
    num_rollout = args.num_rollout if args.num_rollout is not None else epoch_rollouts(args, model_files, need)
    need(num_rollout is None or num_rollout >= 1, f"--num-rollout must be 1 or more, got {num_rollout}")
    _check_parallel(args, hf_config, need)
    global_batch_size = _check_batching(args, need)
    _check_training(args, need)
    check_mtp(args, hf_config, need)
    check_spec(args, hf_config, need)
    eval_datasets = _check_eval(args, need)
    _check_rollout(args, rollout_function_path, need)
    check_async(args, need)
    rollout_max_prompt_len = _check_lengths(args, need)
    _check_rewards(args, need)
    for flag in _PLUGIN_PATH_FLAGS:
        value = rollout_function_path if flag == "rollout_function_path" else getattr(args, flag)
        need(value is None or "." in value, f"--{flag.replace('_', '-')} must be module.function, got {value!r}")
    wandb_given = [f"--{n.replace('_', '-')}" for n in _WANDB_FLAGS if getattr(args, n)]
    need(args.use_wandb or not wandb_given, f"{wandb_given[0] if wandb_given else ''} has no effect without "
                                            "--use-wandb; add --use-wandb or drop it")
    need(args.tb_project_name or not args.tb_experiment_name,
         "--tb-experiment-name needs --tb-project-name (or give --tensorboard-dir)")
    _check_save_hf(args, hf_config, need)
    _check_quantized_rollout(args, hf_config, need)
    need(args.lr_warmup_fraction is None or args.lr_warmup_iters == 0,
         "give --lr-warmup-iters or --lr-warmup-fraction, not both")
    need.raise_any()
    assert global_batch_size is not None  # computed wherever no check failed
    tensorboard_dir = args.tensorboard_dir
    if not tensorboard_dir and (os.environ.get("TENSORBOARD_DIR") or args.tb_project_name):
        tensorboard_dir = os.environ.get("TENSORBOARD_DIR") or str(Path(
            job_dir, "tensorboard_log", args.tb_project_name, args.tb_experiment_name or Path(job_dir).name))
    # Megatron's schedule: decay over the whole run unless told; a warmup fraction is of that.
    total = args.rollout_batch_size * args.n_samples_per_prompt
    assert num_rollout is not None  # (else a check failed)
    lr_decay_iters = args.lr_decay_iters or num_rollout * (total // global_batch_size)
    lr_warmup_iters = args.lr_warmup_iters
    if args.lr_warmup_fraction is not None:
        lr_warmup_iters = int(args.lr_warmup_fraction * lr_decay_iters)
    derived: dict[str, Any] = {
        "rollout_function_path": rollout_function_path,
        "debug_train_only": _debug_train_only(args),
        "num_rollout": num_rollout,
        # The layer spec takes slurmrl's two implementations; the flag's kernel choice is kept apart.
        "attention_kernels": args.attention_backend,
        "attention_backend": "local" if args.attention_backend in ("unfused", "local") else "sdpa",
        "eval_datasets": eval_datasets,
        "rollout_max_prompt_len": rollout_max_prompt_len,
        "eval_reward_key": args.reward_key if args.eval_reward_key is None else args.eval_reward_key,
        "job_dir": job_dir,
        "model_files": model_files,
        "tensorboard_dir": tensorboard_dir,
        "global_batch_size": global_batch_size,
        "lr_decay_iters": lr_decay_iters,
        "lr_warmup_iters": lr_warmup_iters,
        "ref_model_needed": bool(args.use_kl_loss or args.kl_coef),
        # slime: a custom reward post-process (or conversion) gives the rewards trained on, normalized or not
        "eval_max_context_len": args.eval_max_context_len or args.rollout_max_context_len,  # slime's default
        "rewards_normalization": args.rewards_normalization and not (
            args.custom_reward_post_process_path or args.custom_convert_samples_to_train_data_path),
        "api_key": os.environ.get(API_KEY_ENV),  # never on the command line: ps would show it
    }

    def section(cls: type[Section]) -> Section:
        names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        return cls(**{name: derived[name] if name in derived else getattr(args, name) for name in names})

    named = {f.name for cls in SECTIONS for f in fields(cls)}
    return TrainerConfig(
        run=section(RunOptions), model=section(ModelOptions), shape=section(ShapeFlags),
        parallel=section(ParallelOptions), optimizer=section(OptimizerOptions), batching=section(BatchingOptions),
        loss=section(LossOptions), rollout=section(RolloutOptions), reward=section(RewardOptions),
        eval=section(EvalOptions), publish=section(PublishOptions), asynchronous=section(AsyncOptions),
        checkpoint=section(CheckpointOptions),
        logging=section(LoggingOptions),
        plugin_only=tuple((name, value) for name, value in vars(args).items() if name not in named))


def _check_quantized_rollout(args: argparse.Namespace, hf_config: dict[str, Any] | None, need: Checks) -> None:
    """slime publishes FP8 (block-wise) or INT4 (compressed-tensors) weights to engines whose checkpoint
    asks for them, and trains INT4 with fake QAT; slurmrl publishes the trainer's weights unquantized:
    such a job is refused, never run with engines serving what they cannot load as asked."""
    quantization = (hf_config or {}).get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "quantized") if isinstance(quantization, dict) else "quantized"
        need(False, f"--hf-checkpoint {args.hf_checkpoint}: config.json's quantization_config asks the engines for "
                    f"{method} weights; slurmrl publishes the trainer's weights unquantized (slime's FP8/INT4 "
                    "update-weight quantizers are not implemented): use the unquantized checkpoint")
    for variable in INT4_QAT_ENV:
        need(os.environ.get(variable) in (None, "", "0"), f"{variable}={os.environ.get(variable)}: slime's INT4 "
             "fake quantization-aware training is not implemented (the trainer trains unquantized); unset it")


def _check_save_hf(args: argparse.Namespace, hf_config: dict[str, Any] | None, need: Checks) -> None:
    if not args.save_hf:
        return
    need(bool(args.save), "--save-hf writes an HF checkpoint with each save: give --save too")
    try:
        args.save_hf.format(rollout_id=0)
    except (KeyError, IndexError, ValueError) as err:
        need(False, f"--save-hf {args.save_hf}: only {{rollout_id}} may be formatted in ({type(err).__name__}: {err})")
    need(not (hf_config or {}).get("quantization_config"), f"--save-hf: {args.hf_checkpoint} is a quantized "
         "checkpoint (quantization_config in config.json); slurmrl writes unquantized weights only")
    arch = ((hf_config or {}).get("architectures") or [None])[0]
    need(arch not in MULTIMODAL_ARCHITECTURES, f"--save-hf: {args.hf_checkpoint} is a {arch}, whose vision tower "
         "slurmrl does not train or save: convert a --save checkpoint with `slurmrl ckpt torch-dist-to-hf --hf-config "
         f"{args.hf_checkpoint}`, which writes it back")


def _check_parallel(args: argparse.Namespace, hf_config: dict[str, Any] | None, need: Checks) -> None:
    sizes_ok = need(args.pipeline_model_parallel_size >= 1,
                    f"--pipeline-model-parallel-size must be 1 or more, got {args.pipeline_model_parallel_size}")
    sizes_ok &= need(args.context_parallel_size >= 1,
                     f"--context-parallel-size must be 1 or more, got {args.context_parallel_size}")
    need(args.context_parallel_size == 1 or args.attention_backend not in ("unfused", "local"),
         f"--context-parallel-size {args.context_parallel_size} needs a fused --attention-backend (auto, flash, fused "
         "or sdpa): megatron-core's unfused DotProductAttention has no context parallelism without TransformerEngine")
    if sizes_ok and hf_config is not None:
        validate_megatron_parallel(args, hf_config, need)
    if args.padded_vocab_size is not None and hf_config is not None and "vocab_size" in hf_config:
        # megatron pads to a multiple of the divisor x TP; the fsdp backend trains the HF model unpadded
        multiple = (max(1, args.make_vocab_size_divisible_by) * max(1, args.tensor_model_parallel_size)
                    if args.train_backend == "megatron" else 1)
        padded = -(-hf_config["vocab_size"] // multiple) * multiple
        need(args.padded_vocab_size == padded, f"--padded-vocab-size {args.padded_vocab_size}: slurmrl's "
             f"{args.train_backend} backend pads config.json's vocab_size {hf_config['vocab_size']} to {padded} (a "
             "multiple of --make-vocab-size-divisible-by x --tensor-model-parallel-size); give that or drop the flag")
    need(not args.overlap_cpu_optimizer_d2h_h2d or args.optimizer_cpu_offload,
         "--overlap-cpu-optimizer-d2h-h2d needs --optimizer-cpu-offload")
    need(not (args.optimizer_cpu_offload and args.train_backend != "megatron"),
         "--optimizer-cpu-offload needs --train-backend megatron")
    need(args.optimizer == "adam" or args.train_backend == "megatron",
         f"--optimizer {args.optimizer}: the fsdp backend uses AdamW; use --optimizer adam or --train-backend megatron")


def _check_batching(args: argparse.Namespace, need: Checks) -> int | None:
    """The checks of the batch flags; returns the global batch size (None where it has none)."""
    sizes_ok = need(args.n_samples_per_prompt >= 1, "--n-samples-per-prompt must be 1 or more")
    sizes_ok &= need(args.rollout_batch_size >= 1, f"--rollout-batch-size must be 1 or more, got "
                                                   f"{args.rollout_batch_size}")
    group_std = (args.advantage_estimator in ("grpo", "gspo", "cispo") and not args.disable_grpo_std_normalization
                 and args.compute_advantages_and_returns and not args.custom_advantage_function_path
                 and args.rewards_normalization and not args.custom_reward_post_process_path
                 and not args.custom_convert_samples_to_train_data_path)  # (SFT and the plug-ins need none)
    need(not group_std or args.n_samples_per_prompt >= 2,
         f"--advantage-estimator {args.advantage_estimator} needs --n-samples-per-prompt >= 2 (a group's std)")
    # slime's check: over-sampling starts at least a rollout batch of prompts (None: rollout-batch-size)
    need(args.over_sampling_batch_size is None or args.over_sampling_batch_size >= args.rollout_batch_size,
         f"--over-sampling-batch-size {args.over_sampling_batch_size} should be greater than or equal to "
         f"--rollout-batch-size {args.rollout_batch_size} (as in slime); raise it, or drop it for the rollout "
         "batch size")
    if not sizes_ok:
        return None
    total = args.rollout_batch_size * args.n_samples_per_prompt
    steps = args.num_steps_per_rollout
    if steps:
        if not need(steps >= 1 and total % steps == 0, f"--num-steps-per-rollout {steps} must divide "
                    f"rollout-batch-size x n-samples-per-prompt = {total}"):
            return None
        need(args.global_batch_size in (None, total // steps), "--num-steps-per-rollout and "
             "--global-batch-size disagree; give one of them")
    gbs: int = args.global_batch_size or (total // steps if steps else total)
    ok = need(gbs >= 1 and total % gbs == 0,
              f"--global-batch-size {gbs} must divide rollout-batch-size x n-samples-per-prompt = {total}")
    return gbs if ok else None


def _check_training(args: argparse.Namespace, need: Checks) -> None:
    need(args.eps_clip_c is None or args.eps_clip_c > 1, f"--eps-clip-c must be > 1, got {args.eps_clip_c}")
    need(args.opd_type != "sglang", "--opd-type sglang: teacher log-probs from a separate SGLang server are not "
                                    "supported; load the teacher into the trainer with --opd-type megatron "
                                    "--opd-teacher-load")
    need(not args.use_opd or args.opd_type, "--use-opd needs --opd-type megatron (and --opd-teacher-load)")
    need(args.use_opd or not (args.opd_type or args.opd_teacher_load), "--opd-type/--opd-teacher-load take effect "
                                                                       "only with --use-opd (as in slime); add it")
    need(not args.use_opd or args.opd_teacher_load, "--use-opd --opd-type megatron needs --opd-teacher-load "
                                                    "(the teacher's torch_dist checkpoint)")
    need(args.opd_teacher_ckpt_step is None or args.opd_teacher_load,
         "--opd-teacher-ckpt-step needs --opd-teacher-load")
    need(args.ref_ckpt_step is None or args.ref_load, "--ref-ckpt-step needs --ref-load")
    need(not args.opd_teacher_load or args.train_backend == "megatron",
         "--opd-teacher-load needs --train-backend megatron")
    need(not (args.train_backend == "fsdp" and args.ref_load), "--ref-load: the fsdp backend starts from "
         "--hf-checkpoint and does not read torch_dist weights; drop --ref-load or use --train-backend megatron")
    need(args.advantage_estimator != "ppo" or args.train_backend == "megatron", "--advantage-estimator ppo needs "
         "--train-backend megatron")
    need(args.advantage_estimator not in ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
         or args.normalize_advantages, f"--advantage-estimator {args.advantage_estimator} requires advantage "
         "normalization (as in slime): add --normalize-advantages")
    if args.train_backend == "fsdp":
        _check_fsdp(args, need)
    need(args.recompute_granularity != "full" or args.recompute_method is not None,
         "--recompute-granularity full needs --recompute-method uniform or block and --recompute-num-layers")
    need(args.ddp_bucket_size is None or args.ddp_bucket_size >= 1,
         f"--ddp-bucket-size must be 1 or more elements, got {args.ddp_bucket_size}")
    need(args.micro_batch_size >= 1, f"--micro-batch-size must be 1 or more, got {args.micro_batch_size}")
    if args.use_dynamic_batch_size:
        need(args.max_tokens_per_gpu is not None and args.max_tokens_per_gpu >= 1,
             "--use-dynamic-batch-size needs --max-tokens-per-gpu N (N >= 1), the token budget of a micro-batch")
        need(args.micro_batch_size == 1, f"--micro-batch-size {args.micro_batch_size} is not used with "
             "--use-dynamic-batch-size (micro-batches are packed to --max-tokens-per-gpu); drop one of them")
    else:
        for flag in ("max_tokens_per_gpu", "log_probs_max_tokens_per_gpu"):
            need(getattr(args, flag) is None, f"--{flag.replace('_', '-')} only applies with --use-dynamic-batch-size "
                 "(otherwise micro-batches hold --micro-batch-size samples); add it or drop the flag")
    need(args.log_probs_max_tokens_per_gpu is None or args.log_probs_max_tokens_per_gpu >= 1,
         "--log-probs-max-tokens-per-gpu must be 1 or more")
    need(not (args.use_rollout_logprobs and args.use_tis),
         "--use-rollout-logprobs and --use-tis cannot be set together (TIS corrects the trainer's log-probs "
         "towards the engines'); drop one")
    need(not (args.kl_coef and args.kl_loss_coef), "only one of --kl-coef and --kl-loss-coef can be non-zero")
    need(args.loss_type == "policy_loss" or args.advantage_estimator != "ppo",
         f"--loss-type {args.loss_type} has no critic: drop --advantage-estimator ppo")
    check_loss_plugins(args, need)
    check_patterns(args, need)


def _check_fsdp(args: argparse.Namespace, need: Checks) -> None:
    megatron_only = {"--tensor-model-parallel-size": args.tensor_model_parallel_size != 1,
                     "--sequence-parallel": args.sequence_parallel,
                     "--context-parallel-size": args.context_parallel_size != 1,
                     "--pipeline-model-parallel-size": args.pipeline_model_parallel_size != 1,
                     "--expert-model-parallel-size": args.expert_model_parallel_size != 1,
                     "--overlap-grad-reduce": args.overlap_grad_reduce,
                     "--ddp-bucket-size": args.ddp_bucket_size is not None,
                     "--recompute-granularity": args.recompute_granularity is not None,
                     "--recompute-method": args.recompute_method is not None,
                     "--recompute-num-layers": args.recompute_num_layers is not None,
                     "--torch-compile": args.torch_compile,
                     "--custom-megatron-init-path": args.custom_megatron_init_path,
                     "--only-train-params-name-list": args.only_train_params_name_list,
                     "--freeze-params-name-list": args.freeze_params_name_list,
                     "--custom-megatron-before-log-prob-hook-path": args.custom_megatron_before_log_prob_hook_path,
                     "--custom-megatron-before-train-step-hook-path":
                         args.custom_megatron_before_train_step_hook_path}
    given = [flag for flag, on in megatron_only.items() if on]
    need(not given, f"{given[0] if given else ''} is the megatron backend's; the fsdp backend shards one "
                    "model over data-parallel ranks: drop it or use --train-backend megatron")


def _check_eval(args: argparse.Namespace, need: Checks) -> list[Any]:
    """The checks of the debug modes and eval flags; returns the eval sets."""
    need(not (args.debug_train_only and args.debug_rollout_only),
         "--debug-train-only and --debug-rollout-only exclude each other; give one")
    need(not (args.debug_rollout_only and args.load_debug_rollout_data),
         "--debug-rollout-only generates its rollouts; drop --load-debug-rollout-data")
    need(args.eval_interval is None or args.eval_interval >= 1,
         f"--eval-interval must be 1 or more, got {args.eval_interval}")
    need(args.eval_interval is None or bool(args.eval_prompt_data or args.eval_config),
         "--eval-interval needs eval sets: give --eval-prompt-data NAME PATH [NAME PATH ...] or --eval-config")
    need(args.eval_interval is None or not _debug_train_only(args),
         "--eval-interval: --debug-train-only has no engines to evaluate on; drop --eval-interval")
    need(args.n_samples_per_eval_prompt >= 1, "--n-samples-per-eval-prompt must be 1 or more")
    if not (args.eval_prompt_data or args.eval_config):
        return []
    from rollout.eval_sets import EvalConfigError, eval_sets

    try:
        return list(eval_sets(args))
    except EvalConfigError as err:
        need(False, str(err))
        return []


def _debug_train_only(args: argparse.Namespace) -> bool:
    """slime's: --load-debug-rollout-data sets --debug-train-only (no engines, no weight updates)."""
    return bool(args.debug_train_only or args.load_debug_rollout_data)


def _check_rollout(args: argparse.Namespace, rollout_function_path: str | None, need: Checks) -> None:
    if _debug_train_only(args):  # no engines: the rollouts come from a dump, or a function that needs none (SFT's)
        need(bool(args.load_debug_rollout_data) or bool(rollout_function_path),
             "--debug-train-only needs --load-debug-rollout-data (a saved rollout to train on) or a "
             "--rollout-function-path that needs no engines (slime.rollout.sft_rollout.generate_rollout)")
        need(args.load_debug_rollout_data or rollout_function_path != FULLY_ASYNC_ROLLOUT,
             f"--debug-train-only starts no engines, and --rollout-function-path {FULLY_ASYNC_ROLLOUT} generates "
             "on them: drop one")
    else:
        need(bool(args.prompt_data) or bool(rollout_function_path),
             "--prompt-data is required (a jsonl file), unless --rollout-function-path supplies the samples")
        need(bool(args.sglang_router_ip and args.sglang_router_port) or bool(args.engine_urls),
             "give --sglang-router-ip and --sglang-router-port (or --engine-urls for debugging)")
    need(args.rollout_global_dataset or bool(rollout_function_path and not args.prompt_data),
         "--disable-rollout-global-dataset: --rollout-function-path supplies the prompts; "
         "give it and drop --prompt-data")
    need(args.rollout_temperature > 0, f"--rollout-temperature {args.rollout_temperature}: must be > 0; temperature "
         "0 is greedy decoding and is not a valid RL policy (as in slime); use --eval-temperature 0 for greedy evals")


def _check_lengths(args: argparse.Namespace, need: Checks) -> int | None:
    """The prompt bound: --rollout-max-prompt-len, by default --rollout-max-context-len - 1 as in
    slime (None: none). (The lengths against the engines' context: jobs/trainer_flags.py.)"""
    prompt, context = args.rollout_max_prompt_len, args.rollout_max_context_len
    if context is not None:
        need(context >= 2, "--rollout-max-context-len must be 2 or more")
        if prompt is None:  # slime's: room for at least one generated token
            prompt = context - 1
        need(prompt <= context - 1, "--rollout-max-prompt-len must be below --rollout-max-context-len, leaving room "
             "for at least one generated token")
    return prompt


def _check_rewards(args: argparse.Namespace, need: Checks) -> None:
    if args.prompt_data:
        need(Path(args.prompt_data).is_file(), f"--prompt-data {args.prompt_data}: no such file; give the jsonl "
                                               "prompts file")
        need(Path(args.prompt_data).suffix in PROMPT_SUFFIXES,
             f"--prompt-data {args.prompt_data}: read by its suffix, one of {', '.join(PROMPT_SUFFIXES)}")
    rm_type = (args.rm_type or "").removeprefix("boxed_")
    need(rm_type != "remote_rm" or bool(args.rm_url), "--rm-type remote_rm needs --rm-url (the reward server's URL)")
    if rm_type == "ifbench" and not args.custom_rm_path:
        missing = missing_evaluation_lib()
        need(missing is None, f"--rm-type {args.rm_type}: {missing}")
    need(rm_type not in DICT_REWARDS or bool(args.reward_key) or bool(args.custom_rm_path),
         f"--rm-type {args.rm_type} gives a dict reward ({', '.join(DICT_REWARDS.get(rm_type, ()))}): "
         "add --reward-key naming the one to train on (slime's recipes use score)")
    need(args.rm_concurrency >= 1, f"--rm-concurrency must be 1 or more, got {args.rm_concurrency}")
    need(args.rm_timeout > 0, f"--rm-timeout must be > 0 seconds, got {args.rm_timeout}")
    need(args.rm_max_retries >= 1, f"--rm-max-retries must be 1 or more (attempts in all), got {args.rm_max_retries}")
    need(args.rm_retry_backoff >= 0, f"--rm-retry-backoff must be >= 0 seconds, got {args.rm_retry_backoff}")
