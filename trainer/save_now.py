"""Save-now requests: SIGUSR1 or SIGTERM on a trainer task. The supervisor sends SIGUSR1
(`scancel --signal=USR1` to the trainer step) when SLURM's grace before a preemption or the time
limit is too short to wait for the rollout boundary; SLURM sends SIGTERM KillWait seconds before
SIGKILL when it ends the job outright (scancel, `scontrol requeue`, a preemption without grace):
a save that fits in those seconds keeps the work, one that does not is never half-visible. Rank 0 then abandons the rollout it is generating (it is redone,
identically, after the resume); a rank that is training finishes that rollout's optimizer steps,
skips the publish and saves. Installed first thing in `python -m trainer`, so the signal never
kills a trainer that is still loading.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class SaveNow(BaseException):
    """Raised in rank 0's rollout generation: abandon it. (BaseException: no `except Exception`
    on the way may swallow it.)"""


class SaveNowSignal:
    def __init__(self) -> None:
        self.requested = False
        self._abandonable = False
        for signum in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        if self._abandonable:
            self._abandonable = False
            raise SaveNow()

    @contextmanager
    def abandonable(self) -> Iterator[None]:
        """Work that a save-now request interrupts at once (by raising SaveNow inside it)."""
        if self.requested:
            raise SaveNow()
        self._abandonable = True
        try:
            yield
        finally:
            self._abandonable = False


_installed: SaveNowSignal | None = None


def install() -> SaveNowSignal:
    global _installed
    if _installed is None:
        _installed = SaveNowSignal()
    return _installed
