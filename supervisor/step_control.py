"""Step control, the interface the supervisor launches, watches, signals and cancels its steps
through, and what its two backends share: StepController (supervisor/steps.py: srun steps of a
SLURM job) and LocalSteps (supervisor/local_steps.py: plain processes on this machine, for fast
tests of the recovery logic without SLURM).

A Step's `proc` is a child of the supervisor in its own process group (srun, a local process, or
an adopted step's stand-in), so its exit is seen the moment it happens: one pidfd watcher thread
for all steps calls on_exit. An adopted step (one a previous supervisor launched) has no child of
ours: it gets a stand-in, which exits with the step's exit code once the backend sees it ended,
so its end reaches on_exit exactly like a launched step's.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple, Protocol, runtime_checkable

from slurm.contact import SlurmContact
from slurm.step_spec import StepSpec

log = logging.getLogger(__name__)

StepStatus = Literal["pending", "running", "exited", "unknown"]

# The stand-in: exits with the code written to its stdin (or 255 when its supervisor dies first).
_STAND_IN = ("/bin/sh", "-c", 'read -r code; exit "${code:-255}"')
UNKNOWN_EXIT = 255  # the step's end was never recorded (no slurmdbd, or past exit_code_wait_s)
CANCELLED_EXIT = 128 + signal.SIGTERM


class StepProcess(Protocol):
    """What the supervisor holds of a step: a child of its own in its own process group (srun, a
    local process, a stand-in), or an engine's run in a node agent (supervisor/node_agents.py, whose
    pid is its agent's srun: a signal to it reaches the whole node's agent)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass
class Step:
    """A step this supervisor launched (proc is its srun or process) or adopted (proc is its stand-in)."""

    spec_name: str
    proc: StepProcess | None
    slurm_step: str | None = None  # "JOBID.STEPID", once the backend lists it
    adopted: bool = False
    gone_since: float | None = None  # adopted: when the backend stopped listing it
    log: Path | None = None  # where its srun (or process) writes, from log_offset on for this launch
    log_offset: int = 0

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()


class StepCount(NamedTuple):
    """The job's steps launched so far, against SLURM's MaxStepCount (None: not known)."""

    launched: int
    limit: int | None
    nearing: bool  # past slurm.pacing.STEP_BUDGET_WARN_FRACTION of the limit


@runtime_checkable
class StepControl(Protocol):
    """What the supervisor (daemon, launcher, recovery, adoption, node failures) asks of its steps."""

    @property
    def contact(self) -> SlurmContact:
        """Whether the scheduler answered of late (recovery waits out its silence)."""

    def launch(self, spec: StepSpec) -> Step:
        """Start a step (Fenced if a newer run of the job owns the steps)."""

    def query(self) -> dict[str, tuple[str, str]] | None:
        """All live steps of the job: {step id: (name, state)}; None if unknown (no answer)."""

    def refresh(self, steps: Iterable[Step]) -> dict[str, StepStatus]:
        """Where each of `steps` stands (fills in step ids; settles adopted steps that ended)."""

    def adopt(self, recorded: Mapping[str, str | None]) -> list[Step] | None:
        """{name: step id or None} -> the steps of those names still running, each with a stand-in."""

    def ended(self, name: str, step_id: str, code: int | None = None) -> Step:
        """A step that ended unwatched, as an adopted Step whose stand-in exits with its exit code:
        `code` where the caller knows it (no scheduler is asked), else the scheduler's record."""

    def exit_codes(self, step_ids: Collection[str]) -> dict[str, int]:
        """{step id: exit code} of those of the steps that ended and whose end is recorded."""

    def cancel(self, step: Step, timeout_s: float, term_grace_s: float) -> None:
        """Stop the step, within timeout_s, then by signals term_grace_s apart."""

    def abandon(self, step: Step, wait_s: float) -> None:
        """A fenced supervisor's step: SIGKILL its child, tell the scheduler nothing."""

    def rate_limited(self, step: Step) -> str | None:
        """The scheduler's refusal of this launch for its RPC rate limit (the words), else None;
        when refused, later launches slow down."""

    def count(self) -> StepCount:
        """The job's steps launched so far, against the scheduler's limit."""

    def close(self) -> None:
        """Stop watching for exits."""


