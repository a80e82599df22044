"""Many fake engines in one process: one aiohttp app listening on many 127.0.0.1 ports, each port
answering GET /health_generate as "ok" (200 after a delay), "fail" (503) or "hang" (never); with
FAKE_ENGINES_API_KEY set, a probe without that Bearer key gets 401.

Run as `python -m tests.rollout.fake_engines --ok N --fail N --hang N --delay-ms D`: it prints
one JSON line {"ok": [ports], "fail": [...], "hang": [...]} once every port listens, then serves
until it is signalled. `fake_engines(...)` starts it as a child and stops it by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Iterator

from aiohttp import web

BEHAVIOURS = ("ok", "fail", "hang")
KEY_ENV = "FAKE_ENGINES_API_KEY"  # the key reaches the child in its environment, never on its command line
LISTEN_WAIT_S = 60.0  # seconds the child may take to listen on every port
STOP_WAIT_S = 10.0  # seconds the child gets to exit on SIGTERM before it is killed


async def _serve(counts: dict[str, int], delay_s: float, api_key: str | None) -> None:
    behaviour_of: dict[int, str] = {}

    async def health(request: web.Request) -> web.Response:
        if api_key is not None and request.headers.get("Authorization") != f"Bearer {api_key}":
            return web.Response(status=401)
        behaviour = behaviour_of[request.transport.get_extra_info("sockname")[1]]
        if behaviour == "hang":
            await asyncio.Event().wait()
        await asyncio.sleep(delay_s)
        return web.Response(status=200 if behaviour == "ok" else 503)

    app = web.Application()
    app.router.add_get("/health_generate", health)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    ports: dict[str, list[int]] = {b: [] for b in BEHAVIOURS}
    for behaviour in BEHAVIOURS:
        for _ in range(counts[behaviour]):
            site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            behaviour_of[port] = behaviour
            ports[behaviour].append(port)
    print(json.dumps(ports), flush=True)
    await asyncio.Event().wait()  # until SIGTERM ends the process (no graceful wait on hung probes)


@contextlib.contextmanager
def fake_engines(ok: int, fail: int = 0, hang: int = 0, delay_ms: float = 0, api_key: str | None = None,
                 timeout_s: float = LISTEN_WAIT_S) -> Iterator[dict[str, list[int]]]:
    """Start the fake engines in a child process; yields the ports per behaviour. With `api_key`,
    a probe without that Bearer key gets 401 (the key reaches the child through its environment)."""
    env = {**os.environ, **({KEY_ENV: api_key} if api_key else {})}
    proc = subprocess.Popen([sys.executable, "-m", "tests.rollout.fake_engines", "--ok", str(ok),
                             "--fail", str(fail), "--hang", str(hang), "--delay-ms", str(delay_ms)], env=env,
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        if not sel.select(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"fake engines did not listen within {timeout_s} s")
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"fake engines exited with {proc.wait()}")
        yield json.loads(line)
    finally:
        proc.terminate()
        try:
            proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    for behaviour in BEHAVIOURS:
        parser.add_argument(f"--{behaviour}", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    args = parser.parse_args()
    counts = {b: getattr(args, b) for b in BEHAVIOURS}
    asyncio.run(_serve(counts, args.delay_ms / 1000, os.environ.get(KEY_ENV)))


if __name__ == "__main__":
    main()
