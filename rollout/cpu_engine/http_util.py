"""Small helpers shared by the route modules: JSON bodies, error answers, scheduler calls."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rollout.cpu_engine.engine import Engine


class BodyError(ValueError):
    """The request body is not a JSON object (answered in SGLang's error shape by the app)."""


class EarlyResponse(Exception):
    """Ends a route with a ready response, from a helper the route calls."""

    def __init__(self, response: JSONResponse) -> None:
        super().__init__(response.status_code)
        self.response = response


def add_error_handlers(app: FastAPI) -> None:
    async def body_error(request: Request, err: BodyError) -> JSONResponse:
        return error(str(err))

    async def early(request: Request, err: EarlyResponse) -> JSONResponse:
        return err.response

    # Starlette types a handler as taking any Exception; it calls each only with the class it is registered for.
    app.add_exception_handler(BodyError, body_error)  # type: ignore[arg-type]
    app.add_exception_handler(EarlyResponse, early)  # type: ignore[arg-type]


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a dict; an empty body is {} (clients post `{}` or nothing alike)."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as err:
        raise BodyError(f"the body is not valid JSON: {err}") from err
    if not isinstance(body, dict):
        raise BodyError("the body must be a JSON object")
    return body


def error(message: str, status: int = 400) -> JSONResponse:
    """SGLang's error shape for request errors."""
    return JSONResponse({"error": {"message": message}}, status_code=status)


async def run_on_scheduler(engine: Engine, fn: Callable[[], Any], needs_idle: bool = False) -> Any:
    """Run fn on the scheduler thread between forward passes and return its result."""
    return await asyncio.wrap_future(engine.scheduler.call(fn, needs_idle=needs_idle))
