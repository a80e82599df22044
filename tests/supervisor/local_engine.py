"""A stand-in engine for the local step backend's tests: `python -m tests.supervisor.local_engine
--port P [--exit-code N]` answers what the supervisor asks of an engine (/health_generate,
/model_info's weight_version, /update_weights_from_disk) on 127.0.0.1:P, in well under a second
from its start; with --exit-code it exits at once with that code instead (a crashing engine),
after printing --say's line (words its srun would have said, or its own error); with
--stuck-version a weight update loads but the version it reports stays the initial one (an engine
serving an old version).
The supervisor's --api-key is accepted and not checked."""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from slurm.devcluster.daemons import wait_for

LOAD_GATE_S = 60.0  # the longest a gated load waits for its gate


class _Engine(BaseHTTPRequestHandler):
    version: str | None = None
    stuck = False
    gate: Path | None = None

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
        if self.path == "/update_weights_from_disk" and _Engine.gate is not None:
            Path(f"{_Engine.gate}.waiting").touch()  # the test sees the load under way
            wait_for(_Engine.gate.exists, LOAD_GATE_S, f"the load gate {_Engine.gate}")
        if self.path == "/update_weights_from_disk" and not _Engine.stuck:
            _Engine.version = body["weight_version"]
        self._answer({"success": True})

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--exit-code", type=int)
    parser.add_argument("--say", help="a line to print (to its log) before --exit-code")
    parser.add_argument("--stuck-version", action="store_true")
    parser.add_argument("--load-gate", type=Path)
    args, _ = parser.parse_known_args()
    if args.say:
        print(args.say, flush=True)
    if args.exit_code is not None:
        raise SystemExit(args.exit_code)
    _Engine.stuck = args.stuck_version
    _Engine.gate = args.load_gate
    ThreadingHTTPServer(("127.0.0.1", args.port), _Engine).serve_forever()


if __name__ == "__main__":
    main()
