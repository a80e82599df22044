"""The fully asynchronous rollout as the loop's source: `--rollout-function-path
slime.rollout.fully_async_rollout.generate_rollout_fully_async` (slime's path; miles' flags).

Rank 0's worker (rollout.fully_async) keeps groups generating across rollout boundaries; rollout N
is the first --rollout-batch-size groups to finish, once groups beyond --max-weight-staleness have
gone by --async-unused-samples-handler (staleness: the trainer's version now, which trains them,
minus the oldest version that generated them). Before each publish the engines are paused in
--pause-generation-mode and continued after it; a stop aborts what is generating and keeps its
tokens. Every group is accounted for by the ledger (rollout.group_ledger, which says why nothing is
lost or trained twice): its state is this source's part of a checkpoint, and the rollout journal's
entry for each rollout taken holds that rollout's groups and the ledger right after; a resume
replays the entries before the worker starts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from contract.job_dir import Phase
from rollout import debug_data
from rollout.engine_client import EngineClient, EngineError
from rollout.fully_async import FullyAsyncWorker
from rollout.group_ledger import GroupLedger
from rollout.request_transport import RETRIED_METRIC
from rollout.sample import Sample
from rollout.sample_errors import METRIC as SAMPLE_ERRORS
from trainer.rollout_journal import RolloutJournal
from trainer.rollout_source import ENGINE_WAIT_RATIO, Broadcast, Heartbeat, Rollout, RolloutSource, SampleGroup
from trainer.save_now import SaveNow, SaveNowSignal
from trainer.train_data import TrainData

log = logging.getLogger(__name__)

LEDGER_KEY = "async_ledger"  # in the trainer state of a checkpoint (common.pt)
WAIT_POLL_S = 0.5  # rank 0 waiting for finished groups wakes this often (signals, the worker's error)
STOP_WAIT_S = 30.0  # bound on the worker ending after a stop (the ledger holds what did not come back)
ENGINE_CALL_TIMEOUT_S = 30.0  # one engine's /pause_generation or /continue_generation
# Each rollout's line (miles' rollout/fully_async/* under slurmrl's async/ prefix)
QUEUE, IN_FLIGHT = "async/queue_groups", "async/in_flight_groups"
DROPPED_STALE, RETRIED_STALE = "async/dropped_stale_samples", "async/retried_stale_samples"
REQUEUED = "async/requeued_groups"


@dataclass(frozen=True)
class FullyAsyncOptions:
    batch: int  # groups per rollout (--rollout-batch-size)
    max_staleness: int | None  # --max-weight-staleness
    unused_handler: str  # --async-unused-samples-handler: drop | retry
    pause_mode: str  # --pause-generation-mode: abort | retract | in_place
    train_data: TrainData  # how the samples become the trainer's (--reward-key, slime's conversion plug-ins)


class FullyAsyncSource(RolloutSource):
    def __init__(self, worker: FullyAsyncWorker | None, journal: RolloutJournal | None,
                 engines: Callable[[], list[str]], client: EngineClient | None, options: FullyAsyncOptions,
                 broadcast: Broadcast, heartbeat: Heartbeat, signal: SaveNowSignal) -> None:
        """worker, client: rank 0's (None on the other ranks, which receive the rollouts)."""
        self.worker = worker
        self.ledger: GroupLedger | None = worker.ledger if worker else None
        self.journal = journal
        self.engines = engines
        self.client = client
        self.options = options
        self.broadcast = broadcast
        self.heartbeat = heartbeat
        self.signal = signal
        self.served = 0  # the version the engines serve
        self._counted = (0, 0)  # sample errors, requests retried: the totals at the last rollout

    def rollout(self, rollout_id: int, weight_version: int) -> Rollout | None:
        rollout = None
        if self.worker:
            self.heartbeat(Phase.ROLLOUT, rollout_id)
            groups = self._replayed(rollout_id)
            if groups is None:
                groups = self._take(rollout_id, weight_version)
            if groups is not None:
                rollout = Rollout(rollout_id, self._tagged(groups), self._metrics())
        return self.broadcast(rollout)

    def settle(self, publishing: bool) -> bool:
        if publishing and self.worker and self.worker.started:
            self.worker.hold(abort=self.options.pause_mode == "abort")
            self._each_engine("/pause_generation", {"mode": self.options.pause_mode})
        return True

    def published(self, version: int) -> None:
        self.served = version
        if self.worker and self.worker.started:
            self._each_engine("/continue_generation", {})
            self.worker.release(version)

    def stop_generating(self) -> None:
        if self.worker and not self.worker.stop(STOP_WAIT_S):
            log.warning("the fully async rollout did not stop within %.0f s: the groups still generating "
                        "start again from where they were sent after the resume", STOP_WAIT_S)

    def close(self) -> None:
        self.stop_generating()

    # ---- the checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {LEDGER_KEY: self.ledger.state_dict()} if self.ledger else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.ledger and state.get(LEDGER_KEY):
            self.ledger.load_state_dict(state[LEDGER_KEY])

    # ---- rank 0
    def _replayed(self, rollout_id: int) -> list[list[Sample]] | None:
        """Rollout `rollout_id` from the journal (taken before a restart from the same checkpoint),
        the ledger as right after it; only before the worker started (entries come in order)."""
        assert self.worker is not None and self.ledger is not None
        done = self.journal.replay(rollout_id) if self.journal and not self.worker.started else None
        if done is None:
            return None
        groups, ledger_state = done
        if ledger_state is not None:
            self.ledger.load_state_dict(ledger_state)
        log.info("rollout %d: replayed from the rollout journal (taken before the restart)", rollout_id)
        return groups

    def _take(self, rollout_id: int, trainer_version: int) -> list[list[Sample]] | None:
        """The next rollout's groups as they finish; None if a save-now came meanwhile."""
        worker, ledger, o = self.worker, self.ledger, self.options
        assert worker is not None and ledger is not None
        if not worker.started:
            self._each_engine("/continue_generation", {})  # a trainer that died may have left them paused
            worker.start(self.served)
        try:
            with self.signal.abandonable():
                while (groups := ledger.take_ready(o.batch, trainer_version, o.max_staleness,
                                                   o.unused_handler)) is None:
                    if worker.error is not None:
                        raise worker.error
                    ledger.wait(WAIT_POLL_S)
        except SaveNow:
            self.stop_generating()
            return None
        worker.wake()  # room for more
        if self.journal:
            self.journal.record(rollout_id, groups, ledger.state_dict())
        if worker.args.save_debug_rollout_data:  # slime's dump of what the rollout trains on
            debug_data.save(worker.args.save_debug_rollout_data, rollout_id, [s for g in groups for s in g])
        return groups

    def _metrics(self) -> dict[str, Any]:
        assert self.worker is not None and self.ledger is not None
        counts, ready, in_flight = self.ledger.report()
        args = self.worker.args
        errors, retried = args.sample_errors.total, args.request_counts.retried
        (last_errors, last_retried), self._counted = self._counted, (errors, retried)
        return {QUEUE: ready, IN_FLIGHT: in_flight, DROPPED_STALE: counts.dropped_stale_samples,
                RETRIED_STALE: counts.retried_stale_samples, REQUEUED: counts.requeued_groups,
                ENGINE_WAIT_RATIO: self.worker.idle.take(), SAMPLE_ERRORS: errors - last_errors,
                RETRIED_METRIC: retried - last_retried}

    def _tagged(self, groups: list[list[Sample]]) -> list[SampleGroup]:
        """Each group with the oldest version that generated it (the whole rollout converted at once,
        as slime's plug-ins see it)."""
        return [SampleGroup(min((s.generating_version or 0) for s in group), train)
                for group, train in zip(groups, self.options.train_data.of(groups))]

    def _each_engine(self, route: str, body: dict[str, Any]) -> None:
        """One engine call to every ready engine; one that fails is left to the publish (which
        drops an engine that cannot take the weights) and the supervisor."""
        if self.client is None:
            return
        for url in self.engines():
            try:
                self.client.call(url, route, body)
            except EngineError as err:
                log.warning("engine %s: %s failed: %s", url, route, err)
