"""An engine's life as a state machine: its states, and the one table of the moves allowed
between them. The owner of the engine records (supervisor/engines.py, Engines) makes every move
through `checked`, which refuses any other loudly.

    STARTING    its step is launched; it has not answered /health_generate yet
    WAITING     it answers, but does not serve the current weight version: outside the router
    HEALTHY     it serves the current weight version, in the router
    RESTARTING  taken out after a failure; its recovery stops it and launches it again
    FAILED      given up (a crash loop, no spare node, a failed first start): never launched again
"""

from __future__ import annotations

from enum import Enum


class EngineState(str, Enum):
    """The values are the state store's vocabulary (StepRecord.state, `slurmrl status`)."""

    STARTING = "starting"
    WAITING = "waiting"
    HEALTHY = "healthy"
    RESTARTING = "restarting"
    FAILED = "failed"


STARTING, WAITING, HEALTHY, RESTARTING, FAILED = EngineState

# from -> the states it may move to; FAILED is the end. A launch (-> STARTING) comes from a first
# start, from a recovery (RESTARTING) or from the recovery's next try after a failed one; STARTING ->
# HEALTHY is an adopted engine found serving the current version in the router; RESTARTING ->
# RESTARTING a recovery asked again after one that ended early (the job was ending).
TRANSITIONS: dict[EngineState, frozenset[EngineState]] = {
    STARTING: frozenset({STARTING, WAITING, HEALTHY, RESTARTING, FAILED}),
    WAITING: frozenset({STARTING, WAITING, HEALTHY, RESTARTING, FAILED}),
    HEALTHY: frozenset({WAITING, HEALTHY, RESTARTING, FAILED}),
    RESTARTING: frozenset({STARTING, RESTARTING, FAILED}),
    FAILED: frozenset(),
}

LIVE = frozenset({WAITING, HEALTHY})  # answering: probed, and given each new weight version


class IllegalTransition(RuntimeError):
    """A move the table does not allow: a bug in the supervisor, never a state of the job."""


def checked(name: str, old: EngineState, new: EngineState) -> EngineState:
    """`new`, if the table allows old -> new; IllegalTransition naming both otherwise."""
    if new not in TRANSITIONS[old]:
        raise IllegalTransition(f"{name}: {old.value} -> {new.value} is not an allowed engine transition "
                                f"(from {old.value}: {', '.join(sorted(s.value for s in TRANSITIONS[old])) or 'none'})")
    return new
