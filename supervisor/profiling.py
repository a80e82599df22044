"""`slurmrl profile JOB --rollout|--train --steps N` on the supervisor's side.

--rollout: SGLang's profiler on every serving engine, through each engine's own /start_profile
with num_steps (it stops by itself after N forward steps). sglang-router 0.3.2 has no profile
route (its binary knows /flush_cache and /get_loads, nothing of /start_profile), so the supervisor
calls each engine directly, at the urls it keeps in its state. One folder per engine.
--train: the request waits here until the trainer's next poll between rollouts
(Call.TRAINER_POLL's answer carries it); the trainer then runs the torch profiler for its next N
optimizer steps (trainer/profiling.py), one trace per rank.

Every trace lands under JOB_DIR/profiles/{rollout,train}-UTCSTAMP/. An engine writes its trace on its
scheduler's thread, generating nothing meanwhile: for PROFILE_TRACE_S after the start the daemon probes the
profiled engines for liveness only (tracing()).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout.engine_client import EngineError
from supervisor.context import JobContext
from supervisor.engine_record import Engine

ROLLOUT, TRAIN = "rollout", "train"
# How long after a rollout profile starts its engines are probed for liveness only (Daemon._probe_cycle): once its
# num_steps are done, SGLang writes the trace on the scheduler's thread and generates nothing meanwhile (seconds
# for a long GPU trace or a loaded machine), which the generation probe takes for a hung engine (CI: an engine
# restarted mid-write, its trace lost).
PROFILE_TRACE_S = 120.0


class Profiling:
    def __init__(self, job: JobContext, serving: Callable[[], dict[str, Engine]]) -> None:
        self.job = job
        self.serving = serving
        self._lock = threading.Lock()
        self._train: dict[str, Any] | None = None  # a request the trainer has not polled yet
        self._tracing: dict[str, float] = {}  # engine -> when (monotonic) its rollout profile's window ends

    def start(self, target: str, steps: int) -> dict[str, Any]:
        if steps < 1:
            raise ValueError(f"steps must be a positive integer, got {steps}")
        if target == ROLLOUT:
            return self._rollout(steps)
        if target == TRAIN:
            return self._ask_trainer(steps)
        raise ValueError(f"target must be {ROLLOUT} or {TRAIN}, got {target!r}")

    def tracing(self) -> set[str]:
        """The engines whose rollout profile may still be writing its trace (PROFILE_TRACE_S from its start)."""
        now = time.monotonic()
        with self._lock:
            self._tracing = {name: end for name, end in self._tracing.items() if end > now}
            return set(self._tracing)

    def take_train_request(self) -> dict[str, Any] | None:
        """The trainer's poll: the pending --train request, handed over once."""
        with self._lock:
            request, self._train = self._train, None
        return request

    def _folder(self, target: str) -> Path:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        folder = self.job.dir.profiles / f"{target}-{stamp}"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _rollout(self, steps: int) -> dict[str, Any]:
        engines = self.serving()
        if not engines:
            raise ValueError("no engine is serving now: nothing to profile (see slurmrl status)")
        folder = self._folder(ROLLOUT)
        started, failed = [], {}
        for name, engine in sorted(engines.items()):
            body = {"output_dir": str(folder / name), "num_steps": steps, "profile_prefix": name}
            try:
                self.job.client.start_profile(engine.url, body)
                started.append(name)
            except EngineError as err:
                failed[name] = str(err)
        with self._lock:
            self._tracing.update(dict.fromkeys(started, time.monotonic() + PROFILE_TRACE_S))
        self.job.events.emit("profile_started", target=ROLLOUT, steps=steps, dir=str(folder), engines=started,
                             failed=failed)
        return {"dir": str(folder), "engines": started, "failed": failed}

    def _ask_trainer(self, steps: int) -> dict[str, Any]:
        with self._lock:
            if self._train is not None:
                raise ValueError(f"a --train profile is already waiting for the trainer ({self._train['dir']})")
            folder = self._folder(TRAIN)
            self._train = {"dir": str(folder), "steps": steps}
        self.job.events.emit("profile_requested", target=TRAIN, steps=steps, dir=str(folder))
        return {"dir": str(folder), "engines": [], "failed": {}}
