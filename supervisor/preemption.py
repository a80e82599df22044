"""When the job must save and requeue, and by when: SLURM's warning signal (--signal=B:USR1@
preempt_grace, before a preemption or the time limit), less than preempt_grace (or the time a save
needs, when longer: supervisor/deadline.py) left before the job's current end, or the supervisor's
own decision (a lost node leaves too few engines). Also what SLURM says of the job as a whole: its
end time, whether it is ending, the time left."""

from __future__ import annotations

import time
from collections.abc import Callable

from slurm.client import SlurmClient
from supervisor.deadline import EndTime
from supervisor.slurm_jobs import SlurmUnavailable, sacct_states

# "the signal may be sent up to 60 seconds earlier than specified" (sbatch --signal)
SLURM_SIGNAL_EARLY_S = 65.0
# A job (or hetjob component) in one of these states is ending: its steps die with it, and a step
# launched now would only race SLURM. Not SUSPENDED, STOPPED or SIGNALING: the job goes on after those.
ENDING_STATES = frozenset({"COMPLETING", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "PREEMPTED", "NODE_FAIL",
                           "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                           "SPECIAL_EXIT", "STAGE_OUT", "REVOKED"})


class SlurmJob:
    """squeue's answers about one job; None (or False) when squeue does not answer within timeout_s."""

    def __init__(self, job_id: str, timeout_s: float) -> None:
        self.job_id = job_id
        self.timeout_s = timeout_s
        self.slurm = SlurmClient(timeout_s)

    def _squeue(self, field: str) -> list[str] | None:
        out = self.slurm.call("squeue", "-h", "-j", self.job_id, "-o", field)
        return out.stdout.split() if out.ok else None

    def end_time(self, default: float | None = None) -> float | None:
        """The job's end (unix time), None without a limit; `default` when squeue does not answer."""
        words = self._squeue("%e")
        if words is None:
            return default
        try:
            return time.mktime(time.strptime(words[0], "%Y-%m-%dT%H:%M:%S")) if words else None
        except ValueError:  # UNLIMITED, N/A
            return None

    def ending(self) -> bool:
        """SLURM is ending the job (scancel, time limit): its steps die with it."""
        return self.ending_state() is not None

    def ending_state(self) -> str | None:
        """How SLURM is ending the job ("cancelled", "timeout", "completing"...), None while it runs
        (or when squeue does not answer). Any component in an ending state means the whole job ends
        (a heterogeneous job's components end together), whatever another one still says; a job
        squeue answers for but no longer lists has ended. How it ends is in the accounting once
        squeue only says COMPLETING (or nothing): only its ending states count there, as sacct
        may still say RUNNING of a component SLURM is ending (seen on the devcluster)."""
        listed = self._squeue("%T")
        if listed is None:
            return None
        states = set(listed)
        if states and not states & ENDING_STATES:
            return None
        if states <= {"COMPLETING"}:
            states = (set(self._sacct_states()) & ENDING_STATES) or states or {"ENDED"}
        return "/".join(sorted(states & ENDING_STATES or states)).lower()

    def _sacct_states(self) -> list[str]:
        try:
            return sacct_states(self.job_id, self.timeout_s)
        except SlurmUnavailable:
            return []

    def time_left(self) -> str | None:
        words = self._squeue("%L")
        return words[0] if words else None


class Preemption:
    """Whether the job must stop and requeue, why, and by when. `warned` may run in a signal
    handler; the rest runs in the supervisor's monitor loop. The job's end is SLURM's current one
    (deadline.EndTime: a time limit changed while the job runs moves it); on_end_change(old, new)
    hears when it moves."""

    def __init__(self, grace_s: float, job: SlurmJob,
                 on_end_change: Callable[[float | None, float | None], None] | None = None) -> None:
        self.grace_s = grace_s
        self.job = job
        self.reason: str | None = None
        self.deadline: float | None = None  # when SLURM ends the job (unix time); None: now
        self.at_end = False  # the deadline is the job's end: SLURM ends it then, whatever runs
        self.ends = EndTime(job.end_time, on_end_change or (lambda old, new: None))
        self._warned_at: float | None = None
        self._terminated_at: float | None = None

    @property
    def end_time(self) -> float | None:
        return self.ends.current()

    def warned(self) -> None:
        self._warned_at = self._warned_at or time.time()

    def terminated(self) -> None:
        """SIGTERM to the batch step (signal handler): `scancel JOB`, `scancel --signal=TERM --batch`
        (how some sites preempt), a preemption's or time limit's SIGTERM before KillWait's SIGKILL.
        The short-grace path: save now."""
        self._terminated_at = self._terminated_at or time.time()

    def decide(self, reason: str) -> None:
        """The supervisor's own reason to save now and requeue (kept if one came first)."""
        self.reason = self.reason or reason

    def check(self, lead_s: float = 0.0) -> str | None:
        """The reason the job must stop, once it must. lead_s: how long before the job's end it must
        begin to stop (what a save takes, deadline.StopCosts.lead), when that is more than the grace."""
        if self._terminated_at and not self.reason:
            self.reason = "SIGTERM to the batch step (scancel, or a preemption): saving now"
            self.deadline = self._terminated_at
        if self._warned_at and not self.reason:
            self._read_warning()
        end, lead = self.end_time, max(self.grace_s, lead_s)
        if end and not self.reason and end - time.time() < lead:
            self.reason = (f"less than {self.grace_s} s left before the job's end (time limit or preemption)"
                           if lead == self.grace_s else
                           f"less than {lead:.0f} s left before the job's end (time limit or preemption): "
                           "as long as the training under way, a save as slow as the recent ones and "
                           "the requeue take")
            self.deadline, self.at_end = end, True
        return self.reason

    def seconds_left(self) -> float:
        return (self.deadline or time.time()) - time.time()

    def _read_warning(self) -> None:
        """SLURM sends the warning preempt_grace before the time limit (up to a minute early, by its
        own account), and on a preemption it moves the job's end to now + GraceTime first. So an
        end time that near is the deadline: the trainer stops when less than preempt_grace is left,
        not a minute early. A signal far from the end (someone's `scancel --signal=USR1`) means now."""
        warned_at, self._warned_at = self._warned_at or time.time(), None  # (set: check calls it then)
        end = self.job.end_time()
        if end is not None and end - warned_at <= self.grace_s + SLURM_SIGNAL_EARLY_S:
            self.ends.heard(end)
        else:
            self.reason = "SLURM's warning signal (preemption or the time limit)"
            self.deadline = warned_at + self.grace_s
