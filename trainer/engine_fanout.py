"""The engine client fanned out over several engines: one thread per engine, so the calls run at
once, each bounded by the client's timeout. A failed call (EngineError) is the reason its engine is
dropped by the caller."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from rollout.engine_client import EngineClient, EngineError


class EngineFanOut(EngineClient):
    """EngineClient's calls, to several engines at once."""

    def start(self, urls: list[str], fn: Callable[[str], Any]) -> dict[str, Future]:
        pool = ThreadPoolExecutor(max_workers=max(len(urls), 1))
        futures = {url: pool.submit(fn, url) for url in urls}
        pool.shutdown(wait=False)  # each thread ends with its call, which the timeout bounds
        return futures

    @staticmethod
    def settle(futures: dict[str, Future]) -> tuple[dict[str, Any], dict[str, str]]:
        """(url -> answer for the successes, url -> reason for the failures)."""
        done, failed = {}, {}
        for url, future in futures.items():
            try:
                done[url] = future.result()
            except EngineError as err:
                failed[url] = str(err)
        return done, failed

    def each(self, urls: list[str], fn: Callable[[str], Any]) -> tuple[dict[str, Any], dict[str, str]]:
        return self.settle(self.start(urls, fn))

    def start_call(self, urls: list[str], route: str, body: dict[str, Any] | None = None) -> dict[str, Future]:
        return self.start(urls, lambda url: self.call(url, route, body))

    def on_all(self, urls: list[str], route: str, body: dict[str, Any] | None = None
               ) -> tuple[dict[str, Any], dict[str, str]]:
        return self.settle(self.start_call(urls, route, body))
