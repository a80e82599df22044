"""The supervisor's recovery and control handlers wired in process over a test JobContext
(tests/supervisor/job_context.py), as the daemon wires them, for the recovery tests."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from supervisor.context import Ending, JobContext
from supervisor.control_handlers import ControlHandlers
from supervisor.launcher import RouterPlace, StepLauncher
from supervisor.node_failures import NodeFailures
from supervisor.probe import HealthTracker
from supervisor.profiling import Profiling
from supervisor.recovery import EngineRecovery
from supervisor.requeue import Requeue
from supervisor.step_control import StepControl
from supervisor.steps import StepController
from supervisor.tensorboard import ScalarWriter
from supervisor.trainer_watch import TrainerWatch


@dataclass
class Wiring:
    steps: StepControl
    launcher: StepLauncher
    trainer: TrainerWatch
    recovery: EngineRecovery
    handlers: ControlHandlers
    ending: Ending
    pool: ThreadPoolExecutor

    def stop(self) -> None:
        """Cancel every step still running (SIGTERM, then SIGKILL), then end the pool and the backend."""
        for step in self.launcher.all().values():
            if step.returncode is None:
                self.steps.cancel(step, timeout_s=5, term_grace_s=2)
        self.pool.shutdown(wait=True)
        self.steps.close()


def wire_recovery(job: JobContext, router: RouterPlace, steps: StepControl | None = None) -> Wiring:
    """steps: the step control to use (default: SLURM's, StepController)."""
    ft = job.ft
    steps = steps or StepController(job.layout.job_id, ft.slurm_command_timeout, ft.step_exit_code_wait)
    launcher = StepLauncher(job, steps, "key", router)
    ending = Ending(user_stop=False)
    pool = ThreadPoolExecutor(max_workers=4)
    nodes = NodeFailures(job)
    requeue = Requeue(job, launcher, nodes.tracker, ending)
    recovery = EngineRecovery(job, launcher, steps, nodes, HealthTracker(3, 0.0), requeue, ending, pool,
                              ScalarWriter(job.dir.supervisor_tensorboard))
    trainer = TrainerWatch(job, launcher, steps, requeue, ending, pool, restarts=0)
    handlers = ControlHandlers(job, launcher, steps, recovery, trainer, requeue, ending, pool,
                               Profiling(job, recovery.serving), lambda: None)
    return Wiring(steps, launcher, trainer, recovery, handlers, ending, pool)
