"""`slurmrl profile JOB --rollout|--train --steps N`: profile the engines' next N forward steps
(SGLang's /start_profile on each) or the trainer's next N optimizer steps (the torch profiler),
through the job's control socket; prints where the traces land (supervisor/profiling.py)."""

from __future__ import annotations

import argparse
import sys

from contract.control_protocol import Call, ControlClient, ControlError
from contract.spec import FaultToleranceSpec
from supervisor import slurm_jobs
from supervisor.profiling import ROLLOUT, TRAIN

_WAITS = FaultToleranceSpec()


def run(args: argparse.Namespace) -> int:
    target = ROLLOUT if args.rollout else TRAIN
    try:
        job_dir = slurm_jobs.job_dir_of(args.job, _WAITS.slurm_command_timeout)
        answer = ControlClient(job_dir, _WAITS.control_call_timeout).call(Call.PROFILE, target=target,
                                                                          steps=args.steps)
    except (slurm_jobs.JobNotFound, slurm_jobs.SlurmUnavailable, ControlError, FileNotFoundError) as err:
        print(f"slurmrl profile: error: {err}", file=sys.stderr)
        return 1
    for name, reason in answer["failed"].items():
        print(f"slurmrl profile: {name} did not start profiling: {reason}", file=sys.stderr)
    if target == TRAIN:
        print(f"the trainer profiles its next {args.steps} training steps from its next rollout boundary; "
              f"traces (one per rank): {answer['dir']}")
        return 0
    if not answer["engines"]:
        return 1
    print(f"profiling the next {args.steps} forward steps of {', '.join(answer['engines'])}; "
          f"traces (one folder per engine): {answer['dir']}")
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"--steps must be a positive integer, got {value}")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("profile", help="profile the engines or the trainer of a running job for N steps "
                                   "(Chrome traces under JOB_DIR/profiles/)")
    parser.add_argument("job", help="SLURM job id or job directory")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--rollout", action="store_true",
                       help="SGLang's profiler on every serving engine, for its next N forward steps")
    which.add_argument("--train", action="store_true",
                       help="the torch profiler on every trainer rank, for its next N optimizer steps")
    parser.add_argument("--steps", type=_positive, required=True, metavar="N", help="how many steps to profile")
    parser.set_defaults(func=run)
