"""Prefill/decode disaggregation on the CPU engine (SGLang's --disaggregation-mode), the way
sglang-router's PD mode drives it (rollout/router_client.py has what was measured on the router).

The router sends each request to one prefill and one decode engine at once, both with the same
`bootstrap_host`/`bootstrap_port`/`bootstrap_room`. Here, as in SGLang, the two depend on each other:
- the prefill engine runs the prompt and samples the first token; it keeps that token (its
  logprob and the weight version it came from) under the room, on its bootstrap server
  (`--disaggregation-bootstrap-port`), and answers the router with that one-token result;
- the decode engine fetches the room from bootstrap_host:bootstrap_port (waiting at most
  BOOTSTRAP_WAIT_S), then decodes the rest after that first token; its answer is the request's.
  SGLang moves the prompt's KV cache; the CPU engine moves the first token and the sampler's
  state, and recomputes the KV (as it does when an aborted request is continued), so a request
  decodes exactly as on one regular engine.
A decode engine whose prefill engine is gone, answered an abort, or was at another weight version
fails the request (5xx, or finish_reason abort): the rollout side retries or continues it whole.
"""

from __future__ import annotations

import base64
import hmac
import json
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import aiohttp
import torch

from rollout.cpu_engine.sequence import Sequence

PREFILL, DECODE = "prefill", "decode"
BOOTSTRAP_WAIT_S = 120.0  # a decode request waits this long at most for its prefill engine's room
LONG_POLL_S = 5.0  # one GET of a room waits this long at most on the bootstrap server
ROOM_TTL_S = 600.0  # a room no decode engine fetched is dropped after this
_CONNECT_S = 5.0  # to open a connection to a bootstrap server


class DisaggError(Exception):
    """A decode request that cannot go on (answered 500: the caller retries it whole)."""


class Rooms:
    """The prefill side's rooms: bootstrap_room -> what its decode engine needs. Each room is
    taken once; handler threads and the event loop share it under one condition."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._rooms: dict[int, tuple[float, dict[str, Any]]] = {}

    def put(self, room: int, payload: dict[str, Any]) -> None:
        now = time.monotonic()
        with self._cond:
            self._rooms = {r: v for r, v in self._rooms.items() if now - v[0] < ROOM_TTL_S}
            self._rooms[room] = (now, payload)
            self._cond.notify_all()

    def take(self, room: int, wait_s: float) -> dict[str, Any] | None:
        with self._cond:
            if not self._cond.wait_for(lambda: room in self._rooms, timeout=wait_s):
                return None
            return self._rooms.pop(room)[1]


class BootstrapServer(ThreadingHTTPServer):
    """`GET /room/ROOM?wait=S`: 200 with the room's JSON once it is there, 404 after S seconds."""

    daemon_threads = True

    def __init__(self, host: str, port: int, rooms: Rooms, api_key: str | None) -> None:
        self.rooms = rooms
        self.expected = f"Bearer {api_key}" if api_key else None
        super().__init__((host, port), _RoomHandler)

    def start(self) -> None:
        threading.Thread(target=self.serve_forever, name="cpu-engine-bootstrap", daemon=True).start()


class _RoomHandler(BaseHTTPRequestHandler):
    server: BootstrapServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        expected = self.server.expected
        if expected and not hmac.compare_digest(self.headers.get("Authorization", ""), expected):
            return self._answer(401, {"error": "Unauthorized"})
        url = urlsplit(self.path)
        parts = url.path.strip("/").split("/")
        if len(parts) != 2 or parts[0] != "room" or not parts[1].lstrip("-").isdigit():
            return self._answer(404, {"error": "no such route"})
        wait = min(float(parse_qs(url.query).get("wait", ["0"])[0]), LONG_POLL_S)
        payload = self.server.rooms.take(int(parts[1]), wait)
        self._answer(404, {"error": "not ready"}) if payload is None else self._answer(200, payload)

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: Any) -> None:
        pass  # one line per long poll would drown the engine's log


def bootstraps(body: dict[str, Any], count: int) -> list[tuple[str, int, int]]:
    """(host, port, room) of each prompt of a PD request (lists for a batch, as the router sends)."""
    values = [body.get(key) for key in ("bootstrap_host", "bootstrap_port", "bootstrap_room")]
    if any(v is None for v in values):
        raise ValueError("a disaggregated engine needs bootstrap_host, bootstrap_port and bootstrap_room "
                         "(send requests through the router in PD mode)")
    columns = [v if isinstance(v, list) else [v] * count for v in values]
    if any(len(c) != count for c in columns):
        raise ValueError(f"bootstrap_host/port/room must each give one value per prompt ({count})")
    return [(str(h), int(p), int(r)) for h, p, r in zip(*columns)]


def prefill_only(seqs: list[Sequence]) -> None:
    """A prefill engine samples only the first token of each sequence."""
    for seq in seqs:
        seq.params = replace(seq.params, max_new_tokens=min(1, seq.params.max_new_tokens))


def room_payload(seq: Sequence) -> dict[str, Any]:
    """What the decode engine needs from a finished prefill sequence."""
    finish = seq.finish_reason
    if finish is None:
        raise DisaggError(f"prefill sequence {seq.rid} has not finished")
    aborted = finish["type"] == "abort" or not seq.output_ids
    return {"weight_version": seq.weight_version, "aborted": aborted,
            "message": finish.get("message", ""),
            "token": None if aborted else seq.output_ids[0],
            "logprob": seq.output_logprobs[0] if seq.output_logprobs else None,
            # the sampler's state after the first draw: decode samples on as one engine would have
            "generator": base64.b64encode(seq.generator.get_state().numpy().tobytes()).decode()}


async def fetch_room(http: aiohttp.ClientSession, host: str, port: int, room: int) -> dict[str, Any]:
    """The room from the prefill engine's bootstrap server; DisaggError if it is gone or too slow."""
    deadline = time.monotonic() + BOOTSTRAP_WAIT_S
    url = f"http://{host}:{port}/room/{room}?wait={LONG_POLL_S}"
    while time.monotonic() < deadline:
        try:
            async with http.get(url) as response:
                if response.status == 200:
                    return await response.json()
                if response.status != 404:
                    raise DisaggError(f"bootstrap server {host}:{port} answered {response.status} for room {room}")
        except (TimeoutError, aiohttp.ClientError) as err:
            raise DisaggError(f"the prefill engine's bootstrap server {host}:{port} is gone (room {room}): "
                              f"{err}") from None
    raise DisaggError(f"room {room} did not come from the prefill engine at {host}:{port} within "
                      f"{BOOTSTRAP_WAIT_S:.0f} s")


def continue_from(seq: Sequence, payload: dict[str, Any], weight_version: str) -> None:
    """Start a decode sequence after its prefill engine's first token (an abort there ends it)."""
    if payload["aborted"]:
        raise DisaggError(f"the prefill engine aborted room: {payload['message']}")
    if payload["weight_version"] != weight_version:
        raise DisaggError(f"the prefill engine ran the prompt at weight version {payload['weight_version']}, "
                          f"this decode engine is at {weight_version}")
    seq.generator.set_state(torch.frombuffer(bytearray(base64.b64decode(payload["generator"])), dtype=torch.uint8))
    seq.output_ids.append(payload["token"])
    if seq.return_logprob:
        seq.output_logprobs.append(payload["logprob"])


def client_session(api_key: str | None) -> aiohttp.ClientSession:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=LONG_POLL_S + _CONNECT_S, connect=_CONNECT_S)
    return aiohttp.ClientSession(headers=headers, timeout=timeout)
