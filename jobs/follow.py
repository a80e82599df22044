"""`slurmrl submit --wait`: a submitted job followed to its end, each change of state printed.

The state is the accounting's (sacct, through slurmdbd). Where accounting does not answer (slurmdbd
down or unreachable), the job is followed with squeue while slurmctld lists it, and once it no
longer does, by the outcome its supervisor left in the job dir (supervisor_state.json's
stop_reason); either silence is said once, not at every look.
"""

from __future__ import annotations

import re
import sys
import time
import typing as tp
from dataclasses import dataclass

from contract.job_dir import JobDir
from slurm.client import Reply, SlurmClient

FOLLOW_INTERVAL_S = 2.0  # between two looks at the job (one sacct call; squeue too while sacct is silent)
# States after which the job will not run again (REQUEUED, PREEMPTED... are not ends).
UNFINISHED = ("READY", "PENDING", "RUNNING", "UNKNOWN", "REQUEUED", "COMPLETING", "PREEMPTED", "CONFIGURING",
              "RESIZING", "SUSPENDED", "REQUEUE_HOLD", "REQUEUE_FED", "SIGNALING", "STAGE_OUT", "STOPPED")


@dataclass(frozen=True)
class Look:
    """The job's state at one look; final: it will not change again."""

    state: str
    final: bool
    note: str = ""  # where the state came from, when not from the accounting


def follow(job_id: str, job_dir: JobDir, interval_s: float = FOLLOW_INTERVAL_S, out: tp.TextIO = sys.stdout,
           client: SlurmClient | None = None) -> str:
    """Print each change of the job's state until it ends (no deadline: a job may run for days), and
    return the final state (COMPLETED, FAILED, CANCELLED, TIMEOUT, ...; UNKNOWN when SLURM has
    forgotten the job, accounting is silent and its supervisor wrote no outcome)."""
    client = client or SlurmClient()
    said: set[str] = set()

    def say_once(key: str, line: str) -> None:
        if key not in said:
            said.add(key)
            print(line, file=out, flush=True)

    last = None
    while True:
        look = _look(job_id, job_dir, client, say_once)
        if look is None:  # SLURM silent: no news
            time.sleep(interval_s)
            continue
        if look.state != last:
            print(f"job {job_id}: {look.state}" + (f" ({look.note})" if look.note else ""), file=out, flush=True)
            last = look.state
        if look.final:
            return look.state
        time.sleep(interval_s)


def _look(job_id: str, job_dir: JobDir, client: SlurmClient,
          say_once: tp.Callable[[str, str], None]) -> Look | None:
    accounted = client.call("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "JobID,State")
    if accounted.ok:
        state = _job_row(accounted.stdout, job_id)
        if state is not None:
            return Look(state, state not in UNFINISHED)
        # not recorded yet (just submitted): slurmctld knows it
    else:
        say_once("sacct", f"job {job_id}: accounting does not answer ({_why(accounted)}); following the job "
                          f"with squeue, then its job dir {job_dir.root}")
    # -t all: an ended job too, while slurmctld keeps it (MinJobAge), with its final state
    queued = client.call("squeue", "-h", "-j", job_id, "-t", "all", "-o", "%i|%T")
    if queued.ok:
        state = _job_row(queued.stdout, job_id)
        if state is not None:
            return Look(state, state not in UNFINISHED, "squeue" if not accounted.ok else "")
    elif not queued.answered:
        say_once("squeue", f"job {job_id}: slurmctld does not answer either ({_why(queued)}); waiting for it")
        return None
    if accounted.ok:
        return Look("PENDING", False)  # neither lists it yet
    # Gone from slurmctld's list, and accounting silent: what its supervisor wrote in the job dir.
    ended, reason = _outcome(job_dir, job_id)
    if ended is None:
        return Look("UNKNOWN", True, f"ended; its supervisor wrote no outcome: see {job_dir.submitit}")
    return Look(ended, True, f"from the job dir: {reason}")


def _job_row(text: str, job_id: str) -> str | None:
    """The job's state in sacct's or squeue's `ID|STATE` lines: a heterogeneous job's is its component
    0's, where the batch step (the supervisor) runs. "CANCELLED by 0" -> CANCELLED."""
    states = {}
    for line in text.splitlines():
        row_id, _, state = line.partition("|")
        if state.strip():
            states[row_id.strip()] = state.split()[0]
    return states.get(f"{job_id}+0") or states.get(job_id)


def _why(reply: Reply) -> str:
    return (reply.stderr.strip().splitlines() or [reply.why or f"exit code {reply.returncode}"])[-1]


def _outcome(job_dir: JobDir, job_id: str) -> tuple[str | None, str]:
    """(the state SLURM records for the job, by its supervisor's stop reason; the reason), or None
    where the job dir does not say (no supervisor state, another job's, or a requeue SLURM forgot)."""
    from supervisor.requeue import requeues
    from supervisor.state import read_state

    try:
        state = read_state(job_dir)
    except (OSError, ValueError):
        return None, ""
    reason = state.stop_reason
    # requeued, then forgotten; or a run a newer one took over (supervisor.daemon.FENCED)
    if not reason or state.job_id != job_id or requeues(reason) or reason.startswith("fenced:"):
        return None, reason or ""
    if reason.startswith("failed:"):  # the supervisor raised: the batch step failed
        return "FAILED", reason
    ended_by = re.match(r"ended by SLURM \((\w+)\)", reason)
    if ended_by:
        return ended_by.group(1), reason
    return "COMPLETED", reason  # the supervisor returned its outcome: the batch step exited 0
