"""A stand-in engine for the local step backend's tests: `python -m tests.supervisor.local_engine
--port P [--exit-code N] [--fail-with TEXT] [--stuck-version]` answers what the supervisor asks of
an engine (/health_generate, /model_info's weight_version, /update_weights_from_disk) on
127.0.0.1:P, in well under a second from its start. With --exit-code it exits at once with that
code instead (a crashing engine); with --fail-with it says `local_engine: error: TEXT` first (a
start that fails for a reason its log names); with --stuck-version a weight update loads but the
version it reports stays the initial one (an engine serving an old version).
The supervisor's --api-key is accepted and not checked."""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _Engine(BaseHTTPRequestHandler):
    version: str | None = None
    stuck = False

    def _answer(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer({"weight_version": _Engine.version} if self.path == "/model_info" else {})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/update_weights_from_disk" and not _Engine.stuck:
            _Engine.version = body["weight_version"]
        self._answer({"success": True})

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--exit-code", type=int)
    parser.add_argument("--fail-with")
    parser.add_argument("--stuck-version", action="store_true")
    args, _ = parser.parse_known_args()
    if args.fail_with is not None:
        parser.exit(2, f"local_engine: error: {args.fail_with}\n")
    if args.exit_code is not None:
        raise SystemExit(args.exit_code)
    _Engine.stuck = args.stuck_version
    ThreadingHTTPServer(("127.0.0.1", args.port), _Engine).serve_forever()


if __name__ == "__main__":
    main()
