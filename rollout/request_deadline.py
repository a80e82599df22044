"""How long one /generate may take before it counts as lost (the seed's long-tail samples): from
its max_new_tokens and the decode speed seen on requests that completed, in this round or recent
ones. Past it the request is aborted and sent again, and the engine that held it is checked.

A deadline that is too short costs little: the abort makes a healthy engine answer with the
tokens it has, and the sample continues from them. One that is too long only delays the round.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque

DEADLINE_SLACK = 4.0  # times the typical time per token that a request may take
DEADLINE_FLOOR_S = 30.0  # at least this long (queueing behind a batch, prefill, a weight-update pause)
UNOBSERVED_DEADLINE_S = 300.0  # before any request completed: nothing to derive a deadline from
RECENT_REQUESTS = 256  # completed requests whose speed is remembered
ABORT_GRACE_S = 5.0  # after /abort_request, for a live engine to answer with what it generated
DEADLINE_RECHECK_S = 1.0  # between two looks at a waiting request's deadline (it moves as speed is seen)


class DecodeSpeed:
    """Tokens per second of completed requests (each: its output tokens over its wall time, queueing
    included), shared by the rounds of one trainer; thread-safe (evaluation runs beside rollouts)."""

    def __init__(self, slack: float = DEADLINE_SLACK, floor_s: float = DEADLINE_FLOOR_S,
                 unobserved_s: float = UNOBSERVED_DEADLINE_S) -> None:
        self.slack, self.floor_s, self.unobserved_s = slack, floor_s, unobserved_s
        self._seen: deque[float] = deque(maxlen=RECENT_REQUESTS)
        self._lock = threading.Lock()

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            with self._lock:
                self._seen.append(tokens / seconds)

    def tokens_per_s(self) -> float | None:
        """The median speed of recent requests; None before any completed."""
        with self._lock:
            return statistics.median(self._seen) if self._seen else None

    def deadline_s(self, max_new_tokens: int) -> float:
        speed = self.tokens_per_s()
        if speed is None:
            return self.unobserved_s
        return max(self.floor_s, self.slack * max_new_tokens / speed)
