"""The fully asynchronous rollout's worker (slime's `slime.rollout.fully_async_rollout`, with miles'
flags): prompt groups keep generating on the engines across rollout boundaries, and the trainer
takes finished ones (trainer.fully_async_source). Where every group is: rollout.group_ledger.

- The groups in flight and finished at once are at most the ledger's capacity
  (--async-data-buffer-capacity-factor x --rollout-batch-size, miles'): generation runs that far
  ahead of training and no further; a new group goes out as soon as there is room.
- A weight update pauses the engines (`hold`, then `release` with the new version) in
  --pause-generation-mode: abort (the engines end every request; their groups go back to pending
  and start again from their prompts, as slime's fully async rollout does), retract (the engines
  keep each request with its tokens, recompute its cache after the update and continue) or
  in_place (the same, keeping the cache). A sample continued across an update has tokens of two
  versions; its staleness counts from the older (Sample.oldest_weight_version).
- `stop` ends generation now: what is running is aborted and each group goes back to pending
  with the tokens it has, to continue from them after a resume.

Threads: the worker's event loop runs in a thread of its own; `start`, `hold`, `release`, `wake`
and `stop` are called from the trainer's thread and run their part in that loop. The ledger has
its own lock; the idle clock its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from rollout.engine_idle import EngineIdle
from rollout.group_generate import DONE, GroupGenerator
from rollout.group_ledger import GroupLedger, group_id
from rollout.request_deadline import ABORT_GRACE_S
from rollout.request_transport import RequestTransport
from rollout.rollout_args import RolloutArgs
from rollout.sample import Sample
from rollout.sample_errors import nothing_trainable

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")  # --pause-generation-mode (miles'; SGLang's /pause_generation)
START_WAIT_S = 30.0  # bound on the worker's thread starting its event loop
CALL_WAIT_S = 30.0  # bound on one of the trainer's calls (hold, release) running in the worker's loop


class FullyAsyncWorker:
    def __init__(self, args: RolloutArgs, ledger: GroupLedger) -> None:
        self.args = args
        self.ledger = ledger
        self.version: int | None = None  # what the engines serve
        self.halting = False  # an aborted sample is not continued (a pause with mode abort, a stop)
        self.stopping = False
        self.error: BaseException | None = None  # what ended the worker: the trainer raises it
        self.idle = EngineIdle()
        self._held = False
        self._running = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._window = (0, 0, 0)  # the generator's (finished samples, failed, scored groups) at the last check

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self, version: int) -> None:
        self.version = version
        ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main(ready)), name="fully-async-rollout",
                                        daemon=True)
        self._thread.start()
        if not ready.wait(START_WAIT_S):
            raise RuntimeError(f"the fully async rollout's worker did not start within {START_WAIT_S:.0f} s")

    def hold(self, abort: bool) -> None:
        """No new group goes out until `release`; with `abort`, aborted samples are not continued
        (their groups start again from their prompts)."""
        def hold() -> None:
            self._held, self.halting = True, abort
        self._call(hold)

    def release(self, version: int) -> None:
        def release() -> None:
            self.version, self._held, self.halting = version, False, False
        self._call(release)

    def wake(self) -> None:
        """There may be room in the ledger (the trainer took a rollout)."""
        if self._loop is not None and self._wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed
                self._loop.call_soon_threadsafe(self._wake.set)

    def stop(self, timeout_s: float) -> bool:
        """Abort what is generating; each group goes back to pending with its tokens. False if the
        worker did not end within timeout_s (the ledger then holds those groups as they were sent)."""
        if self._thread is None:
            return True
        self.stopping = self.halting = True
        self.wake()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # ---- the worker's thread
    def _call(self, fn: Callable[[], None]) -> None:
        async def run() -> None:
            fn()
            self._account()
            assert self._wake is not None
            self._wake.set()
        if self._loop is None:
            fn()
            return
        _wait(asyncio.run_coroutine_threadsafe(run(), self._loop).result, CALL_WAIT_S)

    async def _main(self, ready: threading.Event) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        transport = RequestTransport(
            self.args.router_url, self.args.api_key, router_timeout_s=self.args.router_timeout_s,
            concurrency=self.args.rollout_concurrency, retry_timeout_s=self.args.retry_timeout_s,
            check_timeout_s=self.args.engine_check_timeout_s, decode_speed=self.args.decode_speed,
            counts=self.args.request_counts, on_failure=self.args.engine_failure_handler,
            on_unresponsive=self.args.engine_unresponsive_handler)
        self.groups = GroupGenerator(self.args, transport, 0, False, halted=lambda: self.halting,
                                     served_version=lambda: self.version)
        tasks: set[asyncio.Task[None]] = set()
        ready.set()
        async with transport, self.groups.remote_rm or contextlib.nullcontext():
            while not self.stopping:
                while not self._held and not self.stopping and self.ledger.room():
                    task = asyncio.create_task(self._generate(self.ledger.take()))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                self._account()
                await self._wake.wait()
                self._wake.clear()
            transport.stop()
            if tasks:
                await transport.abort_all()
            if tasks:  # (each task leaves the set as it ends)
                await asyncio.wait(set(tasks), timeout=ABORT_GRACE_S)
        self.idle.mark(True)

    async def _generate(self, group: list[Sample]) -> None:
        self._running += 1
        try:
            samples = await self.groups.group(group)
            if samples is None:
                self.ledger.dropped(group_id(group))  # a user function failed on it
            elif all(s.status in DONE for s in samples):
                self.ledger.generated(samples)
            elif self.stopping:
                self.ledger.stopped(samples)
            else:
                self.ledger.requeued(samples)  # aborted by a weight update's pause (mode abort)
            self._stop_if_nothing_trainable()
        except Exception as err:  # a user function that fails every time, no engine at all
            log.error("the fully async rollout stops: %s", err)
            self.error, self.stopping = err, True
        finally:
            self._running -= 1
            assert self._wake is not None
            self._wake.set()

    def _stop_if_nothing_trainable(self) -> None:
        """The round's rule (generate.py) over each rollout's worth of finished samples: every one
        failed, or no group was scored."""
        g, (finished, failed, scored) = self.groups, self._window
        if g.finished_samples - finished < self.args.rollout_batch_size * self.args.n_samples_per_prompt:
            return
        errors = g.failed[failed:]
        if errors and (len(errors) >= g.finished_samples - finished or g.scored_groups == scored):
            raise nothing_trainable(errors, g.finished_samples - finished, g.dropped_groups, -1)
        self._window = (g.finished_samples, len(g.failed), g.scored_groups)

    def _account(self) -> None:
        self.idle.mark(self._held or self._running == 0)


def _wait(result: Callable[[float], Any], timeout_s: float) -> Any:
    try:
        return result(timeout_s)
    except TimeoutError:
        raise RuntimeError(f"the fully async rollout's worker did not answer within {timeout_s:.0f} s") from None

