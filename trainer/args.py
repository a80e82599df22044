"""The trainer's flags (slime's names; declared in trainer/args_parser.py), parsed into one
validated TrainerConfig (trainer.config).

Model-shape flags (--num-layers, --hidden-size, ...) are optional: the shape comes from
--hf-checkpoint's config.json, and a flag that is given must agree with it, so a slime model
script can be passed unchanged and a mismatch is caught before anything is built.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn

from contract.job_dir import JOB_DIR_ENV, TRAINER_FATAL_EXIT, JobDir, write_trainer_fatal
from trainer.args_parser import ArgsError, build_parser, refused
from trainer.config import TrainerConfig, build_config, check_model_flags, read_hf_config
from trainer.custom_config import apply_custom_config

__all__ = [
    "ArgsError",
    "apply_custom_config",
    "build_config",
    "build_parser",
    "check_model_flags",
    "main_error",
    "parse_args",
    "read_hf_config",
    "refused",
]


def parse_args(argv: list[str] | None = None) -> TrainerConfig:
    """The flags (and --custom-config-path's keys) -> the validated configuration (ArgsError on a
    wrong flag)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    apply_custom_config(parser, args)
    return build_config(args)


def main_error(err: Exception) -> NoReturn:
    """A wrong flag (every problem, a line each), said on stderr. In a step of a slurmrl job a restart
    would read the same flags: it is the trainer's fatal reason there, so the supervisor fails the job
    at once (trainer/fatal.py)."""
    for problem in err.problems if isinstance(err, ArgsError) else [str(err)]:
        print(f"python -m trainer: error: {problem}", file=sys.stderr)
    job_dir = os.environ.get(JOB_DIR_ENV)
    if job_dir:
        write_trainer_fatal(JobDir(Path(job_dir)), f"the trainer's flags: {err}")
        raise SystemExit(TRAINER_FATAL_EXIT)
    raise SystemExit(2)
