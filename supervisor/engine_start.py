"""An engine's start as the supervisor waits for it: until it answers /health_generate, what a
start that fails says, and a recovery's record of its failed tries. A failed start names the error
line of the engine's own log: a step's log (JOB_DIR/logs/NAME.log) is appended to by every launch,
so a launch's output is what follows the log's size at that launch."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rollout.engine_client import EngineClient, EngineError

HEALTH_POLL_S = 0.5  # between /health_generate tries while waiting for a starting engine
_TAIL_BYTES = 64 * 1024  # of a launch's output: a traceback's last line is in its end
_MAX_CHARS = 300  # of the line kept: an event's reason, not a log
# Lines that are not the engine's own: srun's and slurmstepd's words about the step, the supervisor's notes.
_NOT_ITS_OWN = ("srun:", "slurmstepd:", "slurmstepd-", "slurmrl:")
# A Python exception as a traceback ends ("FileNotFoundError: ..."), or a line that says error/fatal.
_ERROR = re.compile(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b|\b(error|fatal)\b", re.IGNORECASE)


class EngineStartError(RuntimeError):
    """An engine that did not come up; cause: the error line its log ends with, when one was found
    (what to compare between two starts: the same cause twice is no bad luck)."""

    def __init__(self, message: str, cause: str | None = None) -> None:
        super().__init__(message)
        self.cause = cause


class WrongVersion(EngineError):
    """An engine that loaded a published version and reports another (an older one, or none)."""

    def __init__(self, name: str, loaded: int, reported: int | None) -> None:
        super().__init__(f"{name} reports weight_version {reported} after loading version {loaded}")
        self.cause = f"it reports weight_version {reported} after a load from disk"


@dataclass
class Tries:
    """One recovery's failed tries: the last one's reason, its cause (a failure that names one,
    comparable between two tries) and whether the try before failed with the same cause."""

    last: str | None = None
    cause: str | None = None
    repeated: bool = False

    def failed(self, reason: str, cause: str | None) -> None:
        self.repeated = cause is not None and cause == self.cause
        self.last, self.cause = reason, cause


def wait_healthy(client: EngineClient, name: str, url: str, deadline_s: float, alive: Callable[[], bool]) -> None:
    """Until the engine answers /health_generate, its step dies, or the deadline passes."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if not alive():
            raise EngineStartError(f"{name} exited while starting (see its log)")
        if client.healthy(url):
            return
        time.sleep(HEALTH_POLL_S)
    raise EngineStartError(f"{name} did not answer /health_generate within {deadline_s:.0f} s")


def log_size(path: Path) -> int:
    """Where the next launch's output will start (0 for a log not written yet)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def error_line(path: Path, since: int) -> str | None:
    """The last error line the log got after offset `since`; None if there is none (or no log)."""
    try:
        with open(path, "rb") as log:
            log.seek(max(since, log_size(path) - _TAIL_BYTES))
            text = log.read().decode(errors="replace")
    except OSError:
        return None
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line and not line.startswith(_NOT_ITS_OWN) and _ERROR.search(line):
            return line[:_MAX_CHARS]
    return None
