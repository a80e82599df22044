"""The pace and the count of a job's step launches.

Every srun asks slurmctld for a step (an RPC under its job write lock) and every step stays in the
job's record: hundreds of engines restarting at once (a lost node, a requeue) would arrive as one
burst, and a long job that relaunches steps for days can reach SLURM's MaxStepCount (slurm.conf,
default 40000 steps per job), after which srun is refused for the rest of the job. So launches go
through a token bucket (a burst, then a steady rate), and the job's step count is checked against
MaxStepCount before each launch: past it, a clear error instead of an srun SLURM refuses.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

# A burst as large as a big job's engines restarting together after one lost node, then a rate
# slurmctld takes alongside its other work (the devcluster's slurmctld takes ~50 step RPCs/s).
LAUNCH_BURST = 16  # launches at once before pacing starts
LAUNCH_RATE_PER_S = 8.0  # launches per second after that, refilled continuously
MAX_STEP_COUNT_DEFAULT = 40000  # SLURM's own default, used when `scontrol show config` does not answer


class StepLimitReached(RuntimeError):
    """The job has launched as many steps as SLURM's MaxStepCount allows: srun would be refused."""


class LaunchPacer:
    """A token bucket: `burst` launches at once, then `rate_per_s` per second. Thread-safe; each
    caller waits its own turn (the wait is at most (callers ahead of it + 1) / rate_per_s)."""

    def __init__(self, burst: int = LAUNCH_BURST, rate_per_s: float = LAUNCH_RATE_PER_S,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        if burst < 1 or rate_per_s <= 0:
            raise ValueError(f"launch pacing needs burst >= 1 and rate > 0, got {burst} and {rate_per_s}")
        self.burst = burst
        self.rate_per_s = rate_per_s
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._tokens = float(burst)
        self._at = clock()

    def acquire(self) -> float:
        """Take one launch's token, waiting for it if the bucket is empty; the seconds waited."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate_per_s)
            self._at = now
            self._tokens -= 1  # below 0: owed, and this caller waits until it is paid back
            wait_s = max(0.0, -self._tokens / self.rate_per_s)
        if wait_s:
            self._sleep(wait_s)
        return wait_s


class StepBudget:
    """The number of steps the job has launched, against SLURM's MaxStepCount. The limit is read
    once, at the first launch, by `read_limit` (None: SLURM did not say; its default is assumed)."""

    def __init__(self, read_limit: Callable[[], int | None]) -> None:
        self._read_limit = read_limit
        self._limit: int | None = None
        self._launched = 0
        self._lock = threading.Lock()

    @property
    def launched(self) -> int:
        """Steps of the job launched so far (by this process, or seen listed by SLURM)."""
        with self._lock:
            return self._launched

    @property
    def limit(self) -> int | None:
        """MaxStepCount, once read."""
        return self._limit

    def seen(self, step_number: int) -> None:
        """SLURM lists step `step_number` of the job (a predecessor's launch): steps count from 0 and
        only grow within a run, so at least step_number + 1 were launched."""
        with self._lock:
            self._launched = max(self._launched, step_number + 1)

    def take(self) -> int:
        """Count one launch; StepLimitReached (and nothing counted) when it would pass MaxStepCount."""
        if self._limit is None:
            self._limit = self._read_limit() or MAX_STEP_COUNT_DEFAULT
        with self._lock:
            if self._launched >= self._limit:
                raise StepLimitReached(f"the job has launched {self._launched} steps, SLURM's MaxStepCount "
                                       f"({self._limit}): srun would be refused; requeue the job to count from 0")
            self._launched += 1
            return self._launched
