"""One engine's weight-update bucket requests (POST /update_weights_from_distributed), posted in order
on each lane (an update group of its own) from a thread per lane, while the trainer goes on
broadcasting (trainer/bucket_broadcast.py)."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from rollout.engine_client import EngineError
from trainer.engine_fanout import EngineFanOut

_END = None  # put on a lane's queue: no more requests


class BucketFeed:
    """One engine's bucket requests. On a lane each is posted once the engine answered the lane's one
    before: two requests of one group at once could meet its broadcasts out of order. With two lanes
    the engine holds the next bucket's request when it answers one, so no round trip idles it between
    buckets; it takes one request at a time (as SGLang does), in either order, each bucket's bytes
    coming on its own lane's group. The trainer does not wait for the answers; after the first
    failure nothing more is posted. The threads are daemons, as EngineFanOut's: a request left
    unanswered (its engine blocked on a broadcast given up) never holds up the trainer's exit."""

    def __init__(self, engines: EngineFanOut, url: str, lanes: int = 1) -> None:
        self._engines = engines
        self.url = url
        self.failure: str | None = None
        self._open = 0  # requests posted and not answered yet
        self._answered = threading.Condition()
        self._lanes: list[queue.SimpleQueue[dict[str, Any] | None]] = [queue.SimpleQueue() for _ in range(lanes)]
        self._threads = [threading.Thread(target=self._run, args=(bodies,), name=f"bucket feed {url} lane {lane}",
                                          daemon=True) for lane, bodies in enumerate(self._lanes)]
        for thread in self._threads:
            thread.start()

    def post(self, body: dict[str, Any], lane: int = 0) -> None:
        with self._answered:
            self._open += 1
        self._lanes[lane].put(body)

    def _run(self, bodies: queue.SimpleQueue[dict[str, Any] | None]) -> None:
        while (body := bodies.get()) is not _END:
            if self.failure is None:
                try:
                    self._engines.call(self.url, "/update_weights_from_distributed", body)
                except EngineError as err:
                    self.failure = self.failure or str(err)
            with self._answered:
                self._open -= 1
                self._answered.notify_all()

    def wait_answered(self) -> None:
        """Until every request posted so far was answered (each bounded by the engine timeout)."""
        with self._answered:
            self._answered.wait_for(lambda: self._open == 0)

    def stop(self, reason: str) -> None:
        """Post nothing more (the requests on their way still get their answers)."""
        self.failure = self.failure or reason

    def finish(self, wait_s: float | None = None) -> str | None:
        """Wait for the requests posted (each bounded by the engine timeout; all of them by wait_s if given:
        past it, those still out are given up); the first failure, or None."""
        for bodies in self._lanes:
            bodies.put(_END)
        deadline = None if wait_s is None else time.monotonic() + wait_s
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in self._threads):
            self.failure = self.failure or f"no answer to its bucket within {wait_s:g} s of the broadcast's end"
        return self.failure
