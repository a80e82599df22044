"""Acting on a preemption (supervisor/preemption.py decides when): the trainer saves at its next
rollout boundary (or now, when the time left would not cover one), then the job requeues itself,
off the nodes it lost. Before the job's end, a save that could not end in time is not made: the
trainer is ended at once and the job requeues from its last complete checkpoint and the rollout
journal (supervisor/deadline.py)."""

from __future__ import annotations

import re
import signal
import threading
import time
from collections import deque
from collections.abc import Iterable

from contract.job_dir import Heartbeat
from slurm.client import SlurmClient
from supervisor.context import Ending, JobContext
from supervisor.deadline import no_time_to_save
from supervisor.launcher import TRAINER, StepLauncher
from supervisor.nodes import NodeTracker
from supervisor.preemption import Preemption, SlurmJob
from supervisor.trainer_files import Pace, last_checkpoint

REQUEUE = "preempted: saved, then requeued"  # the outcome of a job that requeues itself
REQUEUE_UNSAVED = "preempted: requeued without a save"  # ... when no save could end in time (the why follows)
RECENT_CYCLES = 10  # the monitor cycles whose longest the deadline's lead holds


def requeues(outcome: str) -> bool:
    """Whether the job's outcome is to requeue itself."""
    return outcome == REQUEUE or outcome.startswith(REQUEUE_UNSAVED)

# scancel's words when slurmctld signalled a step but a node of it did not answer (seen on slurm 22.05:
# "Kill job error on job step id 483: Communication connection failure").
_NODE_UNREACHED = re.compile(r"Kill job error on job step id \S+: Communication connection failure")


