"""events.jsonl: the supervisor's append-only record of what it did and why, and a reader that follows it.

One JSON object per line: time (unix float), iso (UTC), kind (engine_failed, engine_restarted,
router_relaunched, trainer_restarted, requeue, ...), step (engine-3, router, ... or null) and free
fields (reason, detect_s, recover_s, ...). Each line is fsync'd before emit returns, so an event
the supervisor acted on survives a node crash or a requeue.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, Self

from supervisor.fencing import Fence


class EventLog:
    """Thread-safe appender of one fsync'd JSON line per event."""

    def __init__(self, path: Path, fence: Fence | None = None) -> None:
        self.path = Path(path)
        self.fence = fence  # a supervisor of an older run of the job writes no event (fencing.py)
        self._lock = threading.Lock()
        # O_APPEND: a single write() of one line lands whole at the end even if another
        # process (a restarted supervisor, before the old one is gone) appends too.
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def emit(self, kind: str, step: str | None = None, **fields: object) -> dict[str, object]:
        """Append one event and return it; fields must be JSON-serialisable."""
        now = time.time()
        event: dict[str, object] = {
            "time": now,
            "iso": datetime.fromtimestamp(now, UTC).isoformat(timespec="milliseconds"),
            "kind": kind,
            "step": step,
            **fields,
        }
        line = (json.dumps(event, separators=(",", ":")) + "\n").encode()
        if self.fence is not None and self.fence.fenced:
            return event
        with self._lock:
            os.write(self._fd, line)
            os.fsync(self._fd)
        return event

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def follow(path: Path, from_start: bool = True, poll_s: float = 0.2,
           stop: threading.Event | None = None) -> Iterator[dict[str, Any]]:
    """Yield events (parsed JSON objects) as they are appended (like tail -f), waiting for the file to appear.

    from_start=False skips what is there at the time of this call. A line is yielded only once
    its newline is written, so a reader never sees half an event. Ends when `stop` is set.
    """
    path = Path(path)
    # Taken now, not at the first next(): a generator body would run too late.
    offset = 0 if from_start or not path.exists() else path.stat().st_size
    return _follow(path, offset, poll_s, stop or threading.Event())


def _follow(path: Path, offset: int, poll_s: float, stop: threading.Event) -> Iterator[dict[str, Any]]:
    while not path.exists():
        if stop.wait(poll_s):
            return
    with open(path, "rb") as f:
        f.seek(max(0, offset - 1))
        # Started in the middle of a line being written: its rest is not an event of ours.
        skip_first = offset > 0 and f.read(1) != b"\n"
        pending = b""
        while True:
            chunk = f.readline()
            if not chunk:
                # At the end of what is written: a set stop ends here (so an already-set stop
                # still yields the whole file), else wait for more.
                if stop.is_set() or stop.wait(poll_s) and not _more(f):
                    return
                continue
            pending += chunk
            if pending.endswith(b"\n"):
                line, pending = pending, b""
                if skip_first:
                    skip_first = False
                elif line.strip():
                    yield json.loads(line)


def _more(f: IO[bytes]) -> bool:
    """Whether f has bytes past its position (what was appended while we waited)."""
    return os.fstat(f.fileno()).st_size > f.tell()
