"""One engine's weight-update bucket requests (POST /update_weights_from_distributed), posted in order
from a thread of their own while the trainer goes on broadcasting (trainer/publish.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rollout.engine_client import EngineError
from trainer.engine_fanout import EngineFanOut


class BucketFeed:
    """One engine's bucket requests, each posted once the engine answered the one before: an engine
    takes its buckets one request at a time (as SGLang does), and two requests at once could meet
    the broadcasts out of order. The trainer does not wait for the answers; after the first
    failure nothing more is posted."""

    def __init__(self, engines: EngineFanOut, url: str) -> None:
        self._engines = engines
        self.url = url
        self.failure: str | None = None
        self._pool = ThreadPoolExecutor(max_workers=1)

    def post(self, body: dict[str, Any]) -> None:
        self._pool.submit(self._call, body)

    def _call(self, body: dict[str, Any]) -> None:
        if self.failure is None:
            try:
                self._engines.call(self.url, "/update_weights_from_distributed", body)
            except EngineError as err:
                self.failure = str(err)

    def stop(self, reason: str) -> None:
        """Post nothing more (the request on its way still gets its answer)."""
        self.failure = self.failure or reason

    def finish(self) -> str | None:
        """Wait for the requests posted (each bounded by the engine timeout); the first failure, or None."""
        self._pool.shutdown(wait=True)
        return self.failure
