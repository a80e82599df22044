"""Test-only faults of the CPU engine, set at run time with `POST /slurmrl_fault {"generate": F}`
(F null clears it), to reproduce engines that pass their health probe yet fail the trainer:

- "wedge": /generate never answers (an engine stuck past its scheduler: the probe, a generation
  through the scheduler, still passes);
- "malformed": /generate answers 200 with a body that is not JSON.

Not an SGLang route: the trainer and the supervisor never call it."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import Response

from rollout.cpu_engine.http_util import error, read_json

WEDGE, MALFORMED = "wedge", "malformed"
ROUTE = "/slurmrl_fault"
_MALFORMED_BODY = b'{"text": "the answer is'  # cut short: what a crashing proxy or a broken server sends


class Faults:
    def __init__(self) -> None:
        self.generate: str | None = None
        self._release = asyncio.Event()  # set when the fault is cleared: wedged requests go on

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
            fault = (await read_json(request)).get("generate")
            if fault not in (None, WEDGE, MALFORMED):
                return error(f"generate must be null, {WEDGE!r} or {MALFORMED!r}, got {fault!r}")
            self.generate = fault
            if fault is None:
                self._release.set()
            else:
                self._release.clear()
            return Response(status_code=200)