class ExitWatcher:
    """One thread that waits on a pidfd per step child and reports each exit at once."""

    def __init__(self, on_exit: Callable[[Step], None]) -> None:
        self._on_exit = on_exit
        self._epoll = select.epoll()
        self._wake = os.eventfd(0)
        self._epoll.register(self._wake, select.EPOLLIN)
        self._steps: dict[int, Step] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="step-exits", daemon=True)
        self._thread.start()

    def watch(self, step: Step) -> None:
        assert step.proc is not None
        fd = os.pidfd_open(step.proc.pid)
        with self._lock:
            self._steps[fd] = step
        self._epoll.register(fd, select.EPOLLIN)

    def _run(self) -> None:
        while not self._closed:
            for fd, _ in self._epoll.poll():
                if fd == self._wake:
                    continue
                self._epoll.unregister(fd)
                os.close(fd)
                with self._lock:
                    step = self._steps.pop(fd)
                assert step.proc is not None
                step.proc.wait()  # reap it; returncode is then set
                try:
                    self._on_exit(step)
                except Exception:  # one bad callback must not end exit detection for all steps
                    log.exception("on_exit callback failed for step %s", step.spec_name)

    def close(self) -> None:
        self._closed = True
        os.eventfd_write(self._wake, 1)
        self._thread.join()
        with self._lock:
            for fd in self._steps:
                os.close(fd)
            self._steps.clear()
        self._epoll.close()
        os.close(self._wake)


def log_offset(log: Path) -> int:
    """Where the next launch's words start in a step's log (appended to by every launch of it)."""
    try:
        return log.stat().st_size
    except FileNotFoundError:
        return 0


_SRUN_WORDS_MAX = 64 * 1024  # of a launch's log read for srun's own lines (they come first or last)


def srun_lines(step: Step) -> list[str]:
    """srun's own lines ("srun: error: ...") in the step's log since its launch."""
    if step.log is None:
        return []
    try:
        with open(step.log, "rb") as log:
            log.seek(step.log_offset)
            head = log.read(_SRUN_WORDS_MAX)
            log.seek(max(step.log_offset + len(head), log.seek(0, os.SEEK_END) - _SRUN_WORDS_MAX))
            tail = log.read()
    except OSError:
        return []
    text = (head + tail).decode(errors="replace")
    return [line for line in text.splitlines() if line.startswith("srun: ")]


def stand_in(name: str, step_id: str, watcher: ExitWatcher | None) -> Step:
    """An adopted step: a stand-in child that exits when released (release)."""
    proc = subprocess.Popen(_STAND_IN, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, process_group=0)
    step = Step(name, proc, step_id, adopted=True)
    if watcher is not None:
        watcher.watch(step)
    return step


_release_lock = threading.Lock()


def release(step: Step, code: int) -> None:
    """Let an adopted step's stand-in exit with `code` (once: later calls do nothing)."""
    with _release_lock:
        stdin = step.proc.stdin if isinstance(step.proc, subprocess.Popen) else None
        if stdin is None or stdin.closed:
            return
        try:
            os.write(stdin.fileno(), f"{code}\n".encode())
        except BrokenPipeError:  # it is gone already
            pass
        stdin.close()


def stop_process_group(proc: StepProcess, term_grace_s: float) -> None:
    """SIGTERM, then SIGKILL, to the child's own process group, term_grace_s apart; TimeoutExpired
    if even SIGKILL did not end it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(term_grace_s)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.wait(0)


def kill_process_group(step: Step, wait_s: float) -> None:
    """SIGKILL the step's child's process group (nothing else is told) and wait for it."""
    if step.proc is None or step.proc.poll() is not None:
        return
    try:
        os.killpg(step.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    step.proc.wait(wait_s)
