"""supervisor_state.json: what the supervisor knows about its job and steps, kept in the job dir.

It is what a supervisor restarted after a crash (slurm.watchdog) reads to adopt the live steps
and the weight version, and what `slurmrl status` shows. Every save replaces the file atomically
and durably, so a reader or a crash never sees half a document: either the old state or the new one.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from contract.job_dir import JobDir, write_atomic
from supervisor.fencing import Fence

STEP_KINDS = ("engine", "router", "trainer")
STEP_STATES = ("starting", "waiting", "healthy", "unhealthy", "restarting", "failed", "stopped", "fenced")


@dataclass
class StepRecord:
    """One supervised SLURM step, as last seen."""

    name: str
    kind: str
    het_group: int
    nodes: list[str]
    slurm_step: str | None = None  # "JOBID.STEPID" as squeue prints it and scancel takes it
    url: str | None = None  # engines and router only
    state: str = "starting"
    restarts: int = 0
    weight_version: int | None = None
    last_probe_latency_s: float | None = None
    last_probe_time: float | None = None
    last_failure: str | None = None
    launched_at: float | None = None  # unix time of its latest launch (a heartbeat before it is a predecessor's)

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise ValueError(f"step {self.name!r}: kind must be one of {STEP_KINDS}, got {self.kind!r}")
        if self.state not in STEP_STATES:
            raise ValueError(f"step {self.name!r}: state must be one of {STEP_STATES}, got {self.state!r}")


@dataclass
class JobState:
    """The whole document: job-level facts plus one record per step, by step name."""

    job_id: str | None = None
    weight_version: int | None = None  # the newest version the trainer published
    requeues: int = 0
    last_checkpoint: str | None = None
    stop_reason: str | None = None
    stop_asked: bool = False  # `slurmrl stop` was asked: kept over a supervisor crash and a requeue
    gpu_holder: str = "engines"  # --colocate: "trainer" or "engines" (supervisor/gpu_holder.py)
    gpus_released: list[str] = field(default_factory=list)  # engines released for the trainer's turn (urls)
    steps_launched: int = 0  # the job's SLURM steps so far (this run), against max_step_count
    max_step_count: int | None = None  # SLURM's MaxStepCount, once read
    lost_nodes: dict[str, str] = field(default_factory=dict)  # node -> why SLURM calls it unusable: what was done
    updated_at: float | None = None
    steps: dict[str, StepRecord] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobState:
        raw = json.loads(text)
        steps = {name: StepRecord(**_with_int_version(rec)) for name, rec in raw.pop("steps", {}).items()}
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown fields in the state file: {sorted(unknown)}")
        return cls(**_with_int_version(raw), steps=steps)


def _with_int_version(raw: dict[str, Any]) -> dict[str, Any]:
    """Older supervisors kept the weight version as a string ("3"): read as the int it names; one
    that names no published version (an engine's initial "default") as None."""
    version = raw.get("weight_version")
    if isinstance(version, str):
        raw["weight_version"] = int(version) if version.isdigit() else None
    return raw


def read_state(job_dir: JobDir) -> JobState:
    """The saved state, or a fresh one when there is none yet (first start of the job)."""
    try:
        return JobState.from_json(job_dir.state.read_text())
    except FileNotFoundError:
        return JobState()


class StateStore:
    """The supervisor's copy of the state; `update()` changes it and saves it as one unit."""

    def __init__(self, job_dir: JobDir, fence: Fence | None = None) -> None:
        self.path = job_dir.state
        self.fence = fence  # a supervisor of an older run of the job saves nothing (fencing.py)
        self._lock = threading.Lock()
        self._state = read_state(job_dir)

    def snapshot(self) -> JobState:
        """A deep copy, safe to read while other threads update."""
        with self._lock:
            return copy.deepcopy(self._state)

    @contextmanager
    def update(self) -> Iterator[JobState]:
        """Edit a copy; on leaving the block it is saved and becomes the state. If the block
        raises or the save fails, neither memory nor disk changes."""
        with self._lock:
            if self.fence is not None:
                self.fence.check()
            draft = copy.deepcopy(self._state)
            yield draft
            draft.updated_at = time.time()
            write_atomic(self.path, draft.to_json())
            self._state = draft

    def update_step(self, name: str, **changes: object) -> StepRecord:
        """Change fields of one existing step record and save; returns the new record."""
        with self.update() as state:
            record = state.steps[name]
            for key, value in changes.items():
                if not hasattr(record, key):
                    raise AttributeError(f"StepRecord has no field {key!r}")
                setattr(record, key, value)
            record.__post_init__()
        return copy.deepcopy(record)
