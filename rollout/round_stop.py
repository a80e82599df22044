"""A request that a rollout round end now, keeping what it generated: from another thread
(RoundStop: the trainer generating rollout N+1 ahead of training, trainer.ahead_source, gets a
save-now signal), or a flag a signal handler sets (PolledStop: the trainer's own round, on its
main thread). The round aborts what is still generating on the engines and, with --partial-rollout,
hands every group it took back to the data buffer with the tokens it has (finished ones too), then
raises RoundStopped; without --partial-rollout the caller puts the buffer back as it was before the round.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Protocol

# How often a round looks at a PolledStop's flag. Its wait also wakes the main thread this often: a
# signal the kernel hands to another of the process's threads (CUDA's and NCCL's) interrupts no
# wait of the main one, and its Python handler runs only when the main thread next runs.
STOP_POLL_S = 0.2


class Stop(Protocol):
    @property
    def requested(self) -> bool: ...

    async def wait(self) -> None:
        """Return once the stop is requested (in the round's event loop)."""


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


class PolledStop:
    """A stop requested by a flag that is set where no lock may be taken and nothing may be raised: a
    signal handler runs between two bytecodes of the main thread, maybe inside the round's event loop
    (an exception raised there can end in a callback's error log instead of the round)."""

    def __init__(self, requested: Callable[[], bool], poll_s: float = STOP_POLL_S) -> None:
        self._requested, self.poll_s = requested, poll_s

    @property
    def requested(self) -> bool:
        return self._requested()

    async def wait(self) -> None:
        # a poll, not an Event: the poll is what wakes the main thread
        while not self._requested():  # noqa: ASYNC110
            await asyncio.sleep(self.poll_s)
