"""The round's requests to the engines: one /generate through the router, sent again until an
engine answers, and the aborts that stop requests on the engines.

A request whose engine fails is sent again (the router's 500 names the engine, which is reported
once to a failure handler that takes it out of the router), so a round finishes while any engine
lives. A request past its deadline (request_deadline.py) is aborted and sent again, and an answer
that does not parse is sent again; either way the engines are checked (engine_check.py) and one
that does not answer is reported as unresponsive, though its health probe may pass.

One aiohttp session carries all of it (generate requests to the router; aborts and checks straight
to the engines, which take the same Authorization header), opened for one round by `async with`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import aiohttp

from rollout import trace
from rollout.engine_check import BadAnswer, parse_answer, unanswering
from rollout.engine_client import version_from_wire
from rollout.errors import RolloutError
from rollout.request_deadline import ABORT_GRACE_S, DEADLINE_RECHECK_S, DecodeSpeed
from rollout.router_client import RouterClient, RouterError
from rollout.sample import Sample

log = logging.getLogger(__name__)

# the engine a router error names: "URL: http://h:p" (regular), "for url (http://h:p/generate)" (PD mode)
_UPSTREAM = re.compile(r"(?:URL: |for url \()(https?://[^/\s)]+)")
_ROUTER_AWAY = "the router did not answer"
_FIRST_BACKOFF_S, _MAX_BACKOFF_S = 0.2, 5.0  # between two sends of a request no engine answered (doubles)


RETRIED_METRIC = "rollout/requests_retried"  # a rollout's requests sent again (metrics.jsonl, TensorBoard)


@dataclass
class RequestCounts:
    """Kept across rounds (RolloutArgs.request_counts): generate requests sent again after an attempt
    that failed (a router error such as a 502 for an engine that died, no answer within the
    deadline, an answer that does not parse). The trainer reports each rollout's share."""

    retried: int = 0


def engine_named_in(router_error: str) -> str | None:
    """The url of the engine a router's error text names, if it names one."""
    match = _UPSTREAM.search(router_error)
    return match.group(1) if match else None


