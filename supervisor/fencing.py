"""Fencing an older run of the job. A node cut off from the network keeps its processes: when
SLURM requeues the job without that node (a node failure), the old run's supervisor, router and
trainer may live on there and come back when the link heals. A run is SLURM's restart count of
the job (SLURM_RESTART_COUNT, 0 before the first requeue); the state store on the shared job dir
holds the newest run's. A supervisor of an older run stops: it writes no state or event, and it
launches, cancels or signals no SLURM step (step ids start again at 0 after a requeue, so an old
`scancel JOB.3` would hit the new run's step 3)."""

from __future__ import annotations

import threading

from contract.control_protocol import recorded_run
from contract.job_dir import JobDir
from slurm import env as slurm_env


class Fenced(Exception):
    """A newer run of this job owns its job dir and its SLURM steps."""


def own_run() -> int:
    """This process's run of the job (its steps inherit the batch step's environment)."""
    return slurm_env.restart_count()


class Fence:
    """Whether a newer run of the job has started: a look at the state store on each ask, and
    sticky once seen (a fenced supervisor never becomes current again)."""

    def __init__(self, job_dir: JobDir, job_id: str, run: int) -> None:
        self.job_dir = job_dir
        self.job_id = job_id
        self.run = run
        self._lock = threading.Lock()
        self._newer: int | None = None

    @property
    def fenced(self) -> bool:
        """Whether a newer run has started (looks again unless already seen)."""
        with self._lock:
            if self._newer is None:
                recorded = recorded_run(self.job_dir, self.job_id)
                if recorded is not None and recorded > self.run:
                    self._newer = recorded
            return self._newer is not None

    def check(self) -> None:
        """Fenced if a newer run has started; before any write of the job dir or any SLURM action."""
        if self.fenced:
            raise Fenced(f"run {self._newer} of job {self.job_id} has started (SLURM requeued it); "
                         f"this supervisor of run {self.run} stops without touching its state or steps")
