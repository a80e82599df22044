"""--colocate: who holds the GPUs the trainer and the engines share, the trainer or the engines.

The trainer says (control call gpu_holder, trainer.colocation): "trainer" once it released the
engines' memory, before it onloads; "engines" once it offloaded and resumed them. While the
trainer holds them, no engine step starts (a restart waits: a starting engine loads its weights
and allocates its KV cache, the peak the trainer must not meet) and the engines are not probed
(released, SGLang does not answer /health_generate). The switch to the trainer waits out the
engine starts already under way, so that the trainer onloads only once every live engine is
released. GpuHolder owns that word and the count of starts, under its condition's lock; the word and the
released engines are also kept in supervisor_state.json, so a restarted supervisor keeps them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

ENGINES, TRAINER = "engines", "trainer"
RELEASED_TAGS = ["weights", "kv_cache"]  # trainer.colocation's ALL_TAGS
_WAIT_POLL_S = 1.0  # a waiting engine start looks this often whether the job is ending


class GpuHolder:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holder = ENGINES
        self._starting = 0
        self._released: set[str] = set()  # engines released for the trainer's turn (their urls)

    @property
    def trainer_holds(self) -> bool:
        with self._cond:
            return self._holder == TRAINER

    def to_trainer(self, starts_timeout_s: float) -> bool:
        """No engine starts from now on; waits until the starts under way are over (False if
        some still run after starts_timeout_s: the engine start timeout, which ends them anyway)."""
        with self._cond:
            self._holder = TRAINER
            return self._cond.wait_for(lambda: self._starting == 0, starts_timeout_s)

    def restore(self, holder: str, released: list[str]) -> None:
        """A restarted supervisor takes over its predecessor's word (kept in supervisor_state.json)."""
        with self._cond:
            self._holder, self._released = holder, set(released)
            self._cond.notify_all()

    def released(self, urls: list[str]) -> None:
        with self._cond:
            self._released.update(urls)

    def to_engines(self) -> list[str]:
        """Back to the engines; returns the engines released for the trainer's turn (a trainer
        that died in it left them released: the caller resumes them)."""
        with self._cond:
            self._holder = ENGINES
            released, self._released = sorted(self._released), set()
            self._cond.notify_all()
            return released

    @contextmanager
    def engine_start(self, finished: threading.Event) -> Iterator[bool]:
        """Around an engine's launch and wait until it answers: waits while the trainer holds the
        GPUs; yields False (start nothing) when the job ends meanwhile."""
        with self._cond:
            while self._holder == TRAINER and not finished.is_set():
                self._cond.wait(_WAIT_POLL_S)
            go = not finished.is_set()
            self._starting += go
        try:
            yield go
        finally:
            if go:
                with self._cond:
                    self._starting -= 1
                    self._cond.notify_all()
