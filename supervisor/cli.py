"""`slurmrl status|restart|events|stop JOB`: JOB is a SLURM job id or a job directory.

status reads the state store (and asks the supervisor, when one runs, for the time left);
restart and stop go through the job's control socket, which only its owner can use.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from jobs.contract import JobDir, read_heartbeat
from jobs.control_protocol import Call, ControlClient, ControlError
from jobs.spec import FaultToleranceSpec
from supervisor import status_view
from supervisor.events import follow
from supervisor.launcher import TRAINER
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
        done = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True,
                              timeout=_WAITS.slurm_command_timeout)
    except subprocess.TimeoutExpired:
        raise JobNotFound(f"job {job}: SLURM did not answer within {_WAITS.slurm_command_timeout:.0f} s; "
                          "give its job directory") from None
    except FileNotFoundError:
        raise JobNotFound(f"job {job}: there is no scontrol here (no SLURM client); give its job directory") from None
    if done.returncode != 0 and "invalid job id" not in done.stderr.lower():
        said = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise JobNotFound(f"job {job}: SLURM did not answer: {said} (is SLURM_CONF set?)")
    for field in done.stdout.split():
        if field.startswith("StdOut="):
            candidate = JobDir(Path(field.split("=", 1)[1]).parent.parent)
            if candidate.spec.is_file():
                return candidate
    raise JobNotFound(f"job {job}: SLURM no longer knows it, or it is not a slurmrl job; give its job directory")


def _status(job_dir: JobDir, as_json: bool, since: float | None) -> int:
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
    print(status_view.header(state))
    if state.get("stop_reason"):
        print(f"stopped: {state['stop_reason']}")
    launched = (state["steps"].get(TRAINER) or {}).get("launched_at")
    beat = read_heartbeat(job_dir, launched) if launched else None
    print(status_view.table(state["steps"], state["job_id"], beat))
    if since is not None:
        print("\nevents:")
        for event in follow(job_dir.events, from_start=True, stop=_at_end()):
            if float(event["time"]) >= since:
                print(event_line(event))
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        job_dir = job_dir_of(args.job)
        if args.command == "status":
            return _status(job_dir, args.json, args.since)
        if args.command == "events":
            for event in follow(job_dir.events, from_start=True, stop=None if args.follow else _at_end()):
                if args.since is None or float(event["time"]) >= args.since:
                    print(json.dumps(event) if args.json else event_line(event), flush=True)
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


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_SHOWN_FIRST = ("time", "iso", "kind", "step")


def since_time(text: str) -> float:
    """--since: an age (90s, 10m, 2h, 1d) or an ISO time (UTC unless it says) -> a unix time."""
    if text[:-1].replace(".", "", 1).isdigit() and text[-1] in _UNITS:
        return time.time() - float(text[:-1]) * _UNITS[text[-1]]
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an age (90s, 10m, 2h, 1d) nor an ISO time "
                                         "(2026-11-24T06:00)") from None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def event_line(event: dict[str, Any]) -> str:
    """One event for a person: time (UTC), kind, step, then its fields as key=value."""
    rest = " ".join(f"{k}={json.dumps(v) if not isinstance(v, str) or ' ' in v else v}"
                    for k, v in event.items() if k not in _SHOWN_FIRST)
    when = str(event.get("iso", ""))[:23].replace("T", " ")
    return f"{when}  {event['kind']:<20} {event.get('step') or '-':<10} {rest}".rstrip()


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
    status.add_argument("--since", type=since_time, metavar="WHEN", help="also list the events from then on "
                        "(an ISO time or an age: 90s, 10m, 2h, 1d)")
    restart = subparsers.add_parser("restart", help="restart one step of a running job")
    restart.add_argument("job")
    restart.add_argument("step", help="engine-K, router or trainer")
    events = subparsers.add_parser("events", help="the supervisor's actions and their reasons, oldest first")
    events.add_argument("job")
    events.add_argument("-f", "--follow", action="store_true", help="keep printing new events")
    events.add_argument("--since", type=since_time, metavar="WHEN",
                        help="only events from then on: an ISO time (2026-11-24T06:00) or an age (90s, 10m, 2h, 1d)")
    events.add_argument("--json", action="store_true", help="one JSON object per line, as in events.jsonl")
    stop = subparsers.add_parser("stop", help="save, then end the job")
    stop.add_argument("job")
    for parser in (status, restart, events, stop):
        parser.set_defaults(func=run)
