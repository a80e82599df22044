"""`slurmrl status|restart|events|stop JOB`: JOB is a SLURM job id or a job directory.

status reads the state store (and asks the supervisor, when one runs, for the time left);
restart and stop go through the job's control socket, which only its owner can use.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from jobs.contract import JobDir
from jobs.control_protocol import Call, ControlClient, ControlError
from jobs.spec import FaultToleranceSpec
from supervisor.events import follow
from supervisor.state import read_state

# Before the job's spec is read (finding its directory) and for the CLI's own calls: the defaults.
_WAITS = FaultToleranceSpec()


class JobNotFound(ValueError):
    pass


def job_dir_of(job: str) -> JobDir:
    """A job dir as given, or the one a SLURM job id's Submitit log lives in (JOB_DIR/submitit/...)."""
    given = JobDir(Path(job).resolve())
    if given.spec.is_file():
        return given
    if not job.isdigit():
        raise JobNotFound(f"{job}: neither a job directory (no spec.yaml) nor a SLURM job id")
    try:
        out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True,
                             timeout=_WAITS.slurm_command_timeout).stdout
    except subprocess.TimeoutExpired:
        raise JobNotFound(f"job {job}: SLURM did not answer within {_WAITS.slurm_command_timeout:.0f} s; "
                          "give its job directory") from None
    for field in out.split():
        if field.startswith("StdOut="):
            candidate = JobDir(Path(field.split("=", 1)[1]).parent.parent)
            if candidate.spec.is_file():
                return candidate
    raise JobNotFound(f"job {job}: SLURM no longer knows it, or it is not a slurmrl job; give its job directory")


def _status(job_dir: JobDir, as_json: bool) -> int:
    if not job_dir.state.is_file():
        print(f"slurmrl status: {job_dir.root} has no {job_dir.state.name} yet (the supervisor has not started)",
              file=sys.stderr)
        return 1
    try:
        state = ControlClient(job_dir, _WAITS.control_call_timeout).call(Call.STATUS)["state"]
        live = True
    except ControlError:
        from dataclasses import asdict

        state, live = asdict(read_state(job_dir)), False
    if as_json:
        print(json.dumps({**state, "supervisor_running": live}))
        return 0
    print(f"job {state['job_id']}  weight version {state['weight_version']}  requeues {state['requeues']}  "
          f"time left {state.get('time_left') or '-'}  last checkpoint {state['last_checkpoint'] or '-'}")
    if state.get("stop_reason"):
        print(f"stopped: {state['stop_reason']}")
    print(_table(state["steps"]))
    return 0


def _table(steps: dict[str, dict[str, Any]]) -> str:
    header = ("STEP", "KIND", "NODE", "STATE", "RESTARTS", "VERSION", "PROBE", "SLURM STEP")
    rows = [header] + [(name, s["kind"], ",".join(s["nodes"]), s["state"], str(s["restarts"]),
                        str(s["weight_version"] or "-"),
                        f"{s['last_probe_latency_s'] * 1000:.0f} ms" if s["last_probe_latency_s"] is not None else "-",
                        s["slurm_step"] or "-") for name, s in sorted(steps.items())]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def run(args: argparse.Namespace) -> int:
    try:
        job_dir = job_dir_of(args.job)
        if args.command == "status":
            return _status(job_dir, args.json)
        if args.command == "events":
            for event in follow(job_dir.events, from_start=True, stop=None if args.follow else _at_end()):
                print(json.dumps(event), flush=True)
            return 0
        if args.command == "restart":
            ControlClient(job_dir, _WAITS.control_call_timeout).call(Call.RESTART, target=args.step)
            print(f"restarting {args.step}")
            return 0
        ControlClient(job_dir, _WAITS.control_call_timeout).call(Call.STOP)
        print("stopping: the trainer saves at its next rollout boundary, then the job ends")
        return 0
    except (JobNotFound, ControlError, FileNotFoundError) as err:
        print(f"slurmrl {args.command}: error: {err}", file=sys.stderr)
        return 1


def _at_end():
    """A stop flag that is already set: follow() then yields what is in the file and returns."""
    import threading

    done = threading.Event()
    done.set()
    return done


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    status = subparsers.add_parser("status", help="a table of a job's steps, its weight version and checkpoint")
    status.add_argument("job", help="SLURM job id or job directory")
    status.add_argument("--json", action="store_true")
    restart = subparsers.add_parser("restart", help="restart one step of a running job")
    restart.add_argument("job")
    restart.add_argument("step", help="engine-K, router or trainer")
    events = subparsers.add_parser("events", help="the supervisor's actions, one JSON line each")
    events.add_argument("job")
    events.add_argument("-f", "--follow", action="store_true", help="keep printing new events")
    stop = subparsers.add_parser("stop", help="save, then end the job")
    stop.add_argument("job")
    for parser in (status, restart, events, stop):
        parser.set_defaults(func=run)
