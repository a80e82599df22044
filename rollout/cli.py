"""`python -m rollout tiny-model DIR | toy-data FILE | trace DUMP` (also `slurmrl tiny-model | toy-data |
trace`): the tiny model and the toy task's prompts that the CPU engine, the tests and the demo use, and
the HTML timeline of a rollout dump (rollout.trace_view)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rollout import trace_view


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollout",
                                     description="the tiny model, the toy task's data and rollout traces")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tiny-model", help="write a tiny random Qwen3 model with a local tokenizer (HF format, CPU)")
    parser.add_argument("dir", type=Path, help="new (or empty) folder for the model")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default %(default)s)")
    parser.set_defaults(func=run, prog=parser.prog)
    toy = subparsers.add_parser("toy-data", help="write the toy task's prompts (repeat D -> D) as jsonl")
    toy.add_argument("file", type=Path, help="jsonl file to write")
    toy.add_argument("--num-prompts", type=int, default=64, help="default %(default)s")
    toy.add_argument("--labels", default="0123", help="digits the prompts ask for (default %(default)s)")
    toy.add_argument("--seed", type=int, default=0, help="default %(default)s")
    toy.set_defaults(func=run_toy_data, prog=toy.prog)
    trace_view.add_parser(subparsers)


def run(args: argparse.Namespace) -> int:
    # Imported here so that other commands do not pay for torch and transformers.
    import transformers

    from rollout.tiny_model import TinyModelError, write_tiny_model

    transformers.utils.logging.disable_progress_bar()  # one "wrote DIR" line, no shard bars
    try:
        out = write_tiny_model(args.dir, seed=args.seed)
    except TinyModelError as err:
        print(f"{args.prog}: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


def run_toy_data(args: argparse.Namespace) -> int:
    from rollout.toy_task import write_toy_data

    if args.num_prompts < 1 or not args.labels.isdigit():
        print(f"{args.prog}: error: --num-prompts must be 1 or more and --labels digits only", file=sys.stderr)
        return 1
    print(f"wrote {write_toy_data(args.file, args.num_prompts, args.labels, args.seed)}")
    return 0
