"""One engine's weight-update bucket requests (POST /update_weights_from_distributed), posted in order
from a thread of their own while the trainer goes on broadcasting (trainer/publish.py)."""

from __future__ import annotations

import queue
import threading
from typing import Any

from rollout.engine_client import EngineError
from trainer.engine_fanout import EngineFanOut

_END = None  # put on the queue: no more requests


class BucketFeed:
    """One engine's bucket requests, each posted once the engine answered the one before: an engine
    takes its buckets one request at a time (as SGLang does), and two requests at once could meet
    the broadcasts out of order. The trainer does not wait for the answers; after the first
    failure nothing more is posted. The thread is a daemon's, as EngineFanOut's: a request left
    unanswered (its engine blocked on a broadcast given up) never holds up the trainer's exit."""

    def __init__(self, engines: EngineFanOut, url: str) -> None:
        self._engines = engines
        self.url = url
        self.failure: str | None = None
        self._bodies: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"bucket feed {url}", daemon=True)
        self._thread.start()

    def post(self, body: dict[str, Any]) -> None:
        self._bodies.put(body)

    def _run(self) -> None:
        while (body := self._bodies.get()) is not _END:
            if self.failure is None:
                try:
                    self._engines.call(self.url, "/update_weights_from_distributed", body)
                except EngineError as err:
                    self.failure = self.failure or str(err)

    def stop(self, reason: str) -> None:
        """Post nothing more (the request on its way still gets its answer)."""
        self.failure = self.failure or reason

    def finish(self, wait_s: float | None = None) -> str | None:
        """Wait for the requests posted (each bounded by the engine timeout; all of them by wait_s if given:
        past it, the one still out is given up); the first failure, or None."""
        self._bodies.put(_END)
        self._thread.join(wait_s)
        if self._thread.is_alive():
            self.failure = self.failure or f"no answer to its bucket within {wait_s:g} s of the broadcast's end"
        return self.failure
