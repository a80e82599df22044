"""The job's end as SLURM has it now, and how long before it the job must begin to stop.

SLURM's end time moves while a job runs: `scontrol update JobId=J TimeLimit=...` (or EndTime=)
extends or shortens it, and a preemption with a GraceTime brings it to now + GraceTime. EndTime
follows it (one squeue at most every END_TIME_REFRESH_S, through the SLURM client) instead of the
end read at start, and says when it moved.

A save before the end takes as long as the recent ones did (Pace, from the trainer's metrics; a
save under way that has taken longer already counts as that long). So the job begins to stop when
less than its lead is left: preempt_grace, or what a save-now costs (the training under way, then
a save) plus REQUEUE_MARGIN_S to stop the steps and requeue, when that is longer. A save that
cannot end REQUEUE_MARGIN_S before the job does is neither started nor waited for (no_time_to_save):
the job requeues from its last complete checkpoint and the rollout journal, instead of SLURM
ending it mid-save with TIMEOUT, which requeues nothing."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from contract.job_dir import Heartbeat, Phase

END_TIME_REFRESH_S = 10.0  # between two asks of SLURM for the job's end (one squeue)
REQUEUE_MARGIN_S = 15.0  # kept before the job's end to stop its steps and requeue it


class EndTime:
    """The job's end (unix time; None without a limit) as SLURM last said it: read at once, then
    again once END_TIME_REFRESH_S have passed. read(default): SLURM's answer, or default when it
    gives none (preemption.SlurmJob.end_time); on_change(old, new) hears of every move."""

    def __init__(self, read: Callable[[float | None], float | None],
                 on_change: Callable[[float | None, float | None], None]) -> None:
        self.read = read
        self.on_change = on_change
        self._end = read(None)
        self._asked_at = time.monotonic()

    def current(self) -> float | None:
        if time.monotonic() - self._asked_at >= END_TIME_REFRESH_S:
            self.heard(self.read(self._end))  # no answer: the end as last known
        return self._end

    def heard(self, end: float | None) -> None:
        """A fresh answer (the refresh's, or the one read on SLURM's warning signal)."""
        self._asked_at = time.monotonic()
        if end != self._end:
            old, self._end = self._end, end
            self.on_change(old, end)


@dataclass(frozen=True)
class StopCosts:
    """What stopping takes, as the trainer's recent rollouts took it (0 before any was measured)."""

    save_s: float  # a save
    train_s: float  # training and publishing one rollout: a save-now during them waits for their end
    boundary_s: float  # a rollout, its training and publish, and a save: to the next rollout boundary, saved

    def lead(self, grace_s: float, check_every_s: float) -> float:
        """How long before the job's end it must begin to stop: the grace, or a save-now's worst
        case (the training under way, then a save) and the requeue's margin, when that is longer.
        The end is checked once every check_every_s (the monitor's cycle): the check that finds less
        than that worst case left may come a cycle late, so the lead holds one cycle more (CI: a
        check ~3 s past the lead found a periodic save just begun, and no time left to end it)."""
        return max(grace_s, self.train_s + self.save_s + REQUEUE_MARGIN_S + check_every_s)


def no_time_to_save(left_s: float, costs: StopCosts, beat: Heartbeat | None) -> str | None:
    """Why no save can end REQUEUE_MARGIN_S before the job's end (left_s from now), or None when one
    can: the save under way, or one the trainer would make now (after the training under way)."""
    if beat is None:
        return None
    if beat.phase is Phase.SAVE:
        more = max(0.0, costs.save_s - (time.time() - beat.began))
        if left_s < more + REQUEUE_MARGIN_S:
            return (f"{left_s:.0f} s left: the save under way needs ~{more:.0f} s more, and stopping the job "
                    f"{REQUEUE_MARGIN_S:.0f} s")
        return None
    finish = costs.train_s if beat.phase in (Phase.TRAIN, Phase.PUBLISH) else 0.0
    if left_s < finish + costs.save_s + REQUEUE_MARGIN_S:
        return (f"{left_s:.0f} s left: a save takes ~{costs.save_s:.0f} s (the recent ones)"
                + (f" after ~{finish:.0f} s of training" if finish else "")
                + f", and stopping the job {REQUEUE_MARGIN_S:.0f} s")
    return None
