"""build_config's checks of slime's plug-in and SFT flags: the loss plug-ins with what they need
(none given without effect), the parameter-freezing patterns, and --num-epoch's rollouts."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from trainer.config.checks import Checks


def epoch_rollouts(args: argparse.Namespace, model_files: str, need: Checks) -> int | None:
    """slime's num_rollout from --num-epoch: epochs x (the prompts --prompt-data yields, after the
    long ones are dropped, // --rollout-batch-size)."""
    if not need(args.num_epoch is not None, "give --num-rollout N, or --num-epoch N with --prompt-data"):
        return None
    if not need(bool(args.prompt_data) and args.rollout_global_dataset and Path(args.prompt_data).is_file(),
                f"--num-epoch {args.num_epoch} counts the prompts of --prompt-data: give an existing file (or give "
                "--num-rollout)"):
        return None
    from rollout.data import DataError, JsonlDataSource

    tokenizer = None
    if args.apply_chat_template or args.rollout_max_prompt_len is not None or args.rollout_max_context_len:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_files)
    max_prompt_len = args.rollout_max_prompt_len
    if max_prompt_len is None and args.rollout_max_context_len is not None:
        max_prompt_len = args.rollout_max_context_len - 1
    try:
        prompts = len(JsonlDataSource(args.prompt_data, input_key=args.input_key, label_key=args.label_key,
                                      metadata_key=args.metadata_key, tool_key=args.tool_key, tokenizer=tokenizer,
                                      apply_chat_template=args.apply_chat_template,
                                      apply_chat_template_kwargs=args.apply_chat_template_kwargs,
                                      max_prompt_len=max_prompt_len).rows)
    except DataError as err:
        need(False, f"--prompt-data {args.prompt_data}: {err}")
        return None
    per_epoch = prompts // max(1, args.rollout_batch_size)
    need(per_epoch >= 1, f"--num-epoch: --prompt-data {args.prompt_data} has {prompts} prompts, fewer than one "
                         f"--rollout-batch-size {args.rollout_batch_size}; lower it or give --num-rollout")
    return args.num_epoch * per_epoch


def check_loss_plugins(args: argparse.Namespace, need: Checks) -> None:
    """slime's loss plug-ins and SFT switch: each with what it needs, none given without effect."""
    need((args.loss_type == "custom_loss") == bool(args.custom_loss_function_path),
         "--loss-type custom_loss and --custom-loss-function-path go together (as in slime); give both or neither")
    need(args.compute_advantages_and_returns or args.loss_type != "policy_loss",
         "--disable-compute-advantages-and-returns: the policy loss needs advantages; it is for --loss-type sft_loss "
         "(or custom_loss)")
    need(args.compute_advantages_and_returns or not (args.custom_advantage_function_path
                                                     or args.rollout_data_postprocess_path),
         "--disable-compute-advantages-and-returns skips --custom-advantage-function-path / "
         "--rollout-data-postprocess-path; drop one")
    need(not args.custom_tis_function_path or args.use_tis or args.get_mismatch_metrics,
         "--custom-tis-function-path has no effect without --use-tis or --get-mismatch-metrics (as in slime); add one")
    need(not (args.custom_tis_function_path or args.get_mismatch_metrics) or args.loss_type == "policy_loss",
         "--custom-tis-function-path / --get-mismatch-metrics act in the policy loss: use --loss-type policy_loss")
    need(not args.custom_pg_loss_reducer_function_path or args.loss_type == "policy_loss",
         "--custom-pg-loss-reducer-function-path reduces the policy loss: use --loss-type policy_loss")


def check_patterns(args: argparse.Namespace, need: Checks) -> None:
    for flag in ("only_train_params_name_list", "freeze_params_name_list"):
        for pattern in getattr(args, flag) or []:
            try:
                re.compile(pattern)
            except re.error as err:
                need(False, f"--{flag.replace('_', '-')} {pattern!r}: not a regular expression ({err})")
