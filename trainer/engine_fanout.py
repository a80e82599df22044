"""The engine client fanned out over several engines: one thread per engine, so the calls run at
once, each bounded by the client's timeout. A failed call (EngineError) is the reason its engine is
dropped by the caller.

Given `serving` (supervised: the engines the supervisor lists now), a call still unanswered is no
longer waited for once its engine leaves that list: an engine cut off from the network holds its
call for the whole timeout (--update-weight-timeout, 10 minutes by default), and the training with
it, though the supervisor has taken it out within seconds and is replacing it. Its thread is a
daemon's, so a call left behind never holds up the trainer's exit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from contract.control_protocol import CallerFenced
from rollout.engine_client import EngineClient, EngineError

log = logging.getLogger(__name__)

SERVING_POLL_S = 2.0  # between two looks at the supervisor's engines while calls are unanswered
TAKEN_OUT = "taken out by the supervisor while the trainer waited for it"


class EngineFanOut(EngineClient):
    """EngineClient's calls, to several engines at once."""

    def __init__(self, api_key: str | None, timeout_s: float,
                 serving: Callable[[], list[str]] | None = None) -> None:
        super().__init__(api_key, timeout_s)
        self.serving = serving

    def start(self, urls: list[str], fn: Callable[[str], Any]) -> dict[str, Future]:
        futures: dict[str, Future] = {url: Future() for url in urls}
        for url, future in futures.items():
            threading.Thread(target=_run, args=(fn, url, future), name=f"engine call {url}", daemon=True).start()
        return futures

    def settle(self, futures: dict[str, Future]) -> tuple[dict[str, Any], dict[str, str]]:
        """(url -> answer for the successes, url -> reason for the failures)."""
        done, failed = {}, {}
        pending = dict(futures)
        while pending:
            wait(pending.values(), timeout=SERVING_POLL_S if self.serving else None, return_when=FIRST_COMPLETED)
            for url, future in list(pending.items()):
                if future.done():
                    del pending[url]
                    try:
                        done[url] = future.result()
                    except EngineError as err:
                        failed[url] = str(err)
            for url in self._taken_out(list(pending)):
                del pending[url]
                failed[url] = TAKEN_OUT
        return done, failed

    def _taken_out(self, urls: list[str]) -> list[str]:
        if not urls or self.serving is None:
            return []
        try:
            listed = set(self.serving())
        except CallerFenced:  # a newer run of the job owns it: this trainer stops, it does not wait on
            raise
        except Exception as err:  # noqa: BLE001 (the supervisor's answer is a hint: its absence waits on)
            log.warning("cannot ask the supervisor which engines serve: %s", err)
            return []
        return [url for url in urls if url not in listed]

    def each(self, urls: list[str], fn: Callable[[str], Any]) -> tuple[dict[str, Any], dict[str, str]]:
        return self.settle(self.start(urls, fn))

    def start_call(self, urls: list[str], route: str, body: dict[str, Any] | None = None) -> dict[str, Future]:
        return self.start(urls, lambda url: self.call(url, route, body))

    def on_all(self, urls: list[str], route: str, body: dict[str, Any] | None = None
               ) -> tuple[dict[str, Any], dict[str, str]]:
        return self.settle(self.start_call(urls, route, body))


def _run(fn: Callable[[str], Any], url: str, future: Future) -> None:
    try:
        future.set_result(fn(url))
    except BaseException as err:  # noqa: BLE001 (handed to whoever waits on the future)
        future.set_exception(err)