class RequestTransport:
    """Sends one round's generate requests (at most `concurrency` at once; a custom generate's count
    too, through `gate`) and aborts them. Use as `async with`."""

    def __init__(self, router_url: str, api_key: str | None, *, router_timeout_s: float, concurrency: int,
                 retry_timeout_s: float, check_timeout_s: float, decode_speed: DecodeSpeed,
                 counts: RequestCounts | None = None, on_failure: Callable[[str], None] | None = None,
                 on_unresponsive: Callable[[str, str], None] | None = None) -> None:
        """on_failure(url): an engine the router could not reach; on_unresponsive(url, why): one that
        holds requests past their deadline or answers what does not parse. Default for both: remove
        it from the router. counts: where retries are counted (default: a count of its own)."""
        self.router_url, self.retry_timeout_s, self.check_timeout_s = router_url, retry_timeout_s, check_timeout_s
        self.counts = counts or RequestCounts()
        self.decode_speed, self.on_failure, self.on_unresponsive = decode_speed, on_failure, on_unresponsive
        self.router = RouterClient(router_url, api_key, router_timeout_s)
        self.gate = asyncio.Semaphore(concurrency)
        self.stopped = False  # the round has enough groups: nothing new is sent
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http: aiohttp.ClientSession | None = None
        self._reported: set[str] = set()  # engines reported this round, each once
        self._checking: asyncio.Task[None] | None = None  # one engine check at a time, shared by the requests that wait

    async def __aenter__(self) -> Self:
        # No total timeout: a request's bound is its deadline (request_deadline.py), enforced here.
        self._http = aiohttp.ClientSession(headers=self._headers, timeout=aiohttp.ClientTimeout(total=None))
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._http is not None:
            await self._http.close()

    @property
    def http(self) -> aiohttp.ClientSession:
        if self._http is None:
            raise RuntimeError("RequestTransport used outside `async with`")
        return self._http

    def stop(self) -> None:
        """Send nothing more: a request still waiting for its turn returns None."""
        self.stopped = True

    async def abort_all(self) -> None:
        """Abort whatever the engines are generating (the router does not forward aborts: each
        engine gets one)."""
        try:
            urls = await asyncio.to_thread(lambda: list(self.router.workers()))
        except RouterError:
            return  # the router is away: the requests it held are gone with it
        for url in urls:
            try:
                async with self.http.post(url + "/abort_request", json={"abort_all": True}):
                    pass
            except aiohttp.ClientError:
                pass  # an engine that cannot be reached has nothing running for us either

    async def generate(self, sample: Sample, rid: str, params: dict[str, Any]) -> dict[str, Any] | None:
        """The engine's answer to `sample`'s next /generate; None if the round stopped while this
        request waited its turn. RolloutError when the router refuses it, or no engine answers
        within retry_timeout_s."""
        deadline, backoff, attempt = time.monotonic() + self.retry_timeout_s, _FIRST_BACKOFF_S, 0
        while True:
            queued = time.time()
            async with self.gate:
                trace.add(sample, "queued", queued, time.time())
                if self.stopped:
                    return None  # enough groups: nothing new starts once engines were told to abort
                attempt += 1
                payload = {"rid": rid if attempt == 1 else f"{rid}-a{attempt}", "input_ids": sample.tokens,
                           "sampling_params": params, "return_logprob": True}
                spans, started, began = trace.generate_attempts(sample), time.monotonic(), time.time()
                status, text = await self._within_deadline(payload, params["max_new_tokens"])
            span = trace.add(sample, "generate", began, time.time(), attempt=spans, rid=payload["rid"])
            if status == 200:
                try:
                    body = parse_answer(text)
                except BadAnswer as err:
                    status, text = None, f"an answer that does not parse: {err}"
                else:
                    self.decode_speed.observe(len(body["output_ids"]), time.monotonic() - started)
                    meta = body.get("meta_info") or {}
                    span.update(weight_version=version_from_wire(meta.get("weight_version")),
                                outcome=(meta.get("finish_reason") or {}).get("type"))
                    return body
            engine = engine_named_in(text)
            # The engine is known only when the router's error names it: its answers do not.
            span.update(engine=engine, outcome=f"HTTP {status}" if status else "no answer", error=text[:200])
            if status is not None and status < 500 and status != 429:
                raise RolloutError(f"router refused sample {sample.index}: {status} {text[:300]}")
            if engine and engine not in self._reported:
                self._reported.add(engine)
                await asyncio.to_thread(self._report_failure, engine)
            lost = status is None and not text.startswith(_ROUTER_AWAY)  # past its deadline, or unparseable
            if lost:  # the router does not say which engine it was: ask each
                log.warning("sample %d: %s (attempt %d); checking the engines and sending it again",
                            sample.index, text[:300], attempt)
                await self._check_engines(text)
            if time.monotonic() > deadline:
                raise RolloutError(f"sample {sample.index}: no engine answered for {self.retry_timeout_s:.0f} s "
                                   f"(last: {status} {text[:200]})")
            self.counts.retried += 1
            if lost:
                continue  # at once: the check took its time, and the engine at fault is out
            with trace.span(sample, "retry_wait", attempt=spans):
                await asyncio.sleep(backoff * (1 + random.random()))  # backoff, jittered so retries spread out
            backoff = min(backoff * 2, _MAX_BACKOFF_S)

    async def _within_deadline(self, payload: dict[str, Any], max_new_tokens: int) -> tuple[int | None, str]:
        """(status, text) of the router's answer; (None, why) when it is away or past the deadline,
        which is computed again as speeds are seen. Past it, the engines are told to abort the
        request: a live one answers with the tokens it has (the sample continues from them)."""
        started = time.monotonic()
        request = asyncio.create_task(self._send(payload))
        limit = self.decode_speed.deadline_s(max_new_tokens)
        while not request.done() and (left := started + limit - time.monotonic()) > 0:
            await asyncio.wait({request}, timeout=min(left, DEADLINE_RECHECK_S))
            limit = self.decode_speed.deadline_s(max_new_tokens)
        if not request.done():
            await self._abort_everywhere(payload["rid"])
            await asyncio.wait({request}, timeout=ABORT_GRACE_S)
        if request.done():
            return request.result()
        request.cancel()
        return None, (f"no answer within its deadline of {limit:.0f} s "
                      f"({max_new_tokens} tokens at most), nor {ABORT_GRACE_S:g} s after an abort")

    async def _send(self, payload: dict[str, Any]) -> tuple[int | None, str]:
        try:
            async with self.http.post(self.router_url + "/generate", json=payload) as response:
                return response.status, await response.text()
        except (aiohttp.ClientError, TimeoutError) as err:
            return None, f"{_ROUTER_AWAY}: {err}"  # it will be relaunched

    async def _abort_everywhere(self, rid: str) -> None:
        """SGLang's /abort_request for one rid, to every engine (the router does not forward it)."""
        async def abort(url: str) -> None:
            try:
                async with asyncio.timeout(ABORT_GRACE_S):
                    async with self.http.post(url + "/abort_request", json={"rid": rid}):
                        pass
            except (aiohttp.ClientError, TimeoutError):
                pass  # a wedged or dead engine: the check names it
        try:
            urls = await asyncio.to_thread(lambda: list(self.router.workers()))
        except RouterError:
            return  # the router is away: so is the request it held
        await asyncio.gather(*(abort(url) for url in urls))

    async def _check_engines(self, why: str) -> None:
        """Check every engine the router lists (one check at a time; a request that fails meanwhile
        waits for the running one) and report each that does not answer, once a round."""
        if self._checking is None or self._checking.done():
            self._checking = asyncio.create_task(self._check_once(why))
        await asyncio.shield(self._checking)

    async def _check_once(self, why: str) -> None:
        try:
            urls = await asyncio.to_thread(lambda: [u for u in self.router.workers() if u not in self._reported])
        except RouterError as err:
            log.warning("could not list the engines to check them: %s", err)
            return
        for url, failure in (await unanswering(self.http, urls, self.check_timeout_s)).items():
            self._reported.add(url)
            reason = f"{why}; then {failure}"
            log.warning("engine %s does not answer: %s", url, reason)
            try:
                await asyncio.to_thread(self._report_unresponsive, url, reason)
            except RouterError as err:  # the router is away (relaunched with the ready engines only)
                log.warning("could not take %s out of the router: %s", url, err)

    def _report_unresponsive(self, url: str, reason: str) -> None:
        if self.on_unresponsive:
            self.on_unresponsive(url, reason)
        else:
            self.router.remove_worker(url)

    def _report_failure(self, url: str) -> None:
        if self.on_failure:
            self.on_failure(url)
        else:
            self.router.remove_worker(url)
