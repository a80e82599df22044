"""The scheduler thread: owns the model and runs continuous batching.

Each iteration it (1) runs queued commands (pause, abort, weight loads, ...) from the HTTP
handlers, (2) admits waiting sequences up to --max-running-requests, and (3) runs one forward
pass that advances every running sequence by one token (a newly admitted one is prefilled in
the same pass). Sequences join and leave between passes. Only this thread touches the model,
the queues and the weight version, so a pass never sees weights half loaded.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

import torch

from rollout.cpu_engine.codec import Codec
from rollout.cpu_engine.kv_batch import SequenceCache, step
from rollout.cpu_engine.sampling import sample_next
from rollout.cpu_engine.sequence import Sequence

PAUSE_MODES = ("abort", "retract", "in_place")
FORWARD_STEP = "cpu_engine.forward_step"


@dataclass
class _Command:
    fn: Callable[[], Any]
    future: Future
    needs_idle: bool  # weight loads wait until no sequence runs, unless generation is paused


class Scheduler:
    def __init__(self, model: torch.nn.Module, codec: Codec, weight_version: str, max_running: int,
                 batch_invariant: bool = False, step_hold_s: float = 0.0) -> None:
        """step_hold_s (--decode-step-hold-ms): a simulated GPU step time, slept before each pass."""
        self.model = model
        self._batch_invariant = batch_invariant
        self._step_hold_s = step_hold_s
        self.codec = codec
        self.weight_version = weight_version
        self._max_running = max_running
        self._cond = threading.Condition()
        # Shared with handler threads, under _cond:
        self._inbox: list[Sequence] = []
        self._commands: deque[_Command] = deque()
        self._stopping = False
        self._stats = {"forward_passes": 0, "generated_tokens": 0, "max_batch_size": 0,
                       "running_requests": 0, "waiting_requests": 0, "paused": False}
        self._last_output = 0.0
        self._output_waiters: list[tuple[float, Future]] = []
        # Owned by the scheduler thread:
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._idle_commands: deque[_Command] = deque()
        self._paused = False
        self._holds = 0  # open /begin_weight_update windows: no new requests start
        self.on_step: Callable[[], None] | None = None  # after each forward step (the profiler's count)
        self._thread = threading.Thread(target=self._loop, name="cpu-engine-scheduler", daemon=True)

    # ---- called from other threads ----

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Abort everything still queued or running, fail pending commands, end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()

    def submit(self, seqs: list[Sequence]) -> None:
        with self._cond:
            if self._stopping:
                for seq in seqs:
                    seq.finish({"type": "abort", "message": "the server is shutting down"}, self.weight_version)
                return
            self._inbox.extend(seqs)
            self._cond.notify_all()

    def call(self, fn: Callable[[], Any], needs_idle: bool = False) -> Future:
        """Run fn on the scheduler thread between passes; the future gets its result or error."""
        command = _Command(fn, Future(), needs_idle)
        with self._cond:
            if self._stopping:
                resolve(command.future, error=RuntimeError("the server is shutting down"))
            else:
                self._commands.append(command)
                self._cond.notify_all()
        return command.future

    def output_after(self, since: float) -> Future:
        """A future resolved at the first forward pass that ends after `since` (time.monotonic)."""
        future: Future = Future()
        with self._cond:
            if self._last_output > since:
                resolve(future, True)
            else:
                self._output_waiters.append((since, future))
        return future

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return dict(self._stats)

    # ---- commands (run on the scheduler thread through call()) ----

    def pause(self, mode: str) -> None:
        """abort: end every request now; retract: free running requests' caches and requeue them
        (they re-prefill prompt + output on continue); in_place: keep them as they are."""
        if mode == "abort":
            self._abort(None, "generation paused with mode abort")
        elif mode == "retract":
            for seq in reversed(self._running):
                seq.kv = None
                self._waiting.appendleft(seq)
            self._running = []
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    def hold_admission(self, delta: int) -> None:
        self._holds = max(0, self._holds + delta)

    def abort(self, rid: str | None, message: str = "aborted by /abort_request") -> None:
        """rid None aborts everything; otherwise every request whose id starts with rid (SGLang
        matches by prefix so that the n copies `rid_0..rid_{n-1}` of one request go together)."""
        self._abort(rid, message)

    def queued(self) -> int:
        return len(self._running) + len(self._waiting)

    # ---- the thread ----

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._has_work)
                self._waiting.extend(self._inbox)
                self._inbox.clear()
                commands = list(self._commands)
                self._commands.clear()
                stopping = self._stopping
            if stopping:
                self._abort(None, "the server is shutting down")
                for command in commands + list(self._idle_commands):
                    resolve(command.future, error=RuntimeError("the server is shutting down"))
                return
            for command in commands:
                if command.needs_idle:
                    self._idle_commands.append(command)
                else:
                    self._run(command)
            if self._idle_commands and (self._paused or not self._running):
                self._run(self._idle_commands.popleft())
            if not self._paused:
                self._admit()
                if self._running:
                    self._step()
            self._publish_stats()

    def _has_work(self) -> bool:  # called with _cond held
        if self._stopping or self._inbox or self._commands:
            return True
        if self._idle_commands and (self._paused or not self._running):
            return True
        if self._paused:
            return False
        return bool(self._running) or any(self._admissible(seq) for seq in self._waiting)

    def _admissible(self, seq: Sequence) -> bool:
        # The engine's own probes are not held back by a weight update, only by a pause.
        return seq.internal or (self._holds == 0 and not self._idle_commands)

    def _admit(self) -> None:
        kept: deque[Sequence] = deque()
        while self._waiting:
            seq = self._waiting.popleft()
            if len(self._running) >= self._max_running or not self._admissible(seq):
                kept.append(seq)
            elif seq.params.max_new_tokens == 0:
                self._finish(seq, {"type": "length", "length": 0})
            elif seq.output_ids and (reason := seq.check_finished(self.codec.eos_ids, self.codec)):
                self._finish(seq, reason)  # a decode engine's request, done with its prefill engine's token
            else:
                self._running.append(seq)
        self._waiting = kept

    def _step(self) -> None:
        batch = self._running
        if self._step_hold_s:
            time.sleep(self._step_hold_s)  # a GPU computing the step: the host waits, its CPU free
        try:
            with torch.profiler.record_function(FORWARD_STEP):  # one range per step in a profile's trace
                logits, caches = self._forward(batch)
            still_running = []
            for seq, row, cache in zip(batch, logits, caches):
                seq.kv = cache
                seq.append(sample_next(row, seq.params, seq.generator, seq.banned_tokens(self.codec.eos_ids),
                                       seq.top_logprobs_num if seq.return_logprob else 0))
                reason = seq.check_finished(self.codec.eos_ids, self.codec)
                if reason is None:
                    still_running.append(seq)
                else:
                    self._finish(seq, reason)
        except Exception as err:  # a failed pass must not kill the engine: fail its requests
            traceback.print_exc()
            for seq in batch:
                if not seq.done.done():
                    self._finish(seq, {"type": "abort", "message": f"engine error: {err}"})
            still_running = []
        self._running = still_running
        with self._cond:
            self._stats["forward_passes"] += len(batch) if self._batch_invariant else 1
            self._stats["generated_tokens"] += len(batch)
            self._stats["max_batch_size"] = max(self._stats["max_batch_size"], len(batch))
            self._last_output = time.monotonic()
            for _, future in self._output_waiters:
                resolve(future, True)
            self._output_waiters.clear()
        if self.on_step is not None:
            self.on_step()

    def _forward(self, batch: list[Sequence]) -> tuple[torch.Tensor, list[SequenceCache]]:
        """Next-token logits and grown caches of `batch` (rollout.cpu_engine.kv_batch.step)."""
        return step(self.model, [seq.pending_tokens() for seq in batch], [seq.kv for seq in batch],
                    alone=self._batch_invariant)

    def _abort(self, rid: str | None, message: str) -> None:
        def hit(seq: Sequence) -> bool:
            return rid is None or seq.rid.startswith(rid)

        for seq in [s for s in self._running if hit(s)] + [s for s in self._waiting if hit(s)]:
            self._finish(seq, {"type": "abort", "message": message})
        self._running = [s for s in self._running if not hit(s)]
        self._waiting = deque(s for s in self._waiting if not hit(s))

    def _finish(self, seq: Sequence, reason: dict[str, Any]) -> None:
        seq.finish(reason, self.weight_version)
        if not seq.internal:
            # One line per served request, so tests and operators can check no request was
            # served with stale weights.
            print(f"cpu_engine served rid={seq.rid} weight_version={seq.weight_version} "
                  f"prompt_tokens={len(seq.prompt_ids)} completion_tokens={len(seq.output_ids)} "
                  f"finish={reason['type']}", flush=True)

    def _run(self, command: _Command) -> None:
        try:
            result, failure = command.fn(), None
        except Exception as err:
            result, failure = None, err
        self._publish_stats()  # so that a caller sees the command's effect once it returns
        resolve(command.future, result, failure)

    def _publish_stats(self) -> None:
        with self._cond:
            self._stats.update(running_requests=len(self._running), waiting_requests=len(self._waiting),
                               paused=self._paused)


def resolve(future: Future, value: Any = None, error: BaseException | None = None) -> None:
    """Set a future's outcome unless its waiter has already given up on it (cancelled it)."""
    try:
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)
    except InvalidStateError:
        pass
