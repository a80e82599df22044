"""Why an engine did not start, as its own log says: the error line its output ends with. A step's
log (JOB_DIR/logs/NAME.log) is appended to by every launch, so a launch's output is what follows
the log's size at that launch."""

from __future__ import annotations

import re
from pathlib import Path

_TAIL_BYTES = 64 * 1024  # of a launch's output: a traceback's last line is in its end
_MAX_CHARS = 300  # of the line kept: an event's reason, not a log
# Lines that are not the engine's own: srun's and slurmstepd's words about the step, the supervisor's notes.
_NOT_ITS_OWN = ("srun:", "slurmstepd:", "slurmstepd-", "slurmrl:")
# A Python exception as a traceback ends ("FileNotFoundError: ..."), or a line that says error/fatal.
_ERROR = re.compile(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b|\b(error|fatal)\b", re.IGNORECASE)


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
