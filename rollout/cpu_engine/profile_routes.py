"""SGLang's profiler routes: GET or POST /start_profile and /stop_profile, the body SGLang's
ProfileReqInput (output_dir, start_step, num_steps, activities, with_stack, record_shapes,
profile_prefix, ...). Here the torch profiler records the scheduler's forward steps and writes one
Chrome trace, `[PREFIX-]PROFILE_ID-TP-0.trace.json.gz`, into output_dir (default
$SGLANG_TORCH_PROFILER_DIR, else /tmp), as SGLang's scheduler does for TP rank 0.

As SGLang's scheduler (scheduler_profiler_mixin.py): num_steps stops the profiler by itself after
that many forward steps (no /stop_profile needed); start_step delays the start to that forward
step (or the next one, if it is past); a second start while one runs, or a stop with none running,
is an error. SGLang answers those with a 500 from its tokenizer manager; here a 400 with the
message, in SGLang's error shape. Fields whose effect the CPU engine cannot have are refused.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from rollout.cpu_engine.engine import Engine
from rollout.cpu_engine.http_util import error, read_json, run_on_scheduler

CPU, GPU, MEM, RPD = "CPU", "GPU", "MEM", "RPD"
DEFAULT_ACTIVITIES = (CPU, GPU)  # SGLang's default
_KNOWN = {"output_dir", "start_step", "num_steps", "activities", "with_stack", "record_shapes",
          "profile_prefix", "profile_by_stage", "merge_profiles", "profile_id"}
# What one CPU process cannot do: stages are not separate passes here, there is one rank to merge,
# and ROCm's rpd tracer does not exist on a CPU.
_REFUSED = {"profile_by_stage": "the CPU engine runs prefill and decode in the same forward steps",
            "merge_profiles": "the CPU engine has one rank: its trace is already the whole engine"}


class ProfileError(ValueError):
    """A profile request that cannot be honoured (answered 400)."""


class EngineProfiler:
    """The engine's torch profiler: started, counted and stopped on the scheduler thread only."""

    def __init__(self, on_gpu: bool) -> None:
        self.on_gpu = on_gpu  # --device cuda: the GPU activity records the engine's kernels
        self.forward_ct = 0  # forward steps since the engine started
        self._profiler: torch.profiler.profile | None = None
        self._pending: dict[str, Any] | None = None  # a request waiting for its start_step
        self._stop_at: int | None = None  # forward_ct at which num_steps are done
        self._path: Path | None = None
        self.written: list[Path] = []

    @property
    def active(self) -> bool:
        return self._profiler is not None or self._pending is not None

    def start(self, body: dict[str, Any]) -> None:
        request = parse(body)
        if self.active:
            raise ProfileError("Profiling is already in progress. Call /stop_profile first.")
        start_step = request["start_step"]
        if start_step is not None and start_step > self.forward_ct:
            self._pending = request
        else:
            self._begin(request)

    def stop(self) -> Path | None:
        """Stop now and write the trace (None: it had not started yet, waiting for its start_step)."""
        if not self.active:
            raise ProfileError("Profiling is not in progress. Call /start_profile first.")
        if self._profiler is None:
            self._pending = None
            return None
        return self._finish()

    def after_step(self) -> None:
        """Called by the scheduler after each forward step."""
        self.forward_ct += 1
        if self._pending is not None and self.forward_ct >= self._pending["start_step"]:
            request, self._pending = self._pending, None
            self._begin(request)
        elif self._profiler is not None and self._stop_at is not None and self.forward_ct >= self._stop_at:
            self._finish()

    def _begin(self, request: dict[str, Any]) -> None:
        activities = request["activities"]
        out = Path(request["output_dir"])
        out.mkdir(parents=True, exist_ok=True)
        prefix = f"{request['profile_prefix']}-" if request["profile_prefix"] else ""
        self._path = out / f"{prefix}{request['profile_id']}-TP-0.trace.json.gz"
        # On the CPU, GPU is accepted and empty: the engine runs no kernels to record.
        kinds = [torch.profiler.ProfilerActivity.CPU]
        if self.on_gpu and GPU in activities:
            kinds.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=kinds,
                                                record_shapes=bool(request["record_shapes"]),
                                                with_stack=bool(request["with_stack"]),
                                                profile_memory=MEM in activities)
        self._profiler.start()
        num_steps = request["num_steps"]
        self._stop_at = self.forward_ct + num_steps if num_steps is not None else None

    def _finish(self) -> Path:
        assert self._profiler is not None and self._path is not None
        profiler, path, self._profiler, self._stop_at = self._profiler, self._path, None, None
        profiler.stop()
        profiler.export_chrome_trace(str(path))
        self.written.append(path)
        print(f"cpu_engine: profile trace written to {path}", flush=True)
        return path


def parse(body: dict[str, Any]) -> dict[str, Any]:
    """SGLang's ProfileReqInput with its defaults; ProfileError naming a bad field."""
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise ProfileError(f"unknown profile field(s) {unknown}; known: {sorted(_KNOWN)}")
    for name, why in _REFUSED.items():
        if body.get(name):
            raise ProfileError(f"{name} is not supported: {why}")
    activities = body.get("activities") or list(DEFAULT_ACTIVITIES)
    if not isinstance(activities, list) or not set(activities) <= {CPU, GPU, MEM, RPD}:
        raise ProfileError(f"activities must be a list of {CPU}, {GPU}, {MEM}, {RPD}; got {activities!r}")
    if RPD in activities:
        raise ProfileError("activity RPD (ROCm's rpd tracer) is not supported by the CPU engine")
    for name in ("start_step", "num_steps"):
        value = body.get(name)
        least = int(name == "num_steps")
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            raise ProfileError(f"{name} must be a{' positive' if name == 'num_steps' else ' non-negative'} integer, "
                               f"got {value!r}")
    output_dir = body.get("output_dir") or os.environ.get("SGLANG_TORCH_PROFILER_DIR", "/tmp")
    return {"output_dir": output_dir, "start_step": body.get("start_step"), "num_steps": body.get("num_steps"),
            "activities": activities, "with_stack": body.get("with_stack"), "record_shapes": body.get("record_shapes"),
            "profile_prefix": body.get("profile_prefix"), "profile_id": body.get("profile_id") or str(time.time())}


def add_profile_routes(app: FastAPI, engine: Engine) -> EngineProfiler:
    profiler = EngineProfiler(on_gpu=engine.device.name == "cuda")
    engine.scheduler.on_step = profiler.after_step

    @app.api_route("/start_profile", methods=["GET", "POST"])
    async def start_profile(request: Request) -> Response:
        body = await read_json(request)
        try:
            await run_on_scheduler(engine, lambda: profiler.start(body))
        except (ProfileError, OSError) as err:
            return error(str(err))
        return PlainTextResponse("Start profiling.\n")

    @app.api_route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile() -> Response:
        try:
            await run_on_scheduler(engine, profiler.stop)
        except ProfileError as err:
            return error(str(err))
        return PlainTextResponse("Stop profiling. This will take some time.\n")

    return profiler