class Requeue:
    def __init__(self, job: JobContext, launcher: StepLauncher, nodes: NodeTracker, ending: Ending) -> None:
        self.job = job
        self.launcher = launcher
        self.nodes = nodes
        self.ending = ending
        self.slurm_job = SlurmJob(job.layout.job_id, job.ft.slurm_command_timeout)
        self.slurm = SlurmClient(job.ft.slurm_command_timeout)
        self.preemption = Preemption(job.ft.preempt_grace, self.slurm_job, on_end_change=self._end_moved)
        self.pace = Pace(job.dir)
        self._lock = threading.Lock()
        self._excluding: set[str] = set()  # lost nodes the requeued job must not start on
        self.save_now_sent = False  # (monitor thread only)
        self.unsaved: str | None = None  # why the job requeues without a save, once it does (monitor thread)
        self._checked_at: float | None = None  # the last check (monotonic; monitor thread)
        self._cycles: deque[float] = deque(maxlen=RECENT_CYCLES)  # the time between recent checks

    def without_node(self, node: str, reason: str) -> None:
        """The supervisor's own reason to save and requeue: a lost node left too few engines."""
        with self._lock:
            self._excluding.add(node)
        self.preemption.decide(reason)

    def check(self, beat: Heartbeat | None) -> str | None:
        """Once the job must stop: the trainer saves at its next rollout boundary and ends; then the
        job is requeued (see requeue). If the time left would not cover a rollout and a save (as
        the last ones took), it saves now instead. beat: the running trainer's heartbeat (None:
        none runs). Returns, once, why the trainer must end now without a save: before the job's
        end, no save (the one under way, or one made now) would end in time."""
        costs = self.pace.costs(beat)
        reason = self.preemption.check(costs.lead(self.job.ft.preempt_grace, self._record_check()))
        if reason is None or self.unsaved is not None:
            return None
        time_left = self.preemption.seconds_left()
        if self.ending.stop(by_user=False):
            self.job.events.emit("preemption", reason=reason, time_left_s=round(time_left, 1),
                                 boundary_s=round(costs.boundary_s, 1), save_s=round(costs.save_s, 1))
        unsaved = no_time_to_save(time_left, costs, beat) if self.preemption.at_end else None
        if unsaved is not None:
            self.unsaved = unsaved
            self.job.events.emit("no_time_to_save", TRAINER, reason=unsaved, time_left_s=round(time_left, 1),
                                 save_s=round(costs.save_s, 1), checkpoint=self._checkpoint())
            return unsaved
        if not self.save_now_sent and time_left < 2 * costs.boundary_s:  # twice: rollouts vary
            self._tell_trainer_save_now(f"{time_left:.0f} s left, a rollout and a save take about "
                                        f"{costs.boundary_s:.0f} s")
        return None

    def _record_check(self) -> float:
        """Records this check's time; returns how long the next one may be away: the monitor's interval, or
        its longest recent cycle (a cycle's probes add to the interval, and take longer on a loaded machine)."""
        now = time.monotonic()
        if self._checked_at is not None:
            self._cycles.append(now - self._checked_at)
        self._checked_at = now
        return max([self.job.ft.rollout_health_check_interval, *self._cycles])

    def slurm_ending(self, steps: Iterable[str]) -> bool:
        """Whether SLURM is ending the job (scancel, a requeue, the time limit). Then the steps named,
        which exited meanwhile, were cut short by it, not failed (job_ending each), and nothing is
        relaunched any more (Ending.slurm_ends: the trainer's exit decides the outcome)."""
        state = self.slurm_job.ending_state()
        if state is None:
            return False
        for name in steps:
            self.job.events.emit("job_ending", name, slurm_state=state)
        self.ending.slurm_ends(state)
        return True

    def relaunch_refused(self, name: str) -> bool:
        """Whether no step may be launched again (asked before each relaunch): SLURM is ending the job,
        as already seen or as squeue says now. A step that dies with the job can be taken for failed
        before its exit is seen (its probes, the trainer's report of it): a relaunch then would race SLURM."""
        return self.ending.by_slurm is not None or self.slurm_ending([name])

    @property
    def outcome(self) -> str:
        """The job's outcome once the trainer has stopped for the preemption."""
        if self.unsaved is None:
            return REQUEUE
        return f"{REQUEUE_UNSAVED} ({self.unsaved}): it resumes from {self._checkpoint() or 'its start'} " \
               "and the rollout journal"

    def _checkpoint(self) -> str | None:
        return last_checkpoint(self.job.spec.trainer.save)

    def _end_moved(self, old: float | None, new: float | None) -> None:
        """SLURM's end of the job moved (its time limit changed while it runs)."""
        self.job.events.emit("time_limit_changed", end=_clock(new), was=_clock(old),
                             time_left_s=None if new is None else round(new - time.time(), 1))

    def _tell_trainer_save_now(self, why: str) -> None:
        """SIGUSR1 to every trainer task: abandon the running rollout, or skip the publish, and save."""
        if self.signal_trainer("USR1"):
            self.save_now_sent = True
            self.job.events.emit("save_now", TRAINER, reason=why)

    def signal_trainer(self, name: str) -> bool:
        """Send signal `name` (USR1, KILL) to every trainer task; False if SLURM did not take it, or
        the trainer is not running (or SLURM has not listed its step yet: the next cycle retries)."""
        step = self.launcher.current(TRAINER)
        if step is None or step.returncode is not None or step.slurm_step is None:
            return False
        self._fence_check()  # its step id may be a newer run's
        done = self.slurm.call("scancel", f"--signal={name}", step.slurm_step)
        # A node of the step that does not answer (a lost one) fails the call after MessageTimeout, the
        # others got the signal: asking again would reach no more, and hold up the monitor.
        return done.ok or bool(_NODE_UNREACHED.search(done.stderr))

    def _fence_check(self) -> None:
        if self.job.store.fence is not None:
            self.job.store.fence.check()  # Fenced: a newer run of the job is SLURM's to steer

    def requeue(self, requeues: int) -> str | None:
        """Requeue the job (its steps are stopped already); the reason it was not, if it was not."""
        ft = self.job.ft
        if requeues >= ft.max_requeues:
            return f"preempted and saved; not requeued: max_requeues ({ft.max_requeues}) reached"
        self._fence_check()
        with self._lock:
            excluding = set(self._excluding)
        self.job.events.emit("requeue", requeues=requeues + 1, excluding=sorted(excluding))
        # SLURM answers the requeue with SIGTERM to the batch step: it must not cut the exclusion below
        # short (the steps are stopped already; KillWait's SIGKILL still ends this process).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            submitit_handler = signal.getsignal(signal.SIGUSR2)
            if callable(submitit_handler):
                # Submitit's own checkpoint-and-requeue (it pickles Supervisor again, then scontrol requeue).
                submitit_handler(signal.SIGUSR2, None)
            else:
                self.slurm.require("scontrol", "requeue", self.job.layout.job_id)
        finally:  # (Submitit's handler ends in sys.exit) SLURM takes ExcNodeList only once requeued
            if excluding and not self.nodes.exclude(excluding, ft.exclude_timeout):
                self.job.events.emit("exclude_failed", nodes=sorted(excluding),
                                     reason="scontrol update ExcNodeList was refused until exclude_timeout")
        return None


def _clock(when: float | None) -> str:
    """A unix time as SLURM prints an end time (local time), or UNLIMITED."""
    return "UNLIMITED" if when is None else time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(when))
