"""One engine's record as the supervisor keeps it (Engine: written only by supervisor/engines.py's
Engines, read by everyone), and its image in the state store's step records."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from supervisor.engine_states import FAILED, STARTING, EngineState
from supervisor.layout import EnginePlace
from supervisor.state import JobState, StepRecord

UNHEALTHY = "unhealthy"  # the record's state of a live engine the kill cap holds back


@dataclass
class Engine:
    """One engine's record. Others read its fields; only Engines writes them."""

    place: EnginePlace
    state: EngineState = STARTING
    version: int | None = None  # the weight version it serves (None: the initial checkpoint, or unknown)
    restarts: int = 0  # in the job's life
    recent_restarts: int = 0  # in a row, each soon after the one before: the crash-loop count
    last_restart: float = 0.0
    in_router: bool = False

    @property
    def name(self) -> str:
        return self.place.name

    @property
    def url(self) -> str:
        return self.place.url


def step_record(state: JobState, engine: Engine) -> StepRecord:
    if engine.name not in state.steps:
        state.steps[engine.name] = StepRecord(engine.name, "engine", engine.place.het_group, list(engine.place.nodes))
    return state.steps[engine.name]


def copy_into(record: StepRecord, engine: Engine, held: bool) -> None:
    """held: the kill cap keeps it running though it failed its probes: `unhealthy` in the record
    (and in `slurmrl status`), whatever its state of the engine machine (it is still live)."""
    record.state = UNHEALTHY if held else engine.state.value
    record.restarts, record.weight_version = engine.restarts, engine.version
    record.nodes, record.url = list(engine.place.nodes), engine.url


def roles_missing(engines: Iterable[Engine]) -> list[str]:
    """With prefill/decode engines: the roles no live engine has left (a PD router needs a prefill
    and a decode engine for every request, so the job cannot go on without one of each)."""
    engines = list(engines)
    wanted = {e.place.role for e in engines} - {"regular"}
    return sorted(wanted - {e.place.role for e in engines if e.state != FAILED})
