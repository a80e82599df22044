"""Acting on a preemption (supervisor/preemption.py decides when): the trainer saves at its next
rollout boundary (or now, when the time left would not cover one), then the job requeues itself,
off the nodes it lost."""

from __future__ import annotations

import re
import signal
import threading

from slurm.client import SlurmClient
from supervisor.context import Ending, JobContext
from supervisor.launcher import TRAINER, StepLauncher
from supervisor.nodes import NodeTracker
from supervisor.preemption import Preemption, SlurmJob
from supervisor.trainer_files import seconds_to_boundary

# scancel's words when slurmctld signalled a step but a node of it did not answer (seen on slurm 22.05:
# "Kill job error on job step id 483: Communication connection failure").
_NODE_UNREACHED = re.compile(r"Kill job error on job step")


class Requeue:
    def __init__(self, job: JobContext, launcher: StepLauncher, nodes: NodeTracker, ending: Ending) -> None:
        self.job = job
        self.launcher = launcher
        self.nodes = nodes
        self.ending = ending
        self.slurm_job = SlurmJob(job.layout.job_id, job.ft.slurm_command_timeout)
        self.slurm = SlurmClient(job.ft.slurm_command_timeout)
        self.preemption = Preemption(job.ft.preempt_grace, self.slurm_job)
        self._lock = threading.Lock()
        self._excluding: set[str] = set()  # lost nodes the requeued job must not start on
        self._save_now_sent = False  # (monitor thread only)

    def without_node(self, node: str, reason: str) -> None:
        """The supervisor's own reason to save and requeue: a lost node left too few engines."""
        with self._lock:
            self._excluding.add(node)
        self.preemption.decide(reason)

    def check(self) -> None:
        """Once the job must stop: the trainer saves at its next rollout boundary and ends; then the
        job is requeued (see requeue). If the time left would not cover a rollout and a save (as
        the last ones took), it saves now instead."""
        reason = self.preemption.check()
        if reason is None:
            return
        time_left = self.preemption.seconds_left()
        needed = 2 * seconds_to_boundary(self.job.dir)  # twice: rollouts vary
        if self.ending.stop(by_user=False):
            self.job.events.emit("preemption", reason=reason, time_left_s=round(time_left, 1),
                                 boundary_s=round(needed / 2, 1))
        if not self._save_now_sent and time_left < needed:
            self._tell_trainer_save_now(f"{time_left:.0f} s left, a rollout and a save take about {needed / 2:.0f} s")

    def _tell_trainer_save_now(self, why: str) -> None:
        """SIGUSR1 to every trainer task: abandon the running rollout, or skip the publish, and save."""
        step = self.launcher.current(TRAINER)
        if step is None or step.returncode is not None or step.slurm_step is None:
            return  # not running (or SLURM has not listed it yet: the next cycle retries)
        self._fence_check()  # its step id may be a newer run's
        done = self.slurm.call("scancel", "--signal=USR1", step.slurm_step)
        # A node of the step that does not answer (a lost one) fails the call after MessageTimeout,
        # the others got the signal: asking again would reach no more, and hold up the monitor.
        if done.ok or _NODE_UNREACHED.search(done.stderr):
            self._save_now_sent = True
            unreached = {} if done.ok else {"unreached": done.stderr.strip()}
            self.job.events.emit("save_now", TRAINER, reason=why, **unreached)

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
