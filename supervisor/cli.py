"""`slurmrl status|restart|events|stop JOB`: JOB is a SLURM job id or a job directory.

status reads the state store (and asks the supervisor, when one runs, for the time left);
restart and stop go through the job's control socket, which only its owner can use.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from typing import Any

from contract.control_protocol import Call, ControlClient, ControlError
from contract.job_dir import JobDir, read_heartbeat
from contract.spec import FaultToleranceSpec
from contract.spec_loading import read_job_spec
from supervisor import slurm_jobs, status_view
from supervisor.events import follow
from supervisor.launcher import TRAINER
from supervisor.state import read_state
from supervisor.trainer_files import last_checkpoint

# Before the job's spec is read (finding its directory) and for the CLI's own calls: the defaults.
_WAITS = FaultToleranceSpec()


def _status(job_dir: JobDir, args: argparse.Namespace) -> int:
    if args.json:
        state, live = _state(job_dir)
        if state is None:
            return _not_started(job_dir)
        print(json.dumps({**state, "supervisor_running": live}))
        return 0
    while True:
        text, code, over = _status_text(job_dir, args.since)
        if args.watch and sys.stdout.isatty():
            print("\x1b[H\x1b[2J", end="")  # home and clear: the table refreshes in place
        print(text, flush=True)
        if not args.watch or over:
            return code
        time.sleep(args.watch)
        if not sys.stdout.isatty():
            print()


def _state(job_dir: JobDir) -> tuple[dict[str, Any] | None, bool]:
    """The live supervisor's state, else the saved one; (None, False) before the supervisor's start."""
    if not job_dir.state.is_file():
        return None, False
    try:
        return ControlClient(job_dir, _WAITS.control_call_timeout).call(Call.STATUS)["state"], True
    except ControlError:
        from dataclasses import asdict

        state = asdict(read_state(job_dir))
        # A supervisor that ended with its job (SLURM's TIMEOUT, a lost head node) did not write its
        # last checkpoint: the tracker holds it.
        state["last_checkpoint"] = _last_checkpoint(job_dir) or state["last_checkpoint"]
        return state, False


def _last_checkpoint(job_dir: JobDir) -> str | None:
    try:
        return last_checkpoint(read_job_spec(job_dir.root).trainer.save)
    except (OSError, ValueError):  # no spec (a job dir of an older slurmrl) or one that does not parse
        return None


def _status_text(job_dir: JobDir, since: float | None) -> tuple[str, int, bool]:
    """(what to print, exit code, whether the job is over)."""
    state, live = _state(job_dir)
    if state is None:
        return _before_start(job_dir)
    lines = [status_view.header(state)]
    over = bool(state.get("stop_reason"))
    if over:
        lines.append(f"stopped: {state['stop_reason']}")
    elif not live and (slurm := _slurm_job(job_dir)) is not None and not slurm.queued:
        lines.append(f"ended: SLURM says {slurm.state} (the supervisor wrote no reason: see {job_dir.root}/submitit)")
        over = True
        state["steps"] = status_view.ended_with_the_job(state["steps"])
    lines += [f"node {node} lost: {what}" for node, what in (state.get("lost_nodes") or {}).items()]
    launched = (state["steps"].get(TRAINER) or {}).get("launched_at")
    beat = read_heartbeat(job_dir, launched) if launched else None
    lines.append(status_view.table(state["steps"], state["job_id"], beat))
    if since is not None:
        lines.append("\nevents:")
        lines += [event_line(e) for e in follow(job_dir.events, from_start=True, stop=_at_end())
                  if float(e["time"]) >= since]
    return "\n".join(lines), 0, over


def _before_start(job_dir: JobDir) -> tuple[str, int, bool]:
    slurm = _slurm_job(job_dir)
    if slurm is None:
        return (f"{job_dir.root}: no supervisor state yet, and SLURM knows no job of it "
                f"({job_dir.slurm_job_id.name} is missing or names a job SLURM forgot: slurmctld no longer "
                "holds it, and the accounting has no record or does not answer)"), 1, True
    if slurm.state == "PENDING":
        return (f"job {slurm.job_id} is pending ({slurm.reason or 'no reason given'}): the supervisor starts "
                "when SLURM runs the job"), 0, False
    if slurm.queued:
        return f"job {slurm.job_id} is {slurm.state.lower()}: its supervisor has not written its state yet", 0, False
    return (f"job {slurm.job_id} ended ({slurm.state}) before its supervisor started: see "
            f"{job_dir.root}/submitit"), 1, True


def _slurm_job(job_dir: JobDir) -> slurm_jobs.SlurmJob | None:
    try:
        job_id = job_dir.slurm_job_id.read_text().strip()
    except OSError:
        return None
    return slurm_jobs.job_state(job_id, _WAITS.slurm_command_timeout)


def _not_started(job_dir: JobDir) -> int:
    text, code, _ = _before_start(job_dir)
    print(f"slurmrl status: {text}", file=sys.stderr if code else sys.stdout)
    return code


def run(args: argparse.Namespace) -> int:
    try:
        job_dir = slurm_jobs.job_dir_of(args.job, _WAITS.slurm_command_timeout)
        if args.command == "status":
            return _status(job_dir, args)
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
    except (slurm_jobs.JobNotFound, slurm_jobs.SlurmUnavailable, ControlError, FileNotFoundError) as err:
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
    status.add_argument("--watch", nargs="?", type=float, const=5.0, metavar="SECONDS",
                        help="refresh in place every SECONDS (default 5) until the job ends")
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
