"""slime.utils.http_utils.post, as slime plug-ins call it: JSON out and in, an error status retried
until it passes or max_retries is spent, and the job's key sent along."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from contract.job_dir import API_KEY_ENV
from slime.utils import http_utils


async def _serve(fail_first: int, seen: list[tuple[str | None, dict]]) -> tuple[web.AppRunner, str]:
    async def generate(request: web.Request) -> web.Response:
        seen.append((request.headers.get("Authorization"), await request.json()))
        if len(seen) <= fail_first:
            return web.Response(status=503, text="busy")
        return web.json_response({"text": "ok", "echo": seen[-1][1]})

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}/generate"


@pytest.mark.parametrize("fail_first, max_retries, succeeds", [(0, 1, True), (2, 3, True), (3, 3, False)])
def test_post_retries_error_statuses_then_gives_up(fail_first: int, max_retries: int, succeeds: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "job-key")
    monkeypatch.setattr(http_utils, "RETRY_DELAY_S", 0.01)
    seen: list[tuple[str | None, dict]] = []

    async def run() -> object:
        runner, url = await _serve(fail_first, seen)
        try:
            return await http_utils.post(url, {"text": "hi"}, max_retries=max_retries)
        finally:
            await runner.cleanup()

    if succeeds:
        assert asyncio.run(run()) == {"text": "ok", "echo": {"text": "hi"}}
        assert len(seen) == fail_first + 1
    else:
        with pytest.raises(Exception, match="503"):
            asyncio.run(run())
        assert len(seen) == max_retries
    assert all(auth == "Bearer job-key" for auth, _ in seen)
