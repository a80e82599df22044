"""Start and stop the devcluster's daemons by PID file, and wait on conditions with deadlines.

Each daemon runs in the foreground of its own session, its output appended to its log. Its PID
file records the PID and the process start time, so a recycled PID is never signalled.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil


class DevclusterError(RuntimeError):
    """A failure the user can act on; the message says what happened and what to do."""


@contextmanager
def machine_lock(name: str) -> Iterator[None]:
    """Hold /tmp/slurmrl-devcluster-<name>.lock for the block: for what every devcluster on this
    machine shares (apt-get, /etc/hosts, the choice of a free subnet), when two are brought up or
    down at once (a test worker each). The kernel releases it if the holder dies."""
    with open(f"/tmp/slurmrl-devcluster-{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.2) -> None:
    """Poll `predicate` until it is true; raise TimeoutError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


def wait_gone(proc: psutil.Process, timeout_s: float) -> None:
    """Wait until `proc` has exited. A zombie counts as exited: a daemon restarted by a test
    (revive_slurmd) is that test process's child, which no one reaps while `down` runs."""
    def gone() -> bool:
        try:
            return proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    wait_for(gone, timeout_s, f"process {proc.pid} to exit", interval_s=0.1)


def log_tail(path: Path, lines: int = 15) -> str:
    if not path.exists():
        return f"({path} does not exist)"
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return "\n".join(f"    {line}" for line in text) or "    (empty)"


@dataclass(frozen=True)
class Daemon:
    """One daemon of the devcluster: how to run it and where its PID file and log are."""

    name: str
    argv: list[str]
    pid_file: Path
    log_file: Path
    env: dict[str, str] | None = None

    def process(self) -> psutil.Process | None:
        """The live process this daemon's PID file names, or None."""
        try:
            pid_text, started_text = self.pid_file.read_text().split()
            proc = psutil.Process(int(pid_text))
            if abs(proc.create_time() - float(started_text)) > 0.01 or proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc
        except (FileNotFoundError, ValueError, psutil.NoSuchProcess):
            return None

    def is_running(self) -> bool:
        return self.process() is not None

    def start(self) -> None:
        """Start the daemon unless it already runs; fail with its log if it exits at once."""
        if self.is_running():
            return
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **(self.env or {})}
        with open(self.log_file, "ab") as log:
            # cwd: a daemon keeps its own folder, not its caller's (a deleted caller's folder made
            # slurmstepd print "Unable to get current working directory" into every step's output)
            proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, start_new_session=True, cwd=self.log_file.parent,
            )
        self.pid_file.write_text(f"{proc.pid} {psutil.Process(proc.pid).create_time()}\n")
        try:
            proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            return
        raise DevclusterError(
            f"{self.name} exited at once with code {proc.returncode}; its log {self.log_file} ends:\n"
            f"{log_tail(self.log_file)}"
        )

    def check_alive(self) -> None:
        if not self.is_running():
            raise DevclusterError(f"{self.name} is not running; its log {self.log_file} ends:\n"
                                  f"{log_tail(self.log_file)}")

    def stop(self, timeout_s: float = 20.0) -> bool:
        """SIGTERM, then SIGKILL past the deadline. Returns whether a process was stopped."""
        proc = self.process()
        if proc is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        proc.send_signal(signal.SIGTERM)
        try:
            wait_gone(proc, timeout_s)
        except TimeoutError:
            proc.kill()
            wait_gone(proc, 10)
        self.pid_file.unlink(missing_ok=True)
        return True


def port_open(addr: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((addr, port)) == 0
