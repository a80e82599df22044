"""Errors that a restart of the trainer would only repeat (a full disk under --save, a user function
that does not load or fails on every sample: rollout.plugins.PluginError, a wrong flag:
trainer.args.main_error). The trainer ends with the error as its fatal reason in the job dir
(contract/job_dir.py) and a distinct exit code; the supervisor then fails the job with that reason
instead of spending its restarts."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import NoReturn

from contract.job_dir import TRAINER_FATAL_EXIT, JobDir, write_trainer_fatal
from rollout.plugins import PluginError

log = logging.getLogger(__name__)


class Fatal(RuntimeError):
    """An error no restart from the latest checkpoint can get past; the message says what to fix."""


# What ends the trainer as fatal.
FATAL_ERRORS: tuple[type[Exception], ...] = (Fatal, PluginError)


def exit_fatal(err: Exception, job_dir: str | None, rank: int) -> NoReturn:
    # A user function's own exception comes with its traceback: where in their code to look.
    log.error("%s", err, exc_info=err if err.__cause__ is not None else None)
    print(f"python -m trainer: fatal: {err}", file=sys.stderr)
    if job_dir and rank == 0:
        write_trainer_fatal(JobDir(Path(job_dir)), str(err))
    raise SystemExit(TRAINER_FATAL_EXIT)
