"""Whether SLURM answers the supervisor. A SLURM call that fails or times out (slurmctld paused,
restarted, overloaded) is transient: what depends on it waits, with backoff, until SLURM answers
again, and an engine start that failed meanwhile is not counted against the engine's crash-loop
breaker. The SLURM client (slurm/client.py) reports every call it makes here."""

from __future__ import annotations

import re
import threading
import time

SLURM_RETRY_FIRST_S = 1.0  # before asking SLURM again; doubles up to SLURM_RETRY_MAX_S
SLURM_RETRY_MAX_S = 15.0
SLURM_OUTAGE_LIMIT_S = 900.0  # SLURM silent this long: what waits for it fails for real
# What a SLURM client prints when slurmctld does not answer (other errors, e.g. "Invalid job id", are answers).
_SILENT = re.compile(r"timed out|Unable to contact|Communication connection failure|Connection refused", re.I)


def slurm_answered(returncode: int, stderr: str | bytes) -> bool:
    """Whether a finished SLURM client call got an answer from slurmctld (whatever it said)."""
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
    return returncode == 0 or not _SILENT.search(text)


class SlurmContact:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_failure: float | None = None  # time.monotonic() of the last call SLURM did not answer

    def record(self, answered: bool) -> None:
        if not answered:
            with self._lock:
                self._last_failure = time.monotonic()

    def failed_since(self, since: float) -> bool:
        """Whether a SLURM call failed or timed out at or after `since` (time.monotonic())."""
        with self._lock:
            return self._last_failure is not None and self._last_failure >= since


PROCESS_CONTACT = SlurmContact()  # one per process: every SlurmClient reports here unless given its own


def retry_delays() -> list[float]:
    """The waits between two asks while SLURM is silent, summing to at least SLURM_OUTAGE_LIMIT_S."""
    delays: list[float] = []
    delay = SLURM_RETRY_FIRST_S
    while sum(delays) < SLURM_OUTAGE_LIMIT_S:
        delays.append(delay)
        delay = min(delay * 2, SLURM_RETRY_MAX_S)
    return delays
