"""What the supervisor's parts share: the job's collaborators (built once by the daemon) and the
one piece of job-wide mutable state every thread may touch, Ending, behind its own lock."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from contract.job_dir import JobDir
from contract.spec import FaultToleranceSpec, JobSpec
from rollout.engine_client import EngineClient
from supervisor.engines import Engines
from supervisor.events import EventLog
from supervisor.gpu_holder import GpuHolder
from supervisor.layout import Layout
from supervisor.state import StateStore
from supervisor.step_control import Step


@dataclass(frozen=True)
class JobContext:
    spec: JobSpec
    dir: JobDir
    layout: Layout
    events: EventLog
    store: StateStore
    engines: Engines  # the one owner of every engine's fields, and of their records in the store
    client: EngineClient
    finished: threading.Event  # set when the supervisor shuts down: every wait of every part ends
    inbox: queue.Queue[Step]  # the monitor's: steps that exited, and wake-ups (Step(name, None))
    gpus: GpuHolder = field(default_factory=GpuHolder)  # --colocate: the trainer or the engines hold the GPUs

    @property
    def ft(self) -> FaultToleranceSpec:
        return self.spec.fault_tolerance

    def wake_monitor(self, name: str) -> None:
        self.inbox.put(Step(name, None))


def restart_backoff(ft: FaultToleranceSpec, recent_restarts: int) -> float:
    """Seconds before a restart: none before the first of a crash loop, then restart_backoff, doubling."""
    return 0.0 if recent_restarts == 0 else ft.restart_backoff * 2 ** (recent_restarts - 1)


class Ending:
    """Whether the job must end, and why: set from any thread, read by the monitor and the trainer's
    poll. A `slurmrl stop` holds for every later start of the same job (the state store keeps it)."""

    def __init__(self, user_stop: bool) -> None:
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._user_stop = user_stop
        self._stop = user_stop
        self._by_slurm: str | None = None

    def fail(self, reason: str) -> None:
        """The job cannot go on (the first reason is kept)."""
        with self._lock:
            self._failure = self._failure or reason

    def stop(self, by_user: bool) -> bool:
        """The trainer is to save at its next rollout boundary and end. True if this is news."""
        with self._lock:
            news = not self._stop
            self._stop = True
            self._user_stop = self._user_stop or by_user
            return news

    def slurm_ends(self, state: str) -> None:
        """SLURM is ending the job (scancel, requeue, time limit): nothing is relaunched any more;
        the trainer's exit (after its save on SIGTERM) decides the outcome."""
        with self._lock:
            self._by_slurm = self._by_slurm or state

    @property
    def by_slurm(self) -> str | None:
        with self._lock:
            return self._by_slurm

    @property
    def failure(self) -> str | None:
        with self._lock:
            return self._failure

    @property
    def stop_requested(self) -> bool:
        with self._lock:
            return self._stop

    @property
    def by_user(self) -> bool:
        with self._lock:
            return self._user_stop
