"""The batch step's watchdog: the callable (the supervisor) runs in a child process that is started
again when it crashes, so that a crash costs a restart of a few seconds, not the job.

SLURM ends the whole job (every step with it) when the batch step's main process dies. That process
is this watchdog, which does nothing that can crash: it forwards SLURM's signals to the child
(`--signal=B:USR1` and `scancel --batch` reach the batch shell only), waits, and starts the child
again if a signal killed it (SIGKILL, the OOM killer, SIGSEGV). The new supervisor adopts the steps
its predecessor left running (supervisor.daemon). A child that exits, normally or by a Python
exception (which Submitit records as the job's result), ends the watchdog with its exit code; so
does one killed while SLURM ends the job (SIGTERM), or after MAX_RESTARTS restarts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

CHILD_ENV = "SLURMRL_SUPERVISOR_CHILD"  # set in the child: do the work instead of watching
RESTARTS_ENV = "SLURMRL_SUPERVISOR_RESTARTS"  # how many times the watchdog restarted the child
MAX_RESTARTS = 3
FORWARDED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGCONT)
# SLURM ends a job with SIGTERM (then SIGKILL): a child it ended is not restarted.
_ENDING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Watchdog:
    """Runs `argv` as a child, forwards FORWARDED signals to it, restarts it after a crash."""

    def __init__(self, argv: list[str], max_restarts: int = MAX_RESTARTS) -> None:
        self.argv = argv
        self.max_restarts = max_restarts
        self.child: subprocess.Popen[bytes] | None = None
        self.ending = False

    def run(self) -> int:
        """The exit code to end with: the child's, or 128 + the signal that killed it."""
        for signum in FORWARDED:
            signal.signal(signum, self._forward)
        restarts = 0
        while True:
            self.child = subprocess.Popen(self.argv, env={**os.environ, CHILD_ENV: "1", RESTARTS_ENV: str(restarts)})
            code = self.child.wait()
            if code >= 0 or self.ending or -code in _ENDING or restarts >= self.max_restarts:
                return code if code >= 0 else 128 - code
            restarts += 1
            _log(f"supervisor_crashed signal={signal.Signals(-code).name} pid={self.child.pid} "
                 f"restart={restarts}/{self.max_restarts}")

    def _forward(self, signum: int, frame: object) -> None:
        if signum in _ENDING:
            self.ending = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)


def _log(message: str) -> None:
    # One line in the job's stderr; the restarted supervisor's supervisor_started event (events.jsonl)
    # carries the restart count.
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    print(f"{stamp} slurmrl watchdog: {message}", file=sys.stderr, flush=True)


def watch_self(max_restarts: int = MAX_RESTARTS) -> int | None:
    """In the batch step: run this very command line again as a watched child and return the exit
    code to end with. In that child: None, so the caller goes on and does the work."""
    if os.environ.pop(CHILD_ENV, None):  # popped: the steps it launches are no watched children
        return None
    return Watchdog([sys.executable, *sys.orig_argv[1:]], max_restarts).run()
