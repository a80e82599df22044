"""The trainer's flags (slime's names; declared in trainer/args_parser.py), parsed into one
validated TrainerConfig (trainer.config).

Model-shape flags (--num-layers, --hidden-size, ...) are optional: the shape comes from
--hf-checkpoint's config.json, and a flag that is given must agree with it, so a slime model
script can be passed unchanged and a mismatch is caught before anything is built.
"""

from __future__ import annotations

import sys

from trainer.args_parser import ArgsError, build_parser, refused
from trainer.config import TrainerConfig, build_config, check_model_flags, read_hf_config

__all__ = [
    "ArgsError",
    "build_config",
    "build_parser",
    "check_model_flags",
    "main_error",
    "parse_args",
    "read_hf_config",
    "refused",
]


def parse_args(argv: list[str] | None = None) -> TrainerConfig:
    """The flags -> the validated configuration (ArgsError on a wrong flag)."""
    return build_config(build_parser().parse_args(argv))


def main_error(err: Exception) -> None:
    for problem in err.problems if isinstance(err, ArgsError) else [str(err)]:
        print(f"python -m trainer: error: {problem}", file=sys.stderr)
    raise SystemExit(2)
