"""Starting and stopping CPU engine subprocesses for tests, and waiting on conditions."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

from tests.ports import free_port  # noqa: F401 (used here and by the tests that import it from here)

REPO = Path(__file__).resolve().parents[2]


def wait_until(condition: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll condition() until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.02)


def asgi_get(app: Any, path: str) -> tuple[int, bytes]:
    """One GET through an ASGI app, without a server: its status and body."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def make_tiny_model(folder: Path, seed: int = 0) -> Path:
    from rollout.tiny_model import write_tiny_model

    return write_tiny_model(folder, seed=seed)


class EngineProcess:
    """`python -m rollout.cpu_engine` on a free 127.0.0.1 port, its output in a log file."""

    def __init__(self, model: Path, log: Path, api_key: str | None = None, extra: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = log
        argv = [sys.executable, "-m", "rollout.cpu_engine", "--model-path", str(model), "--host", "127.0.0.1",
                "--port", str(self.port), "--random-seed", "0", *(extra or [])]
        if api_key:
            argv += ["--api-key", api_key]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, **kwargs: Any) -> requests.Response:
        return requests.get(self.url + path, headers=self.headers, timeout=60, **kwargs)

    def post(self, path: str, body: Any = None, **kwargs: Any) -> requests.Response:
        return requests.post(self.url + path, json=body, headers=self.headers, timeout=120, **kwargs)

    def generate(self, body: dict[str, Any]) -> Any:
        response = self.post("/generate", body)
        assert response.status_code == 200, response.text
        return response.json()

    def stats(self) -> dict[str, Any]:
        return self.get("/server_info").json()["internal_states"][0]

    def log_text(self) -> str:
        return self.log.read_text()

    def wait_ready(self, timeout: float = 90.0) -> None:
        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"engine exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                return self.get("/health").status_code == 200
            except requests.ConnectionError:  # the port opens once the weights are loaded
                return False

        wait_until(healthy, timeout, "the engine's /health to answer 200")
        wait_until(lambda: "The server is fired up and ready to roll!" in self.log_text(), 10, "the ready line")

    def stop(self) -> None:
        """SIGTERM by PID, then SIGKILL if it has not exited within 20 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def served_lines(engine: EngineProcess, rid: str) -> list[str]:
    """The engine's log lines for a served request id."""
    return [line for line in engine.log_text().splitlines()
            if line.startswith("cpu_engine served ") and f" rid={rid} " in line]
