"""The one client for SGLang engines' HTTP routes (reference/sglang-http.md), shared by the
supervisor and the trainer: health probes (of one engine, or of every engine at once), the weight
version, updates from disk, and any other route by name. Weight versions are ints in slurmrl and
strings on SGLang's wire: version_to_wire and version_from_wire are the only conversions. The API
key only ever travels in the Authorization header: no error names it.

Probing every engine runs on one asyncio loop in a background thread, started by the first
probe_all and kept for the client's life, so a cycle lasts about one probe timeout however many
engines there are (slime probes one at a time: a cycle there costs the sum of every engine's
latency, and one failure kills).
"""

from __future__ import annotations

import asyncio
import resource
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import aiohttp
import requests

HEALTH_PATH = "/health_generate"
# SGLang's liveness route: 200 while the server is up, no generation (so an engine busy in a weight
# update answers it, and a dead one or one cut off from the network does not).
LIVENESS_PATH = "/ping"
# Sockets left for the rest of the process beyond one per engine probed at once.
FD_HEADROOM = 256
# Seconds close() waits for the probe session to close, and then for its loop thread to end.
CLOSE_WAIT_S = 10.0
# Route calls keep their connections open (a call on an open one costs about half): engines whose
# pools are kept, and open connections kept per engine (a fan-out makes one call an engine at a time).
KEPT_ENGINES = 64
KEPT_CONNECTIONS = 4


def version_to_wire(version: int) -> str:
    """slurmrl's weight version as SGLang's HTTP API carries it (a string)."""
    return str(version)


def version_from_wire(value: Any) -> int | None:
    """SGLang's weight_version as slurmrl's int; None for one slurmrl never published (SGLang's
    "default" for the initial checkpoint) or none at all."""
    text = str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    return int(text) if text.isdigit() else None


class EngineError(RuntimeError):
    """A call to an engine failed; the message names the url and the route, never the key."""


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    latency_s: float
    error: str | None = None  # "HTTP 503", "timeout after 5.0 s", "ClientConnectorError: ..."


def _raise_fd_limit(wanted: int) -> None:
    # One socket per engine in flight: 1,000 engines outgrow the common soft limit of 1,024.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        limit = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))


@dataclass(frozen=True)
class _ProbeLoop:
    """The probes' event loop, the thread running it, and their HTTP session (of that loop)."""

    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    session: aiohttp.ClientSession


