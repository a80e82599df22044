"""slime.utils.http_utils's `post` and `get`, as plug-ins call them (its custom generate functions
post to f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate").

Like slime's: JSON in and out (a body that is not JSON comes back as text), an error status or a
failed connection retried every RETRY_DELAY_S up to max_retries times, then raised. Unlike slime's,
the job's API key goes along (slurmrl's router and engines ask for it), read from the environment
every step of the job has.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any

import aiohttp

from contract.job_dir import API_KEY_ENV

log = logging.getLogger(__name__)

RETRY_DELAY_S = 1.0  # slime's


def _headers(headers: dict[str, str] | None) -> dict[str, str]:
    key = os.environ.get(API_KEY_ENV)
    return {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}


async def post(url: str, payload: Any, max_retries: int = 60, headers: dict[str, str] | None = None) -> Any:
    for attempt in range(1, max_retries + 1):
        try:
            # A session per call: plug-ins run in whichever event loop the rollout made.
            async with aiohttp.ClientSession(headers=_headers(headers), trust_env=False) as session:
                async with session.post(url, json=payload or {}) as response:
                    response.raise_for_status()
                    text = await response.text()
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                return text
        except (TimeoutError, aiohttp.ClientError) as err:
            log.info("post %s failed (%s), attempt %d of %d", url, err, attempt, max_retries)
            if attempt >= max_retries:
                raise
            await asyncio.sleep(RETRY_DELAY_S)
    raise ValueError(f"post {url}: max_retries must be 1 or more, got {max_retries}")


async def get(url: str) -> Any:
    async with aiohttp.ClientSession(headers=_headers(None), trust_env=False) as session:
        async with session.get(url) as response:
            response.raise_for_status()
            return json.loads(await response.text())
