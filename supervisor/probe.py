"""Engine health probing (invariant 5): all engines at once, a failure threshold, a first-wait
grace after each (re)start, and a cap on how many engines failed probes may kill per interval.

One asyncio loop in a background thread probes every engine concurrently on GET /health_generate,
so a cycle lasts about one probe timeout however many engines there are (slime probes one at a
time: a cycle there costs the sum of every engine's latency, and one failure kills).
"""

from __future__ import annotations

import asyncio
import math
import resource
import threading
import time
from collections import deque
from collections.abc import Collection, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeVar

import aiohttp

HEALTH_PATH = "/health_generate"
T = TypeVar("T")


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    latency_s: float
    error: str | None = None  # "HTTP 503", "timeout after 5.0 s", "ClientConnectorError: ..."


def _raise_fd_limit(wanted: int) -> None:
    # One socket per engine in flight: 1,000 engines outgrow the common soft limit of 1,024.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        limit = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))


class Prober:
    """Probes many URLs in parallel from its own event loop thread; `probe_all` blocks the caller."""

    def __init__(self, timeout_s: float, api_key: str | None = None, max_engines: int = 4096) -> None:
        self.timeout_s = timeout_s
        # SGLang exempts /health* from --api-key, but a CPU engine or a proxy in front may not.
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        _raise_fd_limit(max_engines + 256)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="prober", daemon=True)
        self._thread.start()
        self._session = self._run(self._open_session())

    async def _open_session(self) -> aiohttp.ClientSession:
        # force_close: a fresh connection per probe, so a restarted engine never fails its first
        # probe on a keep-alive socket of its dead predecessor.
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        return aiohttp.ClientSession(connector=connector, headers=self._headers)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _probe(self, url: str) -> ProbeResult:
        start = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._session.get(url.rstrip("/") + HEALTH_PATH) as resp:
                    await resp.read()
                    ok = resp.status == 200
                    return ProbeResult(ok, time.monotonic() - start, None if ok else f"HTTP {resp.status}")
        except TimeoutError:
            return ProbeResult(False, time.monotonic() - start, f"timeout after {self.timeout_s:g} s")
        except aiohttp.ClientError as err:
            return ProbeResult(False, time.monotonic() - start, f"{type(err).__name__}: {err}")

    async def _probe_many(self, targets: Mapping[str, str]) -> dict[str, ProbeResult]:
        names = list(targets)
        results = await asyncio.gather(*(self._probe(targets[n]) for n in names))
        return dict(zip(names, results))

    def probe_all(self, targets: Mapping[str, str]) -> dict[str, ProbeResult]:
        """{engine name: base url} -> {engine name: result}, all probed concurrently."""
        return self._run(self._probe_many(targets))

    def close(self) -> None:
        self._run(self._session.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
