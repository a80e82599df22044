"""slime's train_async.py (--train-async): rollout N+1 is generated on the engines while rollout N
trains, so each rollout is trained one step off-policy (its staleness, the trainer's version minus
the version that generated it, is 1; up to --update-weights-interval).

    rollout(N)      take rollout N (waiting while it is still generated), then start N+1 in the
                    background with the weights the engines serve
    settle          the trainer is about to publish (every --update-weights-interval rollouts) or
                    to checkpoint: wait for the rollout in flight, as slime syncs the generation
                    before update_weights; a checkpoint never holds half a rollout
    stop_generating the trainer stops (save-now, the supervisor's stop): the rollout in flight is
                    stopped at once (rollout.round_stop); with --partial-rollout its groups go back
                    to the data buffer with the tokens they have, else the buffer is put back as it
                    was before that rollout (its prompts are generated again, identically)

The state that makes a resume exact (common.pt): the data buffer after the last rollout generated,
and that rollout ("ahead") while it is not trained yet, with its samples. A resumed trainer trains
it first, sending no request; a rollout that was in flight is not in the checkpoint (the buffer is
as before it), and the rollout journal replays it if it was finished before a crash.

Rank 0 generates in one background thread (each round runs its own event loop there); the other
ranks get every rollout by broadcast. A save-now signal while rank 0 waits stops the round too.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from contract.job_dir import Phase
from rollout.engine_idle import EngineIdle
from rollout.round_stop import RoundStop, RoundStopped
from rollout.sample import Sample
from trainer.rollout_source import (
    AHEAD_KEY,
    DATA_BUFFER_KEY,
    ENGINE_WAIT_RATIO,
    Broadcast,
    Heartbeat,
    Rollout,
    RolloutGenerator,
    RolloutSource,
    SampleGroup,
)
from trainer.save_now import SaveNow, SaveNowSignal

log = logging.getLogger(__name__)

WAIT_POLL_S = 0.5  # rank 0 waiting for a rollout wakes this often (a signal's handler runs between waits)
STOP_WAIT_S = 30.0  # bound on a stopped round handing its groups back; past it, its buffer is as before it


@dataclass
class _Generated:
    rollout_id: int
    groups: list[list[Sample]]
    metrics: dict[str, Any]

    def to_state(self) -> dict[str, Any]:
        return {"rollout_id": self.rollout_id, "metrics": self.metrics,
                "groups": [[s.to_dict() for s in group] for group in self.groups]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> _Generated:
        return cls(state["rollout_id"], [[Sample.from_dict(s) for s in g] for g in state["groups"]], state["metrics"])


@dataclass
class _InFlight:
    """A rollout being generated in the background thread."""
    rollout_id: int
    buffer_before: dict[str, Any] | None  # the low-water mark: what a checkpoint holds while it runs
    stop: RoundStop = field(default_factory=RoundStop)
    done: threading.Event = field(default_factory=threading.Event)
    result: _Generated | None = None
    error: BaseException | None = None


def tagged(rollout: _Generated, train_samples: Any) -> Rollout:
    """The groups tagged with the oldest version that generated their samples."""
    groups = [SampleGroup(min((s.weight_version or 0 for s in group), default=0), samples)
              for group, samples in zip(rollout.groups, train_samples(rollout.groups))]
    return Rollout(rollout.rollout_id, groups, dict(rollout.metrics))


class AheadRolloutSource(RolloutSource):
    def __init__(self, generator: RolloutGenerator | None, broadcast: Broadcast, heartbeat: Heartbeat,
                 signal: SaveNowSignal, num_rollout: int) -> None:
        """generator: rank 0's; None on the other ranks, which receive the rollouts."""
        self.generator = generator
        self.broadcast = broadcast
        self.heartbeat = heartbeat
        self.signal = signal
        self.num_rollout = num_rollout
        self.ready: _Generated | None = None  # generated, not yet taken by the loop
        self.in_flight: _InFlight | None = None
        self.idle = EngineIdle()  # no rollout generating

    def rollout(self, rollout_id: int, weight_version: int) -> Rollout | None:
        rollout = None
        if self.generator:
            self.heartbeat(Phase.ROLLOUT, rollout_id)
            if self.ready is None and self.in_flight is None:
                self._start(rollout_id)  # the first rollout (or the first after a resume)
            if self._wait_abandonable():
                generated = self._take(rollout_id)
                rollout = tagged(generated, self.generator.train_samples)
                rollout.metrics[ENGINE_WAIT_RATIO] = self.idle.take()
                if rollout_id + 1 < self.num_rollout:
                    self._start(rollout_id + 1)
        return self.broadcast(rollout)

    def settle(self, publishing: bool) -> bool:
        return self._wait_abandonable()

    def stop_generating(self) -> None:
        flight = self.in_flight
        if flight is None or self.generator is None:
            return
        flight.stop.request()
        if not flight.done.wait(STOP_WAIT_S):  # (a --rollout-function-path cannot be stopped)
            log.warning("rollout %d did not stop within %.0f s: its prompts are generated again after the resume",
                        flight.rollout_id, STOP_WAIT_S)
            return  # still in flight: state_dict holds the buffer as before it
        self.in_flight = None
        buffer = self.generator.buffer
        if flight.result is not None:
            self.ready = flight.result  # it finished first: trained after the resume
        elif isinstance(flight.error, RoundStopped) and self.generator.rollout_args.partial_rollout:
            log.info("rollout %d stopped: its groups wait in the data buffer with their tokens", flight.rollout_id)
        elif buffer is not None and flight.buffer_before is not None:
            buffer.load_state_dict(flight.buffer_before)  # its prompts are generated again, identically

    def close(self) -> None:
        if self.in_flight is not None:
            self.in_flight.stop.request()  # the daemon thread ends with the round, or with the process

    # ---- the checkpoint
    def state_dict(self) -> dict[str, Any]:
        if self.generator is None:
            return {}
        flight, buffer = self.in_flight, self.generator.buffer
        if flight is not None:  # not settled (a stop that timed out): the buffer as before that rollout
            return {DATA_BUFFER_KEY: flight.buffer_before, AHEAD_KEY: None}
        return {DATA_BUFFER_KEY: buffer.state_dict() if buffer else None,
                AHEAD_KEY: self.ready.to_state() if self.ready else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.generator is None:
            return
        self.generator.load_state_dict(state)
        self.ready = _Generated.from_state(state[AHEAD_KEY]) if state.get(AHEAD_KEY) else None

    # ---- the background round
    def _start(self, rollout_id: int) -> None:
        assert self.generator is not None and self.in_flight is None and self.ready is None
        buffer = self.generator.buffer
        flight = _InFlight(rollout_id, buffer.state_dict() if buffer else None)
        self.in_flight = flight
        self.idle.mark(False)
        threading.Thread(target=self._generate, args=(flight,), name=f"rollout-{rollout_id}", daemon=True).start()

    def _generate(self, flight: _InFlight) -> None:
        assert self.generator is not None
        try:
            groups, metrics = self.generator.generate_samples(flight.rollout_id, flight.stop)
            flight.result = _Generated(flight.rollout_id, groups, metrics)
        except BaseException as err:  # noqa: BLE001 - raised again in the loop's thread
            flight.error = err
        finally:
            self.idle.mark(True)
            flight.done.set()

    def _wait_abandonable(self) -> bool:
        """Wait for the rollout in flight; False if a save-now request came meanwhile (it is stopped)."""
        flight = self.in_flight
        if flight is None:
            return True
        try:
            with self.signal.abandonable():
                while not flight.done.wait(WAIT_POLL_S):
                    pass
        except SaveNow:
            self.stop_generating()
            return False
        self.in_flight = None
        if flight.error is not None:
            raise flight.error
        self.ready = flight.result
        return True

    def _take(self, rollout_id: int) -> _Generated:
        generated, self.ready = self.ready, None
        assert generated is not None and generated.rollout_id == rollout_id, (generated, rollout_id)
        return generated
