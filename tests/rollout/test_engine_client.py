"""The engine client against real HTTP servers: parallel probing of many engines, and the route
calls (weight version, loads from disk, errors that name the url and route but never the key)."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rollout.engine_client import EngineClient, EngineError, version_from_wire, version_to_wire
from tests.rollout.fake_engines import fake_engines
from tests.rollout.servers import free_port

KEY = "secret-key"


def test_a_cycle_over_many_engines_takes_about_one_timeout_not_the_sum() -> None:
    timeout_s = 1.0
    with (fake_engines(ok=60, fail=10, hang=10, delay_ms=50, api_key=KEY) as ports,
          EngineClient(KEY, timeout_s) as client):
        targets = {f"{b}-{i}": f"http://127.0.0.1:{p}" for b, ps in ports.items() for i, p in enumerate(ps)}
        targets["refused-0"] = f"http://127.0.0.1:{free_port()}"
        client.probe_all(targets)  # warm the process up (imports, first connections)
        start = time.monotonic()
        results = client.probe_all(targets)
        elapsed = time.monotonic() - start
        assert client.healthy(targets["ok-0"]) and not client.healthy(targets["fail-0"])
        with EngineClient("wrong", timeout_s) as wrong_key:
            assert wrong_key.probe_all({"ok-0": targets["ok-0"]})["ok-0"].error == "HTTP 401"
    # One at a time this would be 10 hangs x 1 s + 70 x 50 ms = 13.5 s.
    assert elapsed < timeout_s + 1.0, f"cycle took {elapsed:.2f} s"
    assert {n for n, r in results.items() if r.ok} == {n for n in targets if n.startswith("ok-")}
    assert all(r.error == "HTTP 503" for n, r in results.items() if n.startswith("fail-"))
    assert all(r.error.startswith("timeout") and r.latency_s >= timeout_s
               for n, r in results.items() if n.startswith("hang-"))
    assert results["refused-0"].error.startswith("ClientConnectorError")
    assert all(0.05 <= r.latency_s < timeout_s for n, r in results.items() if n.startswith("ok-"))


class _Engine(BaseHTTPRequestHandler):
    """/model_info, and /update_weights_from_disk that fails for a model_path of /bad; the
    key is required everywhere. Each POST body is kept in the server's `bodies`."""

    def do_GET(self) -> None:
        self._answer({"weight_version": "3"} if self.path == "/model_info" else None)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)  # type: ignore[attr-defined]
        if self.path != "/update_weights_from_disk":
            self._answer(None)
        elif body["model_path"] == "/bad":
            self._answer({"success": False, "message": "no such folder"}, 400)
        else:
            self._answer({"success": True})

    def _answer(self, answer: dict | None, status: int = 200) -> None:
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            answer, status = {"error": "unauthorized"}, 401
        data = b"not found" if answer is None else json.dumps(answer).encode()
        self.send_response(404 if answer is None else status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def engine() -> Iterator[tuple[str, list[dict]]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    server.bodies = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.bodies  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()


def test_routes_answer_or_raise_naming_url_and_route_but_never_the_key(engine: tuple[str, list[dict]]) -> None:
    url, bodies = engine
    with EngineClient(KEY, timeout_s=5) as client:
        assert client.weight_version(url) == 3  # an int here, a string on SGLang's wire
        client.load_from_disk(url, Path("/w/4"), 4, timeout_s=5)
        assert bodies == [{"model_path": "/w/4", "weight_version": "4"}]
        assert client.call(url, "/update_weights_from_disk", {"model_path": "/w/v5"}) == {"success": True}
        errors = []
        for failing in (lambda: client.load_from_disk(url, Path("/bad"), 6, timeout_s=5),
                        lambda: client.call(url, "/nowhere"),
                        lambda: EngineClient("wrong", 5).weight_version(url),
                        lambda: client.weight_version(f"http://127.0.0.1:{free_port()}")):
            with pytest.raises(EngineError) as caught:
                failing()
            errors.append(str(caught.value))
    assert "/update_weights_from_disk answered 400: no such folder" in errors[0]
    assert "/nowhere answered 404: not found" in errors[1]
    assert "/model_info answered 401" in errors[2]
    assert "/model_info failed: ConnectionError" in errors[3]
    assert all(e.startswith("http://127.0.0.1:") for e in errors)
    assert all(KEY not in e and "wrong" not in e for e in errors)


def test_a_key_that_would_break_a_header_is_refused_unquoted() -> None:
    with pytest.raises(ValueError, match="whitespace") as caught:
        EngineClient("bad key\n", timeout_s=1)
    assert "bad key" not in str(caught.value)


def test_weight_versions_are_ints_here_and_strings_on_sglangs_wire() -> None:
    assert version_to_wire(12) == "12" and version_from_wire("12") == 12
    # SGLang's initial "default", an answer without one, and what slurmrl never publishes: no version.
    assert [version_from_wire(v) for v in ("default", None, "", "v3", "-1", True)] == [None] * 6


# An engine as its own process: HTTP/1.1 (connections kept open), each answer naming the client's
# port, so a test sees which of its calls shared a connection.
_KEEP_ALIVE_ENGINE = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class Engine(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        data = json.dumps({"client_port": self.client_address[1], "generation": sys.argv[2]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def log_message(self, *args):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), Engine).serve_forever()
"""


def test_calls_keep_their_connection_and_an_engine_restarted_on_its_port_is_reached_anew(tmp_path: Path) -> None:
    from tests.rollout.servers import start

    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def engine(generation: str):
        return start([sys.executable, "-c", _KEEP_ALIVE_ENGINE, str(port), generation], url,
                     tmp_path / f"engine_{generation}.log", "/health")

    first = engine("first")
    with EngineClient(KEY, timeout_s=5) as client:
        try:
            answers = [client.call(url, "/model_info") for _ in range(5)]
        finally:
            first.stop()  # by its PID: its kernel closes the client's kept connection
        assert {a["generation"] for a in answers} == {"first"}
        assert len({a["client_port"] for a in answers}) == 1, f"one connection for every call: {answers}"
        second = engine("second")
        try:
            assert client.call(url, "/model_info")["generation"] == "second"
        finally:
            second.stop()
