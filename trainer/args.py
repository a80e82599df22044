"""The trainer's flags (slime's names) and their validation.

Model-shape flags (--num-layers, --hidden-size, ...) are optional: the shape comes from
--hf-checkpoint's config.json, and a flag that is given must agree with it, so a slime model
script can be passed unchanged and a mismatch is caught before anything is built.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from pathlib import Path
from typing import Any

from jobs.contract import API_KEY_ENV
from rollout.rewards import REWARD_TYPES

ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")

# flag -> how to read the same quantity from an HF config
_MODEL_FLAGS: dict[str, Any] = {
    "num_layers": lambda c: c["num_hidden_layers"],
    "hidden_size": lambda c: c["hidden_size"],
    "ffn_hidden_size": lambda c: c["intermediate_size"],
    "num_attention_heads": lambda c: c["num_attention_heads"],
    "num_query_groups": lambda c: c.get("num_key_value_heads") or c["num_attention_heads"],
    "kv_channels": lambda c: c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
    "vocab_size": lambda c: c["vocab_size"],
    "rotary_base": lambda c: (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0)),
    "norm_epsilon": lambda c: c.get("rms_norm_eps", 1e-6),
    "qk_layernorm": lambda c: c["architectures"][0] in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
    "untie_embeddings_and_output_weights": lambda c: not c.get("tie_word_embeddings", False),
}


class ArgsError(ValueError):
    """A flag's value is wrong; the message names the flag and the fix."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # Unknown flags get a suggestion ("--lrr: did you mean --lr?").
        if message.startswith("unrecognized arguments:"):
            known = [o for a in self._actions for o in a.option_strings]
            hints = []
            for flag in message.split(":", 1)[1].split():
                if flag.startswith("--"):
                    close = difflib.get_close_matches(flag.split("=")[0], known, n=1)
                    hints.append(f"{flag}" + (f" (did you mean {close[0]}?)" if close else ""))
            message = "unknown flag " + ", ".join(hints or [message])
        raise ArgsError(message)


_ANY = object()  # refused(allowed=_ANY): refused whatever the value


