"""Test-only faults of the CPU engine, set at run time with `POST /slurmrl_fault {"generate": F}`
(F null clears it), to reproduce engines that pass their health probe yet fail the trainer:

- "wedge": /generate never answers (an engine stuck past its scheduler: the probe, a generation
  through the scheduler, still passes);
- "malformed": /generate answers 200 with a body that is not JSON;

and `POST /slurmrl_fault {"update": "fail"}` ("update": null clears it): every weight update from
disk fails (an engine that cannot take a new version: out of memory, a bad path on its node).
`POST /slurmrl_fault {"version": V}` makes /server_info say it is SGLang V (null: this engine's own
version), e.g. "0.5.5", older than flattened buckets, to which a trainer sends a tensor per handle.

And one taken at start, so that an engine launched again has it too: the file that
$SLURMRL_CPU_ENGINE_FAULTS names, a JSON object {"HOST:PORT": {"weight_version": "stuck"}}, read
by the engine that listens on HOST:PORT when it starts:

- weight_version "stuck": weight updates load, but the engine keeps reporting the version it
  started with (an engine that comes back serving an old version).

Not an SGLang route: the trainer and the supervisor never call it."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response

from rollout.cpu_engine.http_util import error, read_json

WEDGE, MALFORMED = "wedge", "malformed"
FAIL = "fail"
STUCK = "stuck"
ROUTE = "/slurmrl_fault"
AT_START_ENV = "SLURMRL_CPU_ENGINE_FAULTS"
_MALFORMED_BODY = b'{"text": "the answer is'  # cut short: what a crashing proxy or a broken server sends


class Faults:
    def __init__(self, version_stuck: bool = False) -> None:
        self.generate: str | None = None
        self.update: str | None = None  # FAIL: weight updates fail
        self.version_stuck = version_stuck  # weight updates leave the reported version as it is
        self.version: str | None = None  # the SGLang version /server_info reports instead of this engine's
        self._release = asyncio.Event()  # set when the fault is cleared: wedged requests go on

    @classmethod
    def at_start(cls, host: str, port: int) -> Faults:
        """The faults $SLURMRL_CPU_ENGINE_FAULTS's file gives this engine (none without the variable
        or an entry for it); ValueError for a file that is not such a JSON object."""
        path = os.environ.get(AT_START_ENV)
        if not path or not Path(path).is_file():
            return cls()
        mine = json.loads(Path(path).read_text()).get(f"{host}:{port}") or {}
        if mine.get("weight_version") not in (None, STUCK):
            raise ValueError(f"{path}: weight_version of {host}:{port} must be {STUCK!r} or null")
        return cls(version_stuck=mine.get("weight_version") == STUCK)

    async def before_generate(self) -> Response | None:
        """Applied at the start of /generate: a response to send instead, or None to serve it."""
        if self.generate == WEDGE:
            await self._release.wait()  # uvicorn cancels it at shutdown (timeout_graceful_shutdown)
        if self.generate == MALFORMED:
            return Response(_MALFORMED_BODY, status_code=200, media_type="application/json")
        return None

    def add_route(self, app: FastAPI) -> None:
        @app.post(ROUTE)
        async def set_fault(request: Request) -> Response:
            body = await read_json(request)
            if "version" in body:
                if not (body["version"] is None or isinstance(body["version"], str)):
                    return error(f"version must be null or a string, got {body['version']!r}")
                self.version = body["version"]
                return Response(status_code=200)
            if "update" in body:
                if body["update"] not in (None, FAIL):
                    return error(f"update must be null or {FAIL!r}, got {body['update']!r}")
                self.update = body["update"]
                return Response(status_code=200)
            fault = body.get("generate")
            if fault not in (None, WEDGE, MALFORMED):
                return error(f"generate must be null, {WEDGE!r} or {MALFORMED!r}, got {fault!r}")
            self.generate = fault
            if fault is None:
                self._release.set()
            else:
                self._release.clear()
            return Response(status_code=200)
