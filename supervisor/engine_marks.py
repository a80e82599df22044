"""Marks beside the engines' records: which engines are being recovered (one recovery each, and
whether it waits for the router to admit its engine), why a recovery must try again, which engines
the kill cap holds back, and which are loading the current weights from disk. Kept by the engines'
owner (supervisor/engines.py, Engines) and read and changed only under its lock, with the engine
moves they go with."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class RecoveryStart(Enum):
    """What a failure did to an engine's recovery (Engines.start_recovering)."""

    STARTED = "started"  # a new recovery: the caller runs it
    RETRY = "retry"  # its recovery was waiting for its admission: that recovery tries again
    REFUSED = "refused"  # it is being recovered already, or was given up


@dataclass
class EngineMarks:
    recovering: set[str] = field(default_factory=set)  # each has one recovery (a thread of EngineRecovery)
    admitting: set[str] = field(default_factory=set)  # of those, the ones whose recovery waits for the router
    retry: dict[str, str] = field(default_factory=dict)  # a failure while its recovery waited: why it tries again
    held: dict[str, str] = field(default_factory=dict)  # failed its probes, kept running by the kill cap: why
    # loading the current version from disk (EngineRecovery's sync): a publish meanwhile would race the load
    syncing: set[str] = field(default_factory=set)

    def start(self, name: str, reason: str) -> RecoveryStart:
        """A failure of a live engine: a new recovery, or the next try of the one that waits for its
        admission, or nothing while its recovery is under way."""
        if name in self.recovering:
            if name not in self.admitting:
                return RecoveryStart.REFUSED
            self.admitting.discard(name)
            self.retry[name] = reason
            started = RecoveryStart.RETRY
        else:
            self.recovering.add(name)
            started = RecoveryStart.STARTED
        self.held.pop(name, None)
        return started

    def serving(self, name: str) -> bool:
        """Whether a live engine gets the trainer's next version: unless a recovery holds it, short
        of the wait for its admission, or the supervisor is loading the current version into it."""
        return name not in self.syncing and (name not in self.recovering or name in self.admitting)

    def end(self, name: str) -> str | None:
        """Its recovery ends, unless a failure came at the last moment: then that failure's reason
        (the recovery goes on; no second one could start meanwhile)."""
        retry = self.retry.pop(name, None)
        if retry is None:
            self.recovering.discard(name)
        self.admitting.discard(name)
        return retry

    def abandon(self, name: str) -> None:
        """Its recovery stopped short: unmarked."""
        self.recovering.discard(name)
        self.admitting.discard(name)
        self.retry.pop(name, None)

    def hold(self, name: str, reason: str) -> bool:
        """Held back by the kill cap: True the first time; False while held, or being recovered."""
        if name in self.held or name in self.recovering:
            return False
        self.held[name] = reason
        return True
