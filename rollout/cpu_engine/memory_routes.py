"""SGLang's memory-saver routes (--colocate: engines and trainer share GPUs): POST
/release_memory_occupation and /resume_memory_occupation, {"tags": null | ["weights", "kv_cache"]}.

As SGLang 0.5 (scheduler_update_weights_mixin.py): no tags means every tag; releasing needs the
engine idle (SGLang asserts it; here running requests finish first and new ones wait); resuming a
tag that is not released is an error (SGLang's set.remove raises); while anything is released the
engine's /health_generate probe is not answered with a 200 (SGLang's scheduler ignores health
checks while `offload_tags` is not empty, so the probe times out with 503) and generate requests
wait until every tag is resumed. Released memory is really freed (rollout/cpu_engine/device.py): on
the CPU the weights go to a host file and the model's tensors are emptied; on a GPU they go to
pinned host memory, and the GPU's cached blocks (the KV cache's too) go back to the driver, where
a colocated trainer can take them. Resuming brings the weights back, so the engine serves the same
weights and the same version as before (SGLang's --enable-weights-cpu-backup; without it SGLang's
weights come back undefined and the trainer republishes, as slurmrl always does after a resume).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rollout.cpu_engine.engine import Engine
from rollout.cpu_engine.http_util import error, read_json, run_on_scheduler

WEIGHTS, KV_CACHE, CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"
ALL_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)  # SGLang's GPU_MEMORY_ALL_TYPES


class MemorySaver:
    """The engine's released tags (one per engine); its device keeps the weights while released."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.released = engine.released

    def release(self, tags: list[str]) -> None:
        """On the scheduler thread, with no request running."""
        if WEIGHTS in tags and WEIGHTS not in self.released:
            self.engine.device.release_weights(self.engine.model)
        self.released.update(tags)
        self.engine.device.free_cache()  # no request runs: every cached block is the KV cache's or free

    def resume(self, tags: list[str]) -> None:
        """On the scheduler thread."""
        if WEIGHTS in tags:
            self.engine.device.restore_weights(self.engine.model)
        self.released.difference_update(tags)


def _usage(engine: Engine) -> str:
    """' allocated_gb=X reserved_gb=Y' on a GPU (what the engine holds there now), '' on the CPU."""
    usage = engine.device.memory_usage()
    return "".join(f" {key}={usage[key]:.3f}" for key in ("allocated_gb", "reserved_gb") if key in usage)


def _tags(body: dict[str, Any]) -> list[str] | str:
    """The body's tags (every tag if none), or the problem with them."""
    tags = body.get("tags")
    if tags is None or tags == []:
        return list(ALL_TAGS)
    if not isinstance(tags, list) or any(t not in ALL_TAGS for t in tags):
        return f"tags must be a list of {', '.join(ALL_TAGS)}, got {tags!r}"
    return list(dict.fromkeys(tags))


def add_memory_routes(app: FastAPI, engine: Engine) -> MemorySaver:
    saver = MemorySaver(engine)
    scheduler = engine.scheduler
    lock = asyncio.Lock()  # one release or resume at a time

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request) -> Response:
        tags = _tags(await read_json(request))
        if isinstance(tags, str):
            return error(tags)
        async with lock:
            if not saver.released:  # new requests wait from now until every tag is resumed
                await run_on_scheduler(engine, lambda: scheduler.hold_admission(+1))
            await run_on_scheduler(engine, lambda: saver.release(tags), needs_idle=True)
        print(f"cpu_engine memory released tags={','.join(tags)} weight_version={scheduler.weight_version}"
              f"{_usage(engine)}", flush=True)
        return JSONResponse(None)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request) -> Response:
        tags = _tags(await read_json(request))
        if isinstance(tags, str):
            return error(tags)
        async with lock:
            missing = [t for t in tags if t not in saver.released]
            if missing:
                return error(f"{missing[0]} is not released (released: {sorted(saver.released) or 'none'})")
            await run_on_scheduler(engine, lambda: saver.resume(tags))
            if not saver.released:
                await run_on_scheduler(engine, lambda: scheduler.hold_admission(-1))
        print(f"cpu_engine memory resumed tags={','.join(tags)} weight_version={scheduler.weight_version}"
              f"{_usage(engine)}", flush=True)
        return JSONResponse(None)

    return saver
