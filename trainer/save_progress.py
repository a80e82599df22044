"""A checkpoint save's progress, as the supervisor sees it: while rank 0 saves, the trainer's
heartbeat beats again whenever the save moved on (a file appeared or grew in the checkpoint's
temporary folder, written by any rank; or rank 0 fsync'd one more file), at most once every
SAVE_PROGRESS_POLL_S. So `trainer_save_timeout` bounds the time a save makes no progress, not the
whole save: a slow filesystem (seconds per fsync) is not taken for a hung trainer."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

SAVE_PROGRESS_POLL_S = 1.0  # between two looks at the save's folder (and so between two beats at most)


class SaveProgress:
    """A context manager around a save into `folder`: a thread calls `beat` after each poll that
    saw progress. `moved()` tells it of progress the folder does not show (an fsync)."""

    def __init__(self, folder: Path, beat: Callable[[], None], poll_s: float = SAVE_PROGRESS_POLL_S) -> None:
        self.folder = folder
        self.beat = beat
        self.poll_s = poll_s
        self._moves = 0  # progress the folder does not show; written by the saving thread only
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="save-progress", daemon=True)

    def moved(self) -> None:
        self._moves += 1

    def __enter__(self) -> SaveProgress:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        seen = self._signature()
        while not self._done.wait(self.poll_s):
            now = self._signature()
            if now != seen:
                seen = now
                try:
                    self.beat()
                except OSError as err:  # a beat lost (the disk filled) must not end the save
                    log.warning("heartbeat during the save: %s", err)

    def _signature(self) -> tuple[int, int, int]:
        """(moves, files, bytes) of the save so far."""
        files = size = 0
        for path in self.folder.rglob("*"):
            try:
                stat = path.stat()
            except OSError:  # renamed or removed meanwhile (a writer's own temporary file)
                continue
            files += 1
            size += stat.st_size
        return self._moves, files, size
