"""Engine health policy (invariant 5): a failure threshold, a first-wait grace after each
(re)start, and a cap on how many engines failed probes may kill per interval. The probes
themselves (every engine at once) are rollout.engine_client.EngineClient.probe_all's.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from rollout.engine_client import ProbeResult


@dataclass
class _EngineHealth:
    started_at: float
    in_grace: bool = True
    failures: int = 0


class HealthTracker:
    """Consecutive probe failures per engine, and the verdict once they reach the threshold.

    After each (re)start an engine has a first-wait grace: failures do not count until it first
    answers ok or `first_wait_s` has passed, whichever comes first (a process that dies in
    the meantime is the step launcher's to notice, not this tracker's).
    """

    def __init__(self, failure_threshold: int, first_wait_s: float) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure threshold must be 1 or more, got {failure_threshold}")
        self.failure_threshold = failure_threshold
        self.first_wait_s = first_wait_s
        self._engines: dict[str, _EngineHealth] = {}

    def started(self, name: str, now: float | None = None) -> None:
        """An engine was (re)started: its count is cleared and its first-wait begins."""
        self._engines[name] = _EngineHealth(time.monotonic() if now is None else now)

    def forget(self, name: str) -> None:
        self._engines.pop(name, None)

    def failures(self, name: str) -> int:
        return self._engines[name].failures

    def in_first_wait(self, name: str, now: float | None = None) -> bool:
        health = self._engines[name]
        now = time.monotonic() if now is None else now
        if health.in_grace and now - health.started_at >= self.first_wait_s:
            health.in_grace = False
        return health.in_grace

    def record(self, results: Mapping[str, ProbeResult], now: float | None = None) -> list[str]:
        """Count one cycle's results; return the engines whose failures reached the threshold."""
        now = time.monotonic() if now is None else now
        failed = []
        for name, result in results.items():
            health = self._engines.get(name)
            if health is None:
                continue  # forgotten while its probe was in flight
            if result.ok:
                health.in_grace = False
                health.failures = 0
            elif not self.in_first_wait(name, now):
                health.failures += 1
                if health.failures >= self.failure_threshold:
                    failed.append(name)
        return failed


    def next_cycle(self, began: float, ended: float, interval_s: float, timeout_s: float) -> float:
        """When the next probe cycle starts, given this one's start and end: `interval_s` after its
        end; but while an engine is suspect (it failed a probe, short of the threshold) one probe
        timeout after its start, so a hung engine's verdict takes threshold x timeout, not
        threshold x (timeout + interval), and failures that come back at once stay that far apart."""
        suspect = any(0 < h.failures < self.failure_threshold for h in self._engines.values())
        return began + timeout_s if suspect else ended + interval_s


class KillBudget:
    """The blast-radius rule: failed probes kill at most max(1, floor(fraction x engines)) engines
    in any window of `interval_s`. Engines whose process already died are always replaced and
    never spend the budget: killing them cannot make things worse."""

    def __init__(self, max_fraction: float, interval_s: float) -> None:
        if not 0 < max_fraction <= 1:
            raise ValueError(f"max kill fraction must be in (0, 1], got {max_fraction}")
        self.max_fraction = max_fraction
        self.interval_s = interval_s
        self._kills: deque[float] = deque()

    def cap(self, total_engines: int) -> int:
        return max(1, math.floor(self.max_fraction * total_engines))

    def allow(self, failed: Sequence[str], dead: Collection[str], total_engines: int,
              now: float | None = None) -> list[str]:
        """Of the engines that failed past the threshold (most urgent first), those that may be
        killed now; the rest wait for a later interval. Dead engines are left out: the caller
        replaces them regardless."""
        now = time.monotonic() if now is None else now
        while self._kills and now - self._kills[0] >= self.interval_s:
            self._kills.popleft()
        room = self.cap(total_engines) - len(self._kills)
        allowed = [name for name in failed if name not in dead][:max(0, room)]
        self._kills.extend(now for _ in allowed)
        return allowed
