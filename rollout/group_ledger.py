"""The reservation/commit ledger of the fully asynchronous rollout: where every prompt group the data
source handed out is, so that no sample is lost and none is trained twice across any failure.

Every group taken from the data source (its samples' indices count up over the run, so a group's
id, its group_index, is unique) is at any moment in exactly one place:

    pending    to generate: never started, requeued (a weight update's abort, a stale group with
               --async-unused-samples-handler retry: from its prompt again), or stopped with the
               tokens it has (a stop keeps them: it continues from them)
    in flight  being generated; the ledger keeps a copy of it as it was when it was sent
    ready      generated and scored, waiting for a rollout
    trained    taken into rollout N (committed by the rollout id): it left the ledger
    dropped    left out by a stated rule, counted: a user function failed on it (sample_errors.py)
               or, with --async-unused-samples-handler drop, it was beyond --max-weight-staleness

Every move is one call under the ledger's lock. The ledger's state (`state_dict`) is the data
buffer (its position in the data source, and pending with the in-flight copies in front: a resume
generates them again from where they were sent) plus ready, with every sample, and the count of
samples dropped over the run (so that handed out = trained + waiting + dropped can be checked). That state goes
into the checkpoint after rollout N, and into the rollout journal's entry for each rollout M > N
with M's groups (trainer.fully_async_source): a resume from N replays M = N+1, N+2... in order,
each entry putting the ledger where it was right after M was taken, then generates on. So a
group is trained in rollout M exactly when the chain (checkpoint N, entries N+1..M) says so, and
every group the data source handed out is in the chain's last state or trained in it: nothing is
lost (a crash loses only the tokens generated since a group was sent, or since the last entry
for a ready one) and nothing is trained twice.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from rollout.buffer import DataBuffer
from rollout.sample import Sample, numbered

Group = list[Sample]
DROP, RETRY = "drop", "retry"  # --async-unused-samples-handler (miles')


@dataclass
class Counts:
    """What happened to groups since the last rollout was taken (reported with it)."""
    dropped_stale_samples: int = 0
    retried_stale_samples: int = 0
    requeued_groups: int = 0  # aborted by a weight update (pause mode abort): from their prompts again
    dropped_groups: int = 0  # a user function failed on them


def group_id(group: Group) -> int:
    return numbered(group[0].group_index)  # the data source numbers every group the ledger sees


def from_prompt(sample: Sample) -> Sample:
    """The sample as its prompt gave it: generated again from scratch (slime's requeue)."""
    return Sample(index=sample.index, group_index=sample.group_index, prompt=sample.prompt, label=sample.label,
                  metadata=sample.metadata, spans=sample.spans)


def staleness(group: Group, trainer_version: int) -> int:
    """The trainer's version minus the oldest version that generated any of its tokens."""
    return trainer_version - min((s.generating_version or 0) for s in group)


class GroupLedger:
    def __init__(self, buffer: DataBuffer, capacity: int) -> None:
        """capacity: groups in flight and ready at once (--async-data-buffer-capacity-factor x
        --rollout-batch-size): the bound on how far generation runs ahead of training."""
        self.buffer = buffer
        self.capacity = capacity
        self.in_flight: dict[int, dict[str, Any]] = {}  # group id -> its samples' dicts when sent
        self.ready: deque[Group] = deque()
        self.counts = Counts()
        self.dropped_samples = 0  # over the run (kept in the state), by either rule
        self.changed = threading.Condition()  # notified on every move: a rollout may be ready

    # ---- the worker's moves
    def room(self) -> bool:
        with self.changed:
            return len(self.in_flight) + len(self.ready) < self.capacity

    def take(self) -> Group:
        """The next group to generate: a pending one first, else a fresh one from the data source."""
        with self.changed:
            group = self.buffer.get(1)[0]
            self.in_flight[group_id(group)] = {"samples": [s.to_dict() for s in group]}
            return group

    def generated(self, group: Group) -> None:
        self._move(group, lambda: self.ready.append(group))

    def stopped(self, group: Group) -> None:
        """Back to pending with the tokens it has (a stop): it continues from them."""
        self._move(group, lambda: self.buffer.put_back([group]))

    def requeued(self, group: Group) -> None:
        """Back to pending from its prompt (aborted by a weight update's pause)."""
        def move() -> None:
            self.buffer.put_back([[from_prompt(s) for s in group]])
            self.counts.requeued_groups += 1
        self._move(group, move)

    def dropped(self, gid: int) -> None:
        """A user function failed on it (sample_errors.py counts the samples)."""
        with self.changed:
            self.dropped_samples += len(self.in_flight.pop(gid)["samples"])
            self.counts.dropped_groups += 1
            self.changed.notify_all()

    def _move(self, group: Group, move: Any) -> None:
        with self.changed:
            del self.in_flight[group_id(group)]
            move()
            self.changed.notify_all()

    # ---- the trainer's take
    def take_ready(self, count: int, trainer_version: int, max_staleness: int | None,
                   handler: str) -> list[Group] | None:
        """`count` ready groups for a rollout trained at `trainer_version`, oldest first, or None
        while fewer are ready. Groups beyond `max_staleness` first go by `handler`: dropped, or
        back to pending from their prompts (retry)."""
        with self.changed:
            if max_staleness is not None:
                for group in [g for g in self.ready if staleness(g, trainer_version) > max_staleness]:
                    self.ready.remove(group)
                    if handler == RETRY:
                        self.buffer.put_back([[from_prompt(s) for s in group]])
                        self.counts.retried_stale_samples += len(group)
                    else:
                        self.counts.dropped_stale_samples += len(group)
                        self.dropped_samples += len(group)
            if len(self.ready) < count:
                return None
            return [self.ready.popleft() for _ in range(count)]

    def wait(self, timeout_s: float) -> None:
        """Until the next move, or timeout_s."""
        with self.changed:
            self.changed.wait(timeout_s)

    def report(self) -> tuple[Counts, int, int]:
        """(the counts since the last report, ready groups, groups in flight); the counts start again."""
        with self.changed:
            counts, self.counts = self.counts, Counts()
            return counts, len(self.ready), len(self.in_flight)

    # ---- the checkpoint and the rollout journal
    def state_dict(self) -> dict[str, Any]:
        with self.changed:
            buffer = self.buffer.state_dict()
            buffer["pending"] = [g["samples"] for g in self.in_flight.values()] + buffer["pending"]
            return {"buffer": buffer, "ready": [[s.to_dict() for s in g] for g in self.ready],
                    "dropped_samples": self.dropped_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.changed:
            self.buffer.load_state_dict(state["buffer"])
            self.in_flight = {}
            self.ready = deque([Sample.from_dict(s) for s in g] for g in state["ready"])
            self.dropped_samples = state["dropped_samples"]