class _Refused(argparse.Action):
    """A slime flag slurmrl does not implement: a value other than `allowed` (the one that is
    what slurmrl does anyway) is refused with `reason`, never accepted and ignored."""

    def __init__(self, option_strings: list[str], dest: str, *, reason: str, allowed: Any = _ANY,
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.reason, self.allowed = reason, allowed

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        given = True if self.nargs == 0 else values
        if self.allowed is _ANY or given != self.allowed:
            shown = option_string if self.nargs == 0 else f"{option_string} {values}"
            raise ArgsError(f"{shown}: {self.reason}")
        setattr(namespace, self.dest, given)


def refused(p: argparse.ArgumentParser, flag: str, reason: str, *, allowed: Any = _ANY, type: Any = str,
            switch: bool = False) -> None:
    """Register slime's `flag` as refused: with `reason` whenever given (allowed left out), or
    unless its value equals `allowed`. `switch`: a store_true flag (it takes no value)."""
    kwargs: dict[str, Any] = {"nargs": 0} if switch else {"type": type}
    p.add_argument(flag, action=_Refused, reason=reason, allowed=allowed, default=None,
                   help=f"refused: {reason}" + ("" if allowed is _ANY else f" (accepted: {allowed})"), **kwargs)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m trainer", description="slurmrl's RL trainer (one process per GPU or CPU worker)",
                allow_abbrev=False)
    add = p.add_argument
    # checkpoints and model
    add("--hf-checkpoint", required=True, help="HF model folder: config, tokenizer, initial weights")
    add("--load", help="resume from this torch_dist save folder (missing or empty: start from --ref-load)")
    add("--ref-load", help="torch_dist weights to start from and, with KL, the reference model")
    add("--save", help="torch_dist save folder (SAVE/iter_XXXXXXX)")
    add("--save-interval", type=int, default=0, help="save every N rollouts (0: only at the end)")
    add("--keep-checkpoints", type=int, default=None, help="keep the newest N checkpoints")
    add("--ckpt-step", type=int, help="resume from exactly this iteration of --load")
    add("--job-dir", help="folder for weights, metrics and the heartbeat (default: --save or the cwd)")
    add("--train-backend", choices=("megatron", "fsdp"), default="megatron")
    add("--seed", type=int, default=1234)
    add("--num-rollout", type=int, required=True, help="number of rollouts (RL iterations) to run")
    # model shape (optional; checked against the HF config)
    for flag in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                 "kv_channels", "vocab_size"):
        add("--" + flag.replace("_", "-"), type=int)
    add("--rotary-base", type=float)
    add("--norm-epsilon", type=float)
    for flag in ("qk_layernorm", "untie_embeddings_and_output_weights"):
        add("--" + flag.replace("_", "-"), action="store_true", default=None)
    add("--group-query-attention", action="store_true")
    add("--normalization", choices=("RMSNorm",), default="RMSNorm")
    add("--swiglu", action="store_true", help="accepted for slime scripts; the supported models all use SwiGLU")
    add("--disable-bias-linear", action="store_true")
    add("--position-embedding-type", choices=("rope",), default="rope")
    add("--use-rotary-position-embeddings", action="store_true")
    add("--make-vocab-size-divisible-by", type=int, default=128)
    add("--seq-length", type=int, help="accepted for slime scripts; samples are packed, so it caps nothing")
    add("--max-position-embeddings", type=int)
    add("--bf16", action="store_true", help="compute in bf16 on GPU (fp32 master weights)")
    add("--attention-backend", choices=("sdpa", "local"), default="sdpa",
        help="sdpa: fused scaled_dot_product_attention over packed samples; local: megatron's unfused one")
    add("--torch-compile", action="store_true", help="torch.compile each transformer layer (GPU)")
    # parallelism
    add("--tensor-model-parallel-size", type=int, default=1)
    # megatron parallelism: sequence parallel, expert TP (megatron backend)
    add("--sequence-parallel", action="store_true",
        help="split norms, dropout and MoE routing over the TP ranks along the sequence (no effect at TP 1)")
    add("--expert-tensor-parallel-size", type=int, default=None,
        help="TP degree of MoE expert weights (default: --tensor-model-parallel-size)")
    add("--pipeline-model-parallel-size", type=int, default=1)
    add("--context-parallel-size", type=int, default=1)
    add("--expert-model-parallel-size", type=int, default=1)
    add("--recompute-granularity", choices=("full", "selective"))
    add("--recompute-method", choices=("uniform", "block"))
    add("--recompute-num-layers", type=int)
    add("--custom-megatron-init-path")
    add("--custom-megatron-before-log-prob-hook-path")
    add("--custom-megatron-before-train-step-hook-path")
    # optimizer
    add("--lr", type=float, default=1e-6)
    add("--min-lr", type=float, default=0.0)
    add("--lr-warmup-iters", type=int, default=0)
    add("--lr-decay-style", choices=("constant", "cosine"), default="constant")
    add("--lr-decay-iters", type=int)
    add("--weight-decay", type=float, default=0.0)
    add("--adam-beta1", type=float, default=0.9)
    add("--adam-beta2", type=float, default=0.98)
    add("--adam-eps", type=float, default=1e-8)
    add("--clip-grad", type=float, default=1.0)
    # megatron optimizer: kind, distributed (ZeRO-1) sharding, CPU offload (trainer.megatron_optimizer)
    add("--optimizer", choices=("adam", "sgd"), default="adam", help="adam: AdamW (decoupled weight decay), as megatron's")
    add("--sgd-momentum", type=float, default=0.9)
    add("--use-distributed-optimizer", action="store_true", default=True,
        help="shard optimizer state over data-parallel ranks (always on, as slime sets it)")
    add("--optimizer-cpu-offload", action="store_true", help="keep optimizer state and fp32 weights on the host")
    add("--overlap-cpu-optimizer-d2h-h2d", action="store_true",
        help="with --optimizer-cpu-offload: asynchronous gradient and weight copies")
    add("--use-precision-aware-optimizer", action="store_true",
        help="accepted: the optimizer updates fp32 weights with fp32 gradients and moments, what slurmrl always does")
    add("--global-batch-size", type=int, help="samples per optimizer step (default: the whole rollout)")
    add("--max-tokens-per-gpu", type=int, default=8192, help="packing budget of one micro-batch")
    # RL loss
    add("--advantage-estimator", choices=ESTIMATORS, default="grpo")
    add("--disable-grpo-std-normalization", action="store_true")
    add("--normalize-advantages", action="store_true")
    add("--gamma", type=float, default=1.0)
    add("--lambd", type=float, default=1.0)
    add("--kl-coef", type=float, default=0.0, help="KL to the reference model as reward shaping")
    add("--use-kl-loss", action="store_true")
    add("--kl-loss-coef", type=float, default=0.0)
    add("--kl-loss-type", choices=("k1", "k2", "k3"), default="k1")
    add("--eps-clip", type=float, default=0.2)
    add("--eps-clip-high", type=float)
    add("--eps-clip-c", type=float, help="dual-clip constant (> 1)")
    add("--value-clip", type=float, default=0.2)
    add("--critic-lr", type=float)
    add("--entropy-coef", type=float, default=0.0)
    add("--calculate-per-token-loss", action="store_true")
    add("--use-tis", action="store_true")
    add("--tis-clip", type=float, default=2.0)
    add("--true-on-policy-mode", action="store_true")
    add("--true-on-policy-tolerance", type=float, default=1e-5)
    add("--opd-teacher-load", help="on-policy distillation: a torch_dist teacher loaded into the trainer")
    add("--opd-kl-coef", type=float, default=1.0)
    # rollout (see rollout.generate.RolloutArgs)
    add("--prompt-data", help="jsonl prompts")
    add("--input-key", default="input")
    add("--label-key")
    add("--metadata-key", default="metadata", help="the jsonl field holding each prompt's metadata (slime's default)")
    add("--apply-chat-template", action="store_true")
    add("--rollout-shuffle", action="store_true")
    add("--rollout-batch-size", type=int, default=32, help="prompts per rollout")
    add("--n-samples-per-prompt", type=int, default=4)
    add("--rollout-max-response-len", type=int, default=1024)
    add("--rollout-temperature", type=float, default=1.0)
    add("--rollout-top-p", type=float, default=1.0)
    add("--rollout-top-k", type=int, default=-1)
    add("--rollout-stop", nargs="*")
    add("--rollout-seed", type=int, default=42)
    add("--rollout-concurrency", type=int, default=64)
    add("--rollout-retry-timeout", dest="retry_timeout_s", type=float, default=1800.0,
        help="give up on a request after this many seconds without any engine")
    add("--rm-type", choices=[p + t for p in ("", "boxed_") for t in REWARD_TYPES], default="math",
        help="built-in reward (a sample's metadata rm_type overrides it)")
    add("--custom-rm-path")
    add("--custom-generate-function-path")
    add("--rollout-function-path")
    add("--over-sampling-batch-size", type=int)
    add("--dynamic-sampling-filter-path")
    add("--partial-rollout", action="store_true")
    add("--save-debug-rollout-data")
    add("--load-debug-rollout-data")
    add("--debug-train-only", action="store_true")
    # engines and weight publishing
    add("--sglang-router-ip")
    add("--sglang-router-port", type=int)
    add("--engine-urls", nargs="*", help="standalone debugging: publish to these engines (default: the router's)")
    add("--update-weight-transport", choices=("disk", "nccl"), default="disk")
    add("--update-weight-buffer-size", type=int, default=512 * 2**20)
    add("--keep-weight-versions", type=int, default=3)
    add("--update-weight-timeout", type=float, default=600.0)
    add("--supervised", action="store_true",
        help="a slurmrl supervisor owns the engines: ask it on --job-dir's control socket (set by slurmrl)")
    # logging
    add("--tensorboard-dir")
    add("--master-port", type=int, help="torch.distributed port (default: from the SLURM job id)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    validate(args)
    return args


def validate(args: argparse.Namespace) -> None:
    """Cheap checks that need no model; model-shape checks are in check_model_flags."""
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ArgsError(message)

    need(Path(args.hf_checkpoint, "config.json").is_file(),
         f"--hf-checkpoint {args.hf_checkpoint} has no config.json: point it at a Hugging Face model folder")
    need(args.num_rollout >= 1, f"--num-rollout must be 1 or more, got {args.num_rollout}")
    need(args.pipeline_model_parallel_size == 1,
         "--pipeline-model-parallel-size > 1 is not supported by slurmrl's trainer yet; use tensor and data parallel")
    need(args.context_parallel_size == 1,
         "--context-parallel-size > 1 is not supported yet; samples are packed, so long contexts need no CP split")
    _validate_megatron_parallel(args, need)
    need(not args.overlap_cpu_optimizer_d2h_h2d or args.optimizer_cpu_offload,
         "--overlap-cpu-optimizer-d2h-h2d needs --optimizer-cpu-offload")
    need(not (args.optimizer_cpu_offload and args.train_backend != "megatron"),
         "--optimizer-cpu-offload needs --train-backend megatron")
    need(args.optimizer == "adam" or args.train_backend == "megatron",
         f"--optimizer {args.optimizer}: the fsdp backend uses AdamW; use --optimizer adam or --train-backend megatron")
    need(args.n_samples_per_prompt >= 1, "--n-samples-per-prompt must be 1 or more")
    need(args.advantage_estimator not in ("grpo", "gspo") or args.n_samples_per_prompt >= 2
         or args.disable_grpo_std_normalization,
         f"--advantage-estimator {args.advantage_estimator} needs --n-samples-per-prompt >= 2 (a group's std)")
    total = args.rollout_batch_size * args.n_samples_per_prompt
    gbs = args.global_batch_size or total
    need(total % gbs == 0, f"--global-batch-size {gbs} must divide rollout-batch-size x n-samples-per-prompt = {total}")
    need(args.eps_clip_c is None or args.eps_clip_c > 1, f"--eps-clip-c must be > 1, got {args.eps_clip_c}")
    need(not args.opd_teacher_load or args.train_backend == "megatron", "--opd-teacher-load needs --train-backend megatron")
    need(not (args.train_backend == "fsdp" and args.ref_load), "--ref-load: the fsdp backend starts from "
         "--hf-checkpoint and does not read torch_dist weights; drop --ref-load or use --train-backend megatron")
    need(args.advantage_estimator != "ppo" or args.train_backend == "megatron", "--advantage-estimator ppo needs "
         "--train-backend megatron")
    need(args.recompute_granularity != "full" or args.recompute_method is not None,
         "--recompute-granularity full needs --recompute-method uniform or block and --recompute-num-layers")
    if args.debug_train_only:
        need(bool(args.load_debug_rollout_data),
             "--debug-train-only needs --load-debug-rollout-data (a saved rollout to train on)")
    else:
        need(bool(args.prompt_data) or bool(args.rollout_function_path),
             "--prompt-data is required (a jsonl file), unless --rollout-function-path supplies the samples")
        need(bool(args.sglang_router_ip and args.sglang_router_port) or bool(args.engine_urls),
             "give --sglang-router-ip and --sglang-router-port (or --engine-urls for debugging)")
    if args.prompt_data:
        need(Path(args.prompt_data).is_file(), f"--prompt-data {args.prompt_data} does not exist")
    for flag in ("custom_megatron_init_path", "custom_megatron_before_log_prob_hook_path",
                 "custom_megatron_before_train_step_hook_path", "custom_rm_path", "custom_generate_function_path",
                 "rollout_function_path", "dynamic_sampling_filter_path"):
        value = getattr(args, flag)
        need(value is None or "." in value, f"--{flag.replace('_', '-')} must be module.function, got {value!r}")
    # Absolute: engines read published weights from here, from their own working directory.
    args.job_dir = str(Path(args.job_dir or args.save or os.getcwd()).resolve())
    args.global_batch_size = gbs
    args.ref_model_needed = bool(args.use_kl_loss or args.kl_coef)
    args.api_key = os.environ.get(API_KEY_ENV)  # never on the command line: ps would show it


def _validate_megatron_parallel(args: argparse.Namespace, need: Any) -> None:
    tp, etp = args.tensor_model_parallel_size, args.expert_tensor_parallel_size
    need(etp is None or (etp >= 1 and tp % etp == 0),
         f"--expert-tensor-parallel-size {etp} must be 1 or more and divide --tensor-model-parallel-size {tp}")
    config = read_hf_config(args.hf_checkpoint)
    moe = bool(config.get("num_experts") or config.get("num_local_experts"))
    need(not moe or tp == 1 or args.sequence_parallel or args.train_backend != "megatron",
         f"--tensor-model-parallel-size {tp} with a MoE model needs --sequence-parallel (megatron-core's MoE layer "
         "requires it when training with TP > 1)")


def read_hf_config(hf_checkpoint: str) -> dict[str, Any]:
    """--hf-checkpoint's config.json (validate checked that there is one)."""
    return json.loads((Path(hf_checkpoint) / "config.json").read_text())


def check_model_flags(args: argparse.Namespace, hf_config: dict[str, Any]) -> None:
    """Every model-shape flag that was given must equal the HF config's value."""
    for flag, read in _MODEL_FLAGS.items():
        given = getattr(args, flag)
        if given is None:
            continue
        expected = read(hf_config)
        if given != expected:
            raise ArgsError(f"--{flag.replace('_', '-')} {given} disagrees with {args.hf_checkpoint}/config.json "
                            f"({expected}); drop the flag or fix the checkpoint")


def main_error(err: Exception) -> None:
    print(f"python -m trainer: error: {err}", file=sys.stderr)
    raise SystemExit(2)
