"""The trainer's rollout-side flags (slime's names): prompts and sampling, debug dumps, eval sets,
rewards, the engines and weight publishing, and logging. trainer.args_parser adds them after the
model and training flags."""

from __future__ import annotations

import argparse

from rollout.loss_masks import LOSS_MASK_TYPES
from rollout.rewards import REWARD_TYPES
from rollout.sample_errors import POLICIES, ZERO_REWARD
from trainer.args_actions import json_object, refused


def add_rollout_flags(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    # rollout (see rollout.generate.RolloutArgs)
    add("--prompt-data", help="jsonl prompts")
    add("--input-key", default="input")
    add("--label-key")
    add("--metadata-key", default="metadata", help="the jsonl field holding each prompt's metadata (slime's default)")
    add("--apply-chat-template", action="store_true")
    add("--rollout-shuffle", action="store_true")
    add("--rollout-batch-size", type=int, default=32, help="prompts per rollout")
    add("--n-samples-per-prompt", type=int, default=1, help="responses per prompt (a group); slime's default 1")
    add("--rollout-max-response-len", type=int, default=1024)
    add("--rollout-temperature", type=float, default=1.0)
    add("--rollout-top-p", type=float, default=1.0)
    add("--rollout-top-k", type=int, default=-1)
    add("--rollout-stop", nargs="*")
    add("--rollout-stop-token-ids", nargs="+", type=int, help="token ids that end a response")
    add("--rollout-skip-special-tokens", action="store_true",
        help="drop special tokens from the response text (slime's default keeps them)")
    add("--rollout-max-prompt-len", type=int, help="drop prompts longer than this many tokens when the data is read")
    add("--rollout-max-context-len", type=int, help="the engines' context: prompts longer than N - 1 tokens are "
                                                    "dropped (unless --rollout-max-prompt-len says otherwise)")
    add("--mask-offpolicy-in-partial-rollout", action="store_true",
        help="with --partial-rollout: a continued sample trains only on the tokens of its last round")
    add("--rollout-sample-hook-path", action="append", default=[],
        help="module.function(args, sample, *, rollout_id, evaluation) run on each finished sample before its "
             "reward, in order (sync or async; may return a new sample); repeatable")
    add("--tool-key", default="tools", help="the prompt field holding tools for the chat template")
    add("--disable-rollout-global-dataset", dest="rollout_global_dataset", action="store_false",
        help="no --prompt-data: --rollout-function-path supplies every prompt")
    refused(p, "--data-source-path", "prompts come from --prompt-data (jsonl or parquet); a custom rollout "
            "brings its own with --rollout-function-path",
            allowed="slime.rollout.data_source.RolloutDataSourceWithBuffer")
    add("--buffer-filter-path", help="module.function(args, rollout_id, buffer, num_samples) taking the groups "
        "given back (partial rollout, add_samples) for the next rollout (slime's; default: the first ones)")
    refused(p, "--custom-rollout-log-function-path", "rollout metrics go to metrics.jsonl, TensorBoard and W&B; "
            "a custom logger is not supported")
    refused(p, "--multimodal-keys", "slurmrl trains text-only models")
    refused(p, "--start-rollout-id", "a run starts at rollout 0, or where --load's checkpoint left off", type=int)
    add("--rollout-seed", type=int, default=42)
    add("--rollout-concurrency", type=int, default=64)
    add("--rollout-retry-timeout", dest="retry_timeout_s", type=float, default=1800.0,
        help="give up on a request after this many seconds without any engine")
    add("--rm-type", choices=[p + t for p in ("", "boxed_") for t in REWARD_TYPES],
        help="built-in reward (a sample's metadata rm_type overrides it); slime's default: none")
    add("--custom-rm-path")
    add("--custom-reward-post-process-path", help="module.function(args, samples) -> (raw_rewards, rewards) in "
        "place of the group normalization: the rewards are trained on as given (slime's)")
    add("--custom-convert-samples-to-train-data-path", help="module.function(args, samples) -> train_data, a dict of "
        "per-sample 'tokens', 'response_lengths', 'rewards', 'loss_masks' (slime's): the rewards are trained on as "
        "given")
    add("--custom-generate-function-path")
    add("--rollout-function-path")
    add("--over-sampling-batch-size", type=int)
    add("--dynamic-sampling-filter-path")
    add("--partial-rollout", action="store_true")
    # debug dumps and debug modes (slime's .pt layout: rollout.debug_data)
    add("--save-debug-rollout-data", help="torch.save each rollout's samples here (a path with {rollout_id})")
    add("--load-debug-rollout-data", help="train on rollouts saved by --save-debug-rollout-data, not engines")
    add("--debug-train-only", action="store_true", help="no engines (the job starts no router and no engine; "
        "--load-debug-rollout-data sets it): train on --load-debug-rollout-data, or on a rollout function that "
        "needs no engine (SFT's)")
    add("--debug-rollout-only", action="store_true",
        help="engines and rollouts only: no model in the trainer, no training, no checkpoint; the engines "
             "serve --hf-checkpoint's weights (published once as version 0)")
    refused(p, "--load-debug-rollout-data-subsample", "replaying part of a rollout would change its training "
            "step; replay the whole dump", type=float)
    # eval (rollout.eval): named sets on the live engines between rollouts
    add("--eval-interval", type=int, help="evaluate after every N rollouts (and before the first, unless "
        "--skip-eval-before-train)")
    add("--eval-prompt-data", nargs="+", metavar="NAME PATH", help="eval sets: NAME PATH [NAME PATH ...] (jsonl)")
    add("--skip-eval-before-train", action="store_true")
    add("--eval-input-key", help="the eval sets' prompt field (default: --input-key)")
    add("--eval-label-key", help="the eval sets' label field (default: --label-key)")
    add("--n-samples-per-eval-prompt", type=int, default=1, help="responses per eval prompt: pass@k's k")
    add("--eval-temperature", type=float, help="default: --rollout-temperature")
    add("--eval-top-p", type=float, help="default: --rollout-top-p")
    add("--eval-top-k", type=int, help="default: --rollout-top-k")
    add("--eval-max-response-len", type=int, help="default: --rollout-max-response-len")
    add("--eval-function-path", help="module.function run as generate_rollout(args, rollout_id, data_buffer, "
        "evaluation=True) -> {name: {'rewards', 'truncated', 'samples'}} (default: --rollout-function-path)")
    add("--custom-eval-rollout-log-function-path",
        help="module.function(rollout_id, args, data, extra_metrics) -> bool: True skips slurmrl's eval logging")
    add("--eval-config", help="slime's eval YAML: eval.defaults and eval.datasets (each: name, path, rm_type, "
        "custom_rm_path, n_samples_per_eval_prompt, sampling...), in place of --eval-prompt-data (rollout.eval_sets)")
    refused(p, "--eval-tool-key", "slurmrl's data has no tools field")
    refused(p, "--eval-max-prompt-len", "slurmrl does not drop long prompts; trim the eval set", type=int)
    refused(p, "--eval-min-new-tokens", "min_new_tokens is not a sampling parameter slurmrl sends", type=int)
    add("--eval-max-context-len", type=int, help="for plug-ins, as in slime, whose own eval reads it nowhere "
        "(multi_agent bounds its eval prompts by it; default: --rollout-max-context-len)")
    # rewards and data (issue 14 item 6): see rollout/rewards.py, rollout/remote_rm.py, rollout/data.py
    add("--reward-key", help="a reward that is a dict (dapo's, a reward server's): the entry trained on")
    add("--eval-reward-key", help="the same for eval (default: --reward-key)")
    add("--group-rm", action="store_true",
        help="score each group at once: --custom-rm-path gets (args, samples) and returns a list")
    add("--rm-url", help="--rm-type remote_rm: the reward server (POST {prompt, response, label} -> reward)")
    add("--rm-concurrency", type=int, default=64, help="remote_rm requests in flight at once")
    add("--rm-timeout", type=float, default=120.0, help="seconds for one remote_rm request")
    add("--rm-max-retries", type=int, default=10, help="remote_rm attempts per sample before the rollout fails")
    add("--rm-retry-backoff", type=float, default=1.0,
        help="seconds before remote_rm's first retry; doubles each time, at most 30 s")
    add("--sample-error-policy", choices=POLICIES, default=ZERO_REWARD,
        help="a user function (--custom-rm-path, --custom-generate-function-path, a --rollout-sample-hook-path "
             "hook) that raises on one sample: zero_reward keeps the sample with reward 0, drop_group drops its "
             "group (a sample whose generation failed drops its group either way); each error counts in the "
             "sample_errors metric, the first of each function is a plugin_error event, and a rollout whose "
             "every sample failed ends the job (rollout/sample_errors.py)")
    add("--loss-mask-type", choices=LOSS_MASK_TYPES, default="qwen",
        help="rollout.sft_rollout: how a conversation's trained tokens are found (step_loss_mask 0 turns are not)")
    add("--apply-chat-template-kwargs", type=json_object, default="{}",
        help="JSON object passed to the tokenizer's apply_chat_template, e.g. '{\"enable_thinking\": false}'")
    # engines and weight publishing
    add("--sglang-router-ip")
    add("--sglang-router-port", type=int)
    add("--engine-urls", nargs="*", help="standalone debugging: publish to these engines (default: the router's)")
    add("--update-weight-transport", choices=("disk", "nccl", "tensor"), default="disk",
        help="disk: each version an HF folder in JOB_DIR/weights, which a restarted engine also loads; nccl: "
             "broadcast over a weight-update group (slime's default); tensor: by reference to engines on the "
             "trainer's own GPU (--colocate; CUDA IPC handles through /update_weights_from_tensor, as slime "
             "updates colocated engines)")
    add("--update-weight-buffer-size", type=int, default=512 * 2**20)
    add("--keep-weight-versions", type=int, default=3)
    add("--update-weight-timeout", type=float, default=600.0)
    add("--supervised", action="store_true",
        help="a slurmrl supervisor owns the engines: ask it on --job-dir's control socket (set by slurmrl)")
    # logging
    # logging: metrics.jsonl and TensorBoard always; W&B with --use-wandb (trainer/wandb_log.py)
    add("--tensorboard-dir", help="TensorBoard folder (default: TENSORBOARD_DIR, else JOB_DIR/tensorboard_log/"
                                  "PROJECT/EXPERIMENT with --tb-project-name, else JOB_DIR/tensorboard)")
    add("--use-tensorboard", action="store_true", help="TensorBoard scalars are always written; see --tensorboard-dir")
    add("--tb-project-name", help="TensorBoard folder JOB_DIR/tensorboard_log/PROJECT/EXPERIMENT")
    add("--tb-experiment-name", help="with --tb-project-name (default: the job dir's name, stable across resumes)")
    add("--use-wandb", action="store_true", help="log each rollout's metrics to one W&B run (resumes continue it)")
    add("--wandb-mode", choices=("online", "offline", "disabled"), help="default: WANDB_MODE, else online, or offline "
        "when the W&B server cannot be reached (wandb sync uploads it later)")
    add("--wandb-dir", help="where W&B keeps its files (default: the job dir)")
    add("--wandb-key", help="W&B API key for online mode (or WANDB_API_KEY)")
    add("--wandb-host", help="W&B server for the login")
    add("--wandb-team", help="W&B entity")
    add("--wandb-project", help="W&B project")
    add("--wandb-group", help="W&B group and run name (default: the job dir's name)")
    add("--disable-wandb-random-suffix", dest="wandb_random_suffix", action="store_false",
        help="no random suffix on the group (the suffix is chosen once per job, so resumes keep it)")
    add("--wandb-always-use-train-step", action="store_true",
        help="W&B step = optimizer steps done (default: the rollout id)")
    add("--wandb-run-id", help="log into this existing W&B run")
    add("--log-passrate", action="store_true", help="log passrate/pass@k of each rollout's groups (reward 1 = pass)")
    add("--master-port", type=int, help="torch.distributed port (default: from the SLURM job id)")
