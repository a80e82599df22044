"""A supervisor started again in the same allocation (its watchdog restarted it after a crash)
keeps the steps its predecessor left running instead of launching duplicates, and re-checks
their engines' weight versions before the router may route to them again. A supervisor started
after a requeue adopts nothing, but stops the previous run's engines SLURM left running."""

from __future__ import annotations

from contract.job_dir import read_trainer_finished
from supervisor.context import JobContext
from supervisor.fencing import own_run
from supervisor.launcher import ROUTER, TRAINER, JobFailed, StepLauncher
from supervisor.state import JobState, StateStore
from supervisor.step_control import StepControl
from supervisor.trainer_watch import TrainerWatch


def predecessor(store: StateStore, job_id: str) -> JobState | None:
    """The state left by a supervisor of this same allocation that crashed (its watchdog started
    this one); None on the job's first start and after a requeue, whose steps SLURM ended."""
    state = store.snapshot()
    same_run = state.requeues == own_run()
    return state if state.job_id == job_id and same_run else None


def left_over(state: JobState, job_id: str) -> dict[str, str | None]:
    """After a requeue, the previous run's engine steps that may still run: SLURM requeues only the
    component of a heterogeneous job whose node failed (the trainer's node, with the batch step);
    the rollout component keeps its allocation and the old run's engines."""
    if state.job_id != job_id or state.requeues == own_run():
        return {}
    return {name: record.slurm_step for name, record in state.steps.items() if record.kind == "engine"}


def stop_left_over(job: JobContext, steps: StepControl, recorded: dict[str, str | None]) -> None:
    """Those still running are stopped before this run launches its own: they would hold the CPUs
    and GPUs its engines wait for, and answer on the addresses its engines take (their weights
    are an older run's). Only before: SLURM numbers the requeued job's steps from 0 again, so
    their ids are this run's next ones."""
    if not recorded:
        return
    found = steps.adopt(recorded)
    if found is None:
        raise JobFailed("SLURM did not answer which steps of the previous run still run; not launching beside them")
    for step in found:
        job.events.emit("step_left_over", step.spec_name, slurm_step=step.slurm_step)
        steps.cancel(step, job.ft.step_stop_timeout, job.ft.step_term_grace)


def adopt(job: JobContext, previous: JobState | None, steps: StepControl, launcher: StepLauncher,
          trainer: TrainerWatch) -> set[str]:
    """Steps the predecessor left running are kept, not duplicated, and its engines re-checked; a
    trainer that ended meanwhile ends here as if seen. (After a requeue SLURM has ended them all:
    everything is launched afresh.) Returns the names of the steps not to launch."""
    if previous is None:
        return set()
    recorded = {name: record.slurm_step for name, record in previous.steps.items()}
    found = steps.adopt({name: recorded.get(name) for name in (ROUTER, *job.engines, TRAINER)})
    if found is None:
        raise JobFailed("SLURM did not answer which steps are still running; not launching duplicates")
    for step in found:
        launcher.set_current(step)
        job.events.emit("step_adopted", step.spec_name, slurm_step=step.slurm_step)
    adopted = {step.spec_name for step in found}
    if TRAINER in adopted:
        trainer.adopted()
    elif trainer_step := recorded.get(TRAINER):
        # It ended while no supervisor watched: its end reaches the monitor like any trainer exit,
        # with its exit code (0: the job is complete): its own record of a finish, which needs no
        # accounting, else SLURM's accounting.
        launched = previous.steps[TRAINER].launched_at or 0.0
        step = steps.ended(TRAINER, trainer_step, 0 if read_trainer_finished(job.dir, launched) else None)
        assert step.proc is not None  # ended() gives it a stand-in
        launcher.set_current(step)
        job.events.emit("step_ended_unseen", TRAINER, slurm_step=trainer_step, exit_code=step.proc.wait())
        adopted.add(TRAINER)
    # --colocate: a trainer that held the GPUs still holds them (or, if it ended, the trainer's
    # exit hands them back and resumes the released engines, as for a trainer seen ending).
    job.gpus.restore(previous.gpu_holder, previous.gpus_released)
    _restore_engines(job, previous, adopted)
    return adopted


def _restore_engines(job: JobContext, previous: JobState, adopted: set[str]) -> None:
    """The predecessor's weight version, and its router's members re-checked: an adopted engine
    stays in the router only if it answers with the current version; any other leaves it."""
    router_kept = ROUTER in adopted or job.spec.rollout.external_router
    listed = set(job.engines.router.workers()) if router_kept else set()
    served = {name: job.engines.served_version(engine) for name, engine in job.engines.items() if name in adopted}
    job.engines.restore(previous.weight_version, {name: record.restarts for name, record in previous.steps.items()},
                        listed, served)
