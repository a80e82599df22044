"""How long the engines had nothing of the trainer's to generate: the engines' side of slime's
perf/wait_time_ratio (held for a weight update, nothing in flight, or waiting for the next rollout
to be asked for), kept by the sources that generate ahead of training."""

from __future__ import annotations

import threading
import time


class EngineIdle:
    """The engines' idle share of the wall time since the last `take` (thread-safe): `mark(True)`
    when they have nothing to generate, `mark(False)` when they have."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle_since: float | None = time.monotonic()
        self._idle = 0.0
        self._since = time.monotonic()

    def mark(self, idle: bool) -> None:
        with self._lock:
            now = time.monotonic()
            if idle and self._idle_since is None:
                self._idle_since = now
            elif not idle and self._idle_since is not None:
                self._idle += now - self._idle_since
                self._idle_since = None

    def take(self) -> float:
        """The idle share of the time since the last take; starts again."""
        with self._lock:
            now = time.monotonic()
            idle = self._idle + (now - self._idle_since if self._idle_since is not None else 0.0)
            wall = now - self._since
            self._idle, self._since = 0.0, now
            if self._idle_since is not None:
                self._idle_since = now
            return idle / wall if wall > 0 else 0.0
