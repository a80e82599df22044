"""A control-socket handler table for tests: the handlers given, and for every other call of the
protocol one that fails the call (a test that reaches it sees the error)."""

from __future__ import annotations

from typing import Any

from contract.control_protocol import Call
from supervisor.control import Handler


def handler_table(given: dict[Call, Handler]) -> dict[Call, Handler]:
    def unexpected(call: Call) -> Handler:
        def handle(**args: Any) -> dict[str, Any]:
            raise AssertionError(f"unexpected call {call.value} {args}")
        return handle

    return {call: given.get(call) or unexpected(call) for call in Call}
