"""Save-now requests: SIGUSR1 or SIGTERM on a trainer task. The supervisor sends SIGUSR1
(`scancel --signal=USR1` to the trainer step) when SLURM's grace before a preemption or the time
limit is too short to wait for the rollout boundary; SLURM sends SIGTERM KillWait seconds before
SIGKILL when it ends the job outright (scancel, `scontrol requeue`, a preemption without grace):
a save that fits in those seconds keeps the work, one that does not is never half-visible. Rank 0
then abandons the rollout it is generating (it is redone, identically, after the resume); a rank
that is training finishes that rollout's optimizer steps, skips the publish and saves. Installed
first thing in `python -m trainer`, so the signal never kills a trainer that is still loading.
"""

from __future__ import annotations

import atexit
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any


class SaveNow(BaseException):
    """Raised in rank 0's rollout generation: abandon it. (BaseException: no `except Exception`
    on the way may swallow it.)"""


SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class SaveNowSignal:
    def __init__(self) -> None:
        self.requested = False
        self._abandonable = False
        self.take_signals()

    def take_signals(self) -> None:
        """Put Python's handler in front of SIGUSR1 and SIGTERM again. A library can set its own C
        handler over it: Triton, loaded by torch.compile's first GPU kernel, sets LLVM's stack-trace
        handlers (triton-lang/triton#4129), which take SIGUSR1 as LLVM's "info" signal and never pass
        it on (seen on H100 and H200, torch 2.11: the supervisor's save-now was lost); Python's
        signal.getsignal does not see that. LLVM sets them once per process, so a signal is lost only
        between the first compile and the loop's next call here."""
        for signum in SIGNALS:
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
        atexit.register(_ignore_save_now_at_exit)
    return _installed


def _ignore_save_now_at_exit() -> None:
    """Python gives SIGUSR1 its default action back (end the process) as it shuts down: the
    supervisor's save-now signal reaching a trainer that saved and is exiting would end it with
    code 138, which reads as a failure. Past the loop there is nothing to save: ignore it."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


class StopRequests:
    """Whether the loop stops, decided by rank 0 and broadcast (collective): before a rollout, on
    a save-now request or the supervisor's stop (whose answer may also arm the profiler); after
    training, on a save-now request that came meanwhile (the publish is then skipped)."""

    def __init__(self, signal: SaveNowSignal, poll: Callable[[int], tuple[bool, dict[str, Any] | None]] | None,
                 broadcast: Callable[[Any], Any], arm_profiler: Callable[[dict[str, Any]], None]) -> None:
        """poll: rank 0's supervisor link (stop?, profile request); None without a supervisor."""
        self.signal = signal
        self.poll = poll
        self.broadcast = broadcast
        self.arm_profiler = arm_profiler

    def before_rollout(self, rollout_id: int) -> bool:
        self.signal.take_signals()  # the train step may have compiled a GPU kernel (Triton: see take_signals)
        stop, profile = self.signal.requested, None
        if not stop and self.poll:
            stop, profile = self.poll(rollout_id)
        stop, profile = self.broadcast((stop, profile))
        if profile:
            self.arm_profiler(profile)
        return bool(stop)

    def after_train(self) -> bool:
        self.signal.take_signals()
        return bool(self.broadcast(self.signal.requested))
