"""A request, from another thread, that a rollout round end now, keeping what it generated: the
trainer generating rollout N+1 ahead of training (trainer.ahead_source) gets a save-now signal.
The round aborts what is still generating on the engines and, with --partial-rollout, hands every
group it took back to the data buffer with the tokens it has (finished ones too), then raises
RoundStopped; without --partial-rollout the caller puts the buffer back as it was before the round.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class RoundStopped(Exception):
    """The round ended on a RoundStop request; its groups are back in the buffer (--partial-rollout)."""


class RoundStop:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requested = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def request(self) -> None:
        """Thread-safe: wakes every `wait()` in whatever event loop it runs."""
        with self._lock:
            self._requested = True
            waiters = list(self._waiters)
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # that loop has closed: its round is over
                loop.call_soon_threadsafe(event.set)

    @property
    def requested(self) -> bool:
        return self._requested

    async def wait(self) -> None:
        event = asyncio.Event()
        waiter = (asyncio.get_running_loop(), event)
        with self._lock:
            if self._requested:
                return
            self._waiters.append(waiter)
        try:
            await event.wait()
        finally:
            with self._lock:
                self._waiters.remove(waiter)
