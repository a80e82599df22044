"""build_config's checks of the asynchronous flags: slime's --train-async and
--update-weights-interval, and miles' flags of the fully asynchronous rollout (slime's
--rollout-function-path for it), each refused where it would have no effect."""

from __future__ import annotations

import argparse

from trainer.config.checks import Checks
from trainer.config.sections import FULLY_ASYNC_ROLLOUT


def check_async(args: argparse.Namespace, need: Checks) -> None:
    need(args.update_weights_interval >= 1,
         f"--update-weights-interval must be 1 or more, got {args.update_weights_interval}")
    need(args.update_weights_interval == 1 or args.train_async,
         f"--update-weights-interval {args.update_weights_interval} takes effect with --train-async (slime's "
         "train_async.py); train.py publishes after every rollout: add --train-async or drop the flag")
    fully = args.rollout_function_path == FULLY_ASYNC_ROLLOUT
    need(not ((args.train_async or fully) and (args.offload_train or args.offload_rollout)),
         "--train-async and the fully async rollout: the engines generate while the trainer trains, so they cannot "
         "share its GPUs (--colocate, --offload-train, --offload-rollout), as slime's train_async.py refuses "
         "--colocate; drop them")
    need(not ((args.train_async or fully) and args.debug_rollout_only),
         "--debug-rollout-only runs the built-in rollout alone: drop --train-async or the fully async rollout")
    if not fully:
        given = [flag for flag, value, default in (
            ("--max-weight-staleness", args.max_weight_staleness, None),
            ("--async-data-buffer-capacity-factor", args.async_data_buffer_capacity_factor, 2.0),
            ("--async-unused-samples-handler", args.async_unused_samples_handler, "drop"),
            ("--pause-generation-mode", args.pause_generation_mode, "retract")) if value != default]
        need(not given, f"{given[0] if given else ''} takes effect with the fully async rollout (--rollout-function-"
                        f"path {FULLY_ASYNC_ROLLOUT}): add it or drop the flag")
        return
    need(args.max_weight_staleness is None or args.max_weight_staleness >= 0,
         f"--max-weight-staleness must be 0 or more, got {args.max_weight_staleness}")
    need(int(args.async_data_buffer_capacity_factor * args.rollout_batch_size) >= args.rollout_batch_size,
         f"--async-data-buffer-capacity-factor {args.async_data_buffer_capacity_factor}: the buffer must hold a "
         f"rollout of --rollout-batch-size {args.rollout_batch_size} groups; give 1.0 or more")
    need(not args.keep_old_actor or args.max_weight_staleness is not None,
         "--keep-old-actor with the fully async rollout keeps the weights of every version a sample may come "
         "from: bound them with --max-weight-staleness")
    for flag, value in (("--partial-rollout", args.partial_rollout), ("--load-debug-rollout-data",
                        args.load_debug_rollout_data), ("--dynamic-sampling-filter-path",
                        args.dynamic_sampling_filter_path), ("--over-sampling-batch-size",
                        args.over_sampling_batch_size)):
        need(not value, f"{flag}: the fully async rollout does not take it (its groups always continue from their "
                        "tokens across a stop, and every finished group is trained); drop it")
    need(bool(args.prompt_data), "the fully async rollout draws its prompts from --prompt-data: give it")
