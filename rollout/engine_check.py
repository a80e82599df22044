"""Which engines do not answer: asked when a request through the router timed out or came back
unparseable, since the router does not say which engine served it. Each engine gets a direct
1-token /generate, bounded; one that stays silent, or answers 200 with a body that is not a
generate answer, is named. Its health probe may well pass (a wedged engine's does)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

CHECK_TIMEOUT_S = 30.0  # one check request (SGLang's health check waits 20 s for any token; this one waits for its own)
FINISH_TYPES = ("stop", "length", "abort")
_CHECK_BODY = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}


class BadAnswer(ValueError):
    """An engine's 200 answer that is not a generate answer (not JSON, or not its shape)."""


def parse_answer(text: str) -> dict[str, Any]:
    """A /generate answer (the first of a list); BadAnswer naming what is wrong with it."""
    try:
        body = json.loads(text)
    except ValueError as err:
        raise BadAnswer(f"not JSON ({err}): {text[:120]!r}") from None
    body = body[0] if isinstance(body, list) and body else body
    meta = body.get("meta_info") if isinstance(body, dict) else None
    finish = meta.get("finish_reason") if isinstance(meta, dict) else None
    if (not isinstance(body.get("text") if isinstance(body, dict) else None, str)
            or not isinstance(body.get("output_ids"), list) or not isinstance(finish, dict)
            or finish.get("type") not in FINISH_TYPES):
        raise BadAnswer(f"not a generate answer (text, output_ids, meta_info.finish_reason): {text[:120]!r}")
    return body


async def unanswering(http: aiohttp.ClientSession, urls: list[str], timeout_s: float) -> dict[str, str]:
    """{url: why} for each engine of `urls` that does not answer the check within timeout_s. An engine
    that answers another status with a JSON body is alive (a disaggregated one refuses a bare request)."""
    whys = await asyncio.gather(*(_check(http, url, timeout_s) for url in urls))
    return {url: why for url, why in zip(urls, whys) if why is not None}


async def _check(http: aiohttp.ClientSession, url: str, timeout_s: float) -> str | None:
    try:
        async with asyncio.timeout(timeout_s):
            async with http.post(url + "/generate", json=_CHECK_BODY) as response:
                status, text = response.status, await response.text()
    except TimeoutError:
        return f"a 1-token /generate got no answer within {timeout_s:g} s"
    except aiohttp.ClientError as err:
        return f"a 1-token /generate failed: {type(err).__name__}: {err}"
    try:
        if status == 200:
            parse_answer(text)
        else:
            json.loads(text)
    except ValueError as err:  # BadAnswer too
        return f"a 1-token /generate answered {status}, unparseable: {err}"
    return None
