"""The trainer's flags of a job spec (its train_args) checked at submission: the trainer's own parser
and checks (trainer.config.build_config, every problem at once), and what only the whole spec tells:
the device the trainer runs on, the engines' context, the prompt file."""

from __future__ import annotations

import argparse
import difflib
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

from contract.spec import OWNED_TRAIN_FLAGS, JobSpec, flag_value, group_flags
from contract.spec_loading import spec_flags


def train_args_problems(spec: JobSpec, notes: list[str]) -> list[str]:
    from trainer.args import ArgsError, apply_custom_config, build_config, build_parser, read_hf_config
    from trainer.config import ShapeFlags
    from trainer.config.model_checks import model_flag_problems

    problems: list[str] = []
    args = spec.trainer.train_args
    parser = build_parser()
    known = [o for a in parser._actions for o in a.option_strings] + list(spec_flags())
    for group in group_flags(args):
        name = group[0].split("=", 1)[0]
        if name in OWNED_TRAIN_FLAGS:
            hint = "rollout.sglang_router_ip/port" if "router" in name else "the job spec"
            problems.append(f"train_args: {name} is set by slurmrl itself; remove it (use {hint})")
    try:
        parsed, unknown = parser.parse_known_args(args)
        apply_custom_config(parser, parsed)
    except ArgsError as err:
        return problems + [f"train_args: {p}" for p in err.problems]
    for token in unknown:
        if token.startswith("-") and not re.fullmatch(r"-[\d.e+-]+", token):
            flag = token.split("=", 1)[0]
            close = difflib.get_close_matches(flag, known, n=1)
            problems.append(f"train_args: unknown flag {flag}" + (f" (did you mean {close[0]}?)" if close else
                                                                   "; see python -m trainer --help"))
    own: list[str] = []
    if parsed.ref_load and not Path(parsed.ref_load).exists():
        own.append(f"--ref-load {parsed.ref_load}: no such folder; give an existing torch_dist checkpoint")
    if parsed.load and parsed.load != parsed.save and not Path(parsed.load).exists():
        own.append(f"--load {parsed.load}: no such folder; give an existing save folder, or drop --load "
                   "(resuming from --save is the default)")
    # The trainer's own checks, every one (--hf-checkpoint and --prompt-data among them); the router
    # address is the supervisor's to give.
    check = argparse.Namespace(**{**vars(parsed), "sglang_router_ip": "127.0.0.1", "sglang_router_port": 1})
    try:
        build_config(check)
    except ArgsError as err:
        own += err.problems
    own += _device_problems(spec, parsed)
    hf = parsed.hf_checkpoint
    if Path(hf, "config.json").is_file():  # (else build_config said so)
        hf_config = read_hf_config(hf)
        own += model_flag_problems({f.name: getattr(parsed, f.name) for f in fields(ShapeFlags)}, hf, hf_config)
        own += _context_problems(spec, parsed, hf_config) if spec.starts_engines else []  # (engines' context)
        if parsed.prompt_data and Path(parsed.prompt_data).is_file():
            own += _prompt_data_problems(parsed, notes)
    return problems + [f"train_args: {p}" for p in own]


def _device_problems(spec: JobSpec, parsed: argparse.Namespace) -> list[str]:
    """What the trainer's device cannot run: the job spec says which device that is (a trainer
    without GPUs per node runs its workers on CPU)."""
    from trainer.config.device_checks import (
        Device,
        attention_backend_problem,
        distributed_backend_problem,
        memory_history_problem,
    )

    device: Device = "cuda" if spec.trainer.actor_num_gpus_per_node > 0 else "cpu"
    problems = [attention_backend_problem(parsed.attention_backend, device, parsed.train_backend,
                                          parsed.context_parallel_size),
                distributed_backend_problem(parsed.distributed_backend, device),
                memory_history_problem(parsed.record_memory_history, device)]
    return [p for p in problems if p is not None]


def _prompt_data_problems(parsed: argparse.Namespace, notes: list[str]) -> list[str]:
    """The prompt file read at submit by the trainer's own reader (bounded; see rollout/data_check.py)."""
    from rollout.data_check import check_prompt_data

    max_prompt_len = parsed.rollout_max_prompt_len
    if max_prompt_len is None and parsed.rollout_max_context_len is not None:
        max_prompt_len = parsed.rollout_max_context_len - 1  # the trainer's default, trainer/config/build.py
    return check_prompt_data(Path(parsed.prompt_data), input_key=parsed.input_key, label_key=parsed.label_key,
                             metadata_key=parsed.metadata_key, tool_key=parsed.tool_key,
                             hf_checkpoint=parsed.hf_checkpoint, max_prompt_len=max_prompt_len, notes=notes)


def _context_problems(spec: JobSpec, parsed: argparse.Namespace, hf_config: dict[str, Any]) -> list[str]:
    """Prompt + response against the engines' context (--sglang-context-length, else the model's
    max_position_embeddings): SGLang (and the CPU engine) refuses a request whose prompt +
    max_new_tokens reaches it, so every rollout would fail at run time."""
    r = spec.rollout
    given = flag_value(r.sglang_args, "--sglang-context-length")
    context = int(given) if given and given.isdigit() else hf_config.get("max_position_embeddings")
    if not isinstance(context, int) or (r.engine == "sglang" and "--sglang-allow-auto-truncate" in r.sglang_args):
        return []  # no context known, or SGLang shortens such requests itself
    where = "--sglang-context-length" if given else f"max_position_embeddings in {parsed.hf_checkpoint}/config.json"
    prompt, with_prompt = 1, "with any prompt"  # where no bound is known: a prompt has a token at least
    if parsed.rollout_max_prompt_len is not None:
        prompt = parsed.rollout_max_prompt_len
        with_prompt = f"with prompts of up to {prompt} tokens (--rollout-max-prompt-len)"
    elif parsed.rollout_max_context_len is not None:
        prompt = parsed.rollout_max_context_len - 1
        with_prompt = f"with prompts of up to {prompt} tokens (--rollout-max-context-len - 1)"
    problems = []
    for flag, response, prompt_tokens, what in (
            ("--rollout-max-response-len", parsed.rollout_max_response_len, prompt, with_prompt),
            ("--eval-max-response-len", parsed.eval_max_response_len, 1, "with any prompt")):
        if response is None or prompt_tokens + response < context:
            continue
        room = context - prompt_tokens - 1
        fix = f"give {flag} {room} or less" if room >= 1 else "lower the prompt bound"
        problems.append(f"{flag} {response} reaches the engines' context of {context} tokens ({where}) {what}, and "
                        f"the engines refuse a request whose prompt and response reach it; {fix}")
    return problems
