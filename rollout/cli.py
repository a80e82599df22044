"""`slurmrl tiny-model DIR [--seed N]`: write the tiny model that the CPU engine, tests and demo serve."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tiny-model", help="write a tiny random Qwen3 model with a local tokenizer (HF format, CPU)")
    parser.add_argument("dir", type=Path, help="new (or empty) folder for the model")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default %(default)s)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Imported here so that other `slurmrl` commands do not pay for torch and transformers.
    import transformers

    from rollout.tiny_model import TinyModelError, write_tiny_model

    transformers.utils.logging.disable_progress_bar()  # one "wrote DIR" line, no shard bars
    try:
        out = write_tiny_model(args.dir, seed=args.seed)
    except TinyModelError as err:
        print(f"slurmrl tiny-model: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
