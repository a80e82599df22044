"""--rm-type remote_rm: rewards from a reward server at --rm-url, by slime's contract: one POST
per sample with the JSON {"prompt", "response", "label"}; the JSON answer is the reward (a
number, or a dict that --reward-key picks from).

Requests share one session, at most --rm-concurrency in flight; each has --rm-timeout seconds.
A connection error, a timeout, a 5xx or a 429 is retried with jittered exponential backoff
(--rm-retry-backoff seconds first, doubling, at most 30 s: slime's schedule) up to
--rm-max-retries attempts in all; any other status fails at once.
"""

from __future__ import annotations

import asyncio
import json
import random
from types import TracebackType
from typing import Any

import aiohttp

from rollout.sample import Sample

_MAX_BACKOFF_S = 30.0  # slime's cap on one wait between attempts


class RemoteRewardError(RuntimeError):
    """The reward server refused a sample, or stayed unreachable; the message names --rm-url."""


class RemoteRewardModel:
    """Use as `async with RemoteRewardModel(...) as rm: await rm.reward(sample)`."""

    def __init__(self, url: str, *, concurrency: int = 64, timeout_s: float = 120.0, max_retries: int = 10,
                 backoff_s: float = 1.0) -> None:
        self.url, self.timeout_s, self.max_retries, self.backoff_s = url, timeout_s, max_retries, backoff_s
        self.concurrency = concurrency
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> RemoteRewardModel:
        self._gate = asyncio.Semaphore(self.concurrency)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self

    async def __aexit__(self, kind: type[BaseException] | None, err: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._session is not None:
            await self._session.close()

    async def reward(self, sample: Sample) -> Any:
        assert self._session is not None, "use RemoteRewardModel in `async with`"
        payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
        last = ""
        for attempt in range(self.max_retries):
            if attempt:
                wait = min(self.backoff_s * 2 ** (attempt - 1), _MAX_BACKOFF_S)
                await asyncio.sleep(wait + self.backoff_s * random.random())  # jittered, so retries spread out
            async with self._gate:
                try:
                    async with self._session.post(self.url, json=payload) as response:
                        status, text = response.status, await response.text()
                except (aiohttp.ClientError, TimeoutError) as err:
                    last = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
                    continue
            if status == 200:
                return _parse(self.url, sample, text)
            if status < 500 and status != 429:
                raise RemoteRewardError(f"--rm-url {self.url} refused sample {sample.index}: "
                                        f"HTTP {status} {text[:200]}")
            last = f"HTTP {status} {text[:200]}"
        raise RemoteRewardError(f"--rm-url {self.url}: the reward server failed all {self.max_retries} attempts for "
                                f"sample {sample.index} (last: {last}); check that it is up, or raise --rm-max-retries")


def _parse(url: str, sample: Sample, text: str) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise RemoteRewardError(f"--rm-url {url}: the answer for sample {sample.index} is not JSON: {text[:200]!r}; "
                                "a reward server answers a number or an object") from None
    if not isinstance(value, (int, float, dict)):
        raise RemoteRewardError(f"--rm-url {url}: the answer for sample {sample.index} is {value!r}; "
                                "a reward server answers a number or an object")
    return value
