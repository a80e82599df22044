"""The pace and the count of a job's step launches.

Every srun asks slurmctld for a step (an RPC under its job write lock) and every step stays in the
job's record: hundreds of engines restarting at once (a lost node, a requeue) would arrive as one
burst, and a long job that relaunches steps for days can reach SLURM's MaxStepCount (slurm.conf,
default 40000 steps per job), after which srun is refused for the rest of the job. So launches go
through a token bucket (a burst, then a steady rate), and the job's step count is checked against
MaxStepCount before each launch: past it, a clear error instead of an srun SLURM refuses (and the
job is told once it has used STEP_BUDGET_WARN_FRACTION of it). A site that turns on slurmctld's
per-user RPC rate limit (rl_enable) refuses sruns beyond its bucket: the pace then halves
(`LaunchPacer.refused`) and the refused launch is tried again by its caller.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable

# A burst as large as a big job's engines restarting together after one lost node, then a rate
# slurmctld takes alongside its other work (the devcluster's slurmctld takes ~50 step RPCs/s).
LAUNCH_BURST = 16  # launches at once before pacing starts
LAUNCH_RATE_PER_S = 8.0  # launches per second after that, refilled continuously
MAX_STEP_COUNT_DEFAULT = 40000  # SLURM's own default, used when `scontrol show config` does not answer
STEP_BUDGET_WARN_FRACTION = 0.9  # of MaxStepCount launched: the job is told it nears the limit
# After SLURM refused a launch for its rate limit, the pace halves (not below this), and doubles
# back toward its own after each RATE_RECOVERY_S without a refusal.
MIN_LAUNCH_RATE_PER_S = 0.25
RATE_RECOVERY_S = 30.0

# What srun prints when slurmctld refuses it for the per-user RPC rate limit
# (SlurmctldParameters=rl_enable, SLURM >= 23.02; src/common/slurm_errno.c): BACKOFF (1804),
# "Rate limit exceeded, please retry momentarily" (a >= 23.02 client retries it itself, a second
# apart, so it reaches srun's caller only as a slow start) and rpc_queue's HARD_DROP (1805),
# "..., please retry later"; an older client knows neither code: "Unknown error 1804" or "1805".
_RATE_LIMITED = re.compile(r"Rate limit exceeded|Unknown error 180[45]\b")


def rate_limited(said: str) -> bool:
    """Whether a SLURM program's words are slurmctld's rate-limit refusal."""
    return bool(_RATE_LIMITED.search(said))


class StepLimitReached(RuntimeError):
    """The job has launched as many steps as SLURM's MaxStepCount allows: srun would be refused."""


class LaunchPacer:
    """A token bucket: `burst` launches at once, then `rate_per_s` per second. Thread-safe; each
    caller waits its own turn (the wait is at most (callers ahead of it + 1) / rate_per_s).
    `refused()`: SLURM refused a launch for its rate limit: the bucket empties and the rate halves,
    to come back after quiet periods (RATE_RECOVERY_S each)."""

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
        self._rate = rate_per_s  # the pace now: rate_per_s, or less after refusals
        self._refused_at: float | None = None

    @property
    def rate(self) -> float:
        """Launches per second now."""
        with self._lock:
            self._recover(self._clock())
            return self._rate

    def acquire(self) -> float:
        """Take one launch's token, waiting for it if the bucket is empty; the seconds waited."""
        with self._lock:
            now = self._clock()
            self._recover(now)
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self._rate)
            self._at = now
            self._tokens -= 1  # below 0: owed, and this caller waits until it is paid back
            wait_s = max(0.0, -self._tokens / self._rate)
        if wait_s:
            self._sleep(wait_s)
        return wait_s

    def refused(self) -> float:
        """SLURM refused a launch for its rate limit: no burst until the bucket refills, at half the
        pace (not below MIN_LAUNCH_RATE_PER_S). The new rate."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self._tokens, 0.0)
            self._at = now
            self._rate = max(MIN_LAUNCH_RATE_PER_S, self._rate / 2)
            self._refused_at = now
            return self._rate

    def _recover(self, now: float) -> None:
        # Each quiet RATE_RECOVERY_S since the last refusal (or the last step back up) doubles the
        # pace, up to the configured one.
        while self._refused_at is not None and now - self._refused_at >= RATE_RECOVERY_S:
            self._rate = min(self.rate_per_s, self._rate * 2)
            self._refused_at = None if self._rate == self.rate_per_s else self._refused_at + RATE_RECOVERY_S


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

    @property
    def nearing_limit(self) -> bool:
        """Whether the job has launched STEP_BUDGET_WARN_FRACTION of MaxStepCount or more."""
        with self._lock:
            return self._limit is not None and self._launched >= STEP_BUDGET_WARN_FRACTION * self._limit

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