class EngineClient:
    """Calls to engines by base url, from any thread; timeout_s (seconds) bounds every request
    (each of its socket waits, for the blocking calls) unless a call names its own."""

    def __init__(self, api_key: str | None, timeout_s: float) -> None:
        # requests quotes a header value it refuses in its error text: refuse such a key here, unquoted.
        if api_key is not None and (not api_key.isprintable() or any(c.isspace() for c in api_key)):
            raise ValueError("the API key holds whitespace or control characters")
        # SGLang exempts /health* from --api-key, but a CPU engine or a proxy in front may not.
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # guards starting and stopping the probe loop
        self._prober: _ProbeLoop | None = None  # started by the first probe
        # Shared by every thread (urllib3's pools are thread-safe). A pooled connection whose engine
        # died was closed by its kernel, and urllib3 checks for that before reusing one.
        self._http = requests.Session()
        # Engines are the job's own hosts: no proxy or .netrc from the environment applies to them, and
        # reading the environment for those cost every call a scan of it.
        self._http.trust_env = False
        self._http.mount("http://", requests.adapters.HTTPAdapter(KEPT_ENGINES, KEPT_CONNECTIONS))

    # ---- health ----

    def healthy(self, url: str) -> bool:
        """Whether the engine answers GET /health_generate with 200 within the timeout."""
        return self.probe_all({url: url})[url].ok

    def probe_all(self, targets: Mapping[str, str],
                  path: str | Mapping[str, str] = HEALTH_PATH) -> dict[str, ProbeResult]:
        """{engine name: base url} -> {engine name: result}, all probed at once (GET `path`, or each
        engine's own path where `path` maps names to paths); each probe is bounded by timeout_s, so this
        returns after about that long at most."""
        _raise_fd_limit(len(targets) + FD_HEADROOM)
        paths = {name: path for name in targets} if isinstance(path, str) else path
        prober = self._probe_loop()
        return asyncio.run_coroutine_threadsafe(self._probe_many(prober.session, targets, paths), prober.loop).result()

    def _probe_loop(self) -> _ProbeLoop:
        with self._lock:
            if self._prober is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="engine-probes", daemon=True)
                thread.start()
                session = asyncio.run_coroutine_threadsafe(self._open_session(), loop).result()
                self._prober = _ProbeLoop(loop, thread, session)
            return self._prober

    async def _open_session(self) -> aiohttp.ClientSession:
        # force_close: a fresh connection per probe, so a restarted engine never fails its first
        # probe on a keep-alive socket of its dead predecessor.
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        return aiohttp.ClientSession(connector=connector, headers=self._headers)

    async def _probe_many(self, session: aiohttp.ClientSession, targets: Mapping[str, str],
                          paths: Mapping[str, str]) -> dict[str, ProbeResult]:
        names = list(targets)
        results = await asyncio.gather(*(self._probe(session, targets[n], paths[n]) for n in names))
        return dict(zip(names, results))

    async def _probe(self, session: aiohttp.ClientSession, url: str, path: str) -> ProbeResult:
        start = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout_s):
                async with session.get(url.rstrip("/") + path) as resp:
                    await resp.read()
                    ok = resp.status == 200
                    return ProbeResult(ok, time.monotonic() - start, None if ok else f"HTTP {resp.status}")
        except TimeoutError:
            return ProbeResult(False, time.monotonic() - start, f"timeout after {self.timeout_s:g} s")
        except aiohttp.ClientError as err:
            return ProbeResult(False, time.monotonic() - start, f"{type(err).__name__}: {err}")

    # ---- routes ----

    def call(self, url: str, route: str, body: dict[str, Any] | None = None,
             timeout_s: float | None = None) -> dict[str, Any]:
        """GET the route (no body) or POST the body as JSON; the JSON answer. EngineError unless
        the engine answers 200 with a JSON object that does not say "success": false."""
        where = url.rstrip("/") + route
        try:
            response = self._http.request("GET" if body is None else "POST", where, json=body, headers=self._headers,
                                          timeout=self.timeout_s if timeout_s is None else timeout_s)
        except requests.RequestException as err:  # its text names the url, never the headers
            raise EngineError(f"{where} failed: {type(err).__name__}: {err}") from None
        try:
            answer = response.json()
        except ValueError:
            answer = None
        if response.status_code != 200 or not isinstance(answer, dict) or answer.get("success") is False:
            detail = answer.get("message", answer) if isinstance(answer, dict) else response.text[:300]
            raise EngineError(f"{where} answered {response.status_code}: {detail}")
        return answer

    def weight_version(self, url: str) -> int | None:
        """The weight version the engine reports serving (None: the initial checkpoint, or none)."""
        return version_from_wire(self.call(url, "/model_info").get("weight_version"))

    def load_from_disk(self, url: str, folder: Path, version: int, timeout_s: float) -> None:
        """Load the HF safetensors folder as `version`; timeout_s bounds the load."""
        answer = self.call(url, "/update_weights_from_disk",
                           {"model_path": str(folder), "weight_version": version_to_wire(version)}, timeout_s)
        if not answer.get("success"):
            raise EngineError(f"{url}/update_weights_from_disk of {folder} did not succeed: {answer}")

    def release_memory(self, url: str, tags: list[str], timeout_s: float | None = None) -> None:
        """POST /release_memory_occupation (SGLang answers 200 with no body; an error is 400)."""
        self._memory(url, "/release_memory_occupation", tags, timeout_s)

    def resume_memory(self, url: str, tags: list[str], timeout_s: float | None = None) -> None:
        self._memory(url, "/resume_memory_occupation", tags, timeout_s)

    def start_profile(self, url: str, body: dict[str, Any]) -> None:
        """POST /start_profile with SGLang's ProfileReqInput (it answers 200 with plain text)."""
        self._post_ok(url, "/start_profile", body, None)

    def _memory(self, url: str, route: str, tags: list[str], timeout_s: float | None) -> None:
        self._post_ok(url, route, {"tags": tags}, timeout_s, f" {tags}")

    def _post_ok(self, url: str, route: str, body: dict[str, Any], timeout_s: float | None, what: str = "") -> None:
        """POST body; EngineError unless the engine answers 200 (whatever the answer's body)."""
        where = url.rstrip("/") + route
        try:
            response = self._http.post(where, json=body, headers=self._headers,
                                       timeout=self.timeout_s if timeout_s is None else timeout_s)
        except requests.RequestException as err:
            raise EngineError(f"{where} failed: {type(err).__name__}: {err}") from None
        if response.status_code != 200:
            raise EngineError(f"{where}{what} answered {response.status_code}: {response.text[:300]}")

    # ---- life ----

    def close(self) -> None:
        """Close the kept connections, and stop the probe loop if a probe started it."""
        self._http.close()
        with self._lock:
            prober, self._prober = self._prober, None
            if prober is None:
                return
            loop = prober.loop
            asyncio.run_coroutine_threadsafe(prober.session.close(), loop).result(CLOSE_WAIT_S)
            loop.call_soon_threadsafe(loop.stop)
            prober.thread.join(CLOSE_WAIT_S)
            if not prober.thread.is_alive():  # a loop still running cannot be closed; the thread is a daemon
                loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
