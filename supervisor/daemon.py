"""The supervisor: the job's batch step on the head node. It launches the router, one step per
engine and the trainer, watches them (step exits at once; engines' /health_generate in parallel),
restarts what fails per the failure table, keeps the router to engines at the current weight
version, and answers the control socket (`slurmrl status|restart|events|stop`). With
--debug-train-only the layout holds no engine and no router starts: the trainer is the one step.

Submitted by `slurmrl submit` as `Supervisor(spec)` (Submitit pickles it), or started by a plain
sbatch template as `python -m supervisor --job-dir DIR`.

The daemon composes the parts and runs the monitor loop:
    Engines (engines.py)              the engines' records: the one writer of every engine field
    StepLauncher (launcher.py)        launches steps; owns the table of each name's current step
    StepController (steps.py)         SLURM's steps; NodeAgentSteps (node_agents.py) over it runs the
                                      engines in one agent step per node (steps.engine_launch)
    adopt (adoption.py)               keeps a crashed predecessor's steps
    EngineRecovery (recovery.py)      starts, recovers and gives up on engines (asking Engines)
    NodeFailures (node_failures.py)   lost nodes: released, engines moved to spares
    TrainerNodeLoss (trainer_node_loss.py)  a lost trainer node: save, requeue without it
    TrainerWatch (trainer_watch.py)   the trainer's heartbeat, exit, restarts
    Requeue (requeue.py)              preemption and the job's end (deadline.py): save, then requeue
    ControlHandlers (control_handlers.py)  the control socket's calls

Threads, and what they run:
- main: run(): launch or adopt, then the monitor loop (step exits from the inbox, probe cycles,
  the state store, the trainer's heartbeat, node checks, preemption); SIGUSR1's handler.
- step-exit watcher (steps.py): puts each exited step in the inbox; with node agents, one reader
  per agent (node_agents.py) puts each engine's reported exit there too.
- recovery pool: engine restarts, syncs after a publish, checks of reported failures, cancelling
  a hung trainer.
- control-socket connections (control.py): ControlHandlers.
- node watch (nodes.LostNodeWatch): while engines are stopped or started.

Which lock guards what, and who writes it:
- Engines._lock: every field of every Engine (state, version, in_router, place, restarts,
  recent_restarts, last_restart), the set of engines being recovered and the current weight
  version. Engines alone writes them, each state change a move engine_states.TRANSITIONS allows;
  the others ask it ("start recovering engine-3 unless already recovering": start_recovering,
  launched, answered, loaded, admit, published, move, count_restart, give_up, restore...).
  Engines._router_lock: router calls with the admit/expel decisions they carry out (taken before
  _lock; no HTTP under _lock).
- StateStore._lock: the state document. Each engine's record there (state, restarts, weight
  version, nodes, url, last failure) and the job's weight version are written by Engines alone;
  a step's slurm_step and launch time by StepLauncher and the monitor; probe times by the monitor;
  the trainer's record by TrainerWatch; job-level fields by the daemon and ControlHandlers
  (lost_nodes by NodeFailures).
  Lock order: StateStore._lock, then Engines._lock.
- StepLauncher._lock: the current step of each name.   Ending._lock: failure and stop flags.
- EventLog, NodeTracker, TrainerWatch: each its own lock around its own state.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import submitit

from contract.control_protocol import CallerRun
from contract.job_dir import JobDir
from contract.spec import JobSpec
from rollout.engine_client import HEALTH_PATH, LIVENESS_PATH, EngineClient
from rollout.router_client import RouterClient
from slurm import env as slurm_env
from slurm.watchdog import RESTARTS_ENV
from supervisor import adoption, kill_cap
from supervisor import layout as layouts
from supervisor.context import Ending, JobContext
from supervisor.control import ControlServer
from supervisor.control_handlers import ControlHandlers
from supervisor.engine_states import HEALTHY
from supervisor.engines import Engines
from supervisor.events import EventLog
from supervisor.fencing import Fence, Fenced, own_run
from supervisor.keys import create_key
from supervisor.launcher import ROUTER, TRAINER, JobFailed, RouterPlace, StepLauncher, agent_shape
from supervisor.node_agents import NodeAgentSteps
from supervisor.node_failures import NodeFailures
from supervisor.probe import HealthTracker, KillBudget
from supervisor.profiling import Profiling
from supervisor.recovery import EngineRecovery
from supervisor.requeue import Requeue, requeues
from supervisor.state import StateStore
from supervisor.step_control import Step, StepControl
from supervisor.steps import StepController
from supervisor.tensorboard import ScalarWriter
from supervisor.trainer_files import last_checkpoint
from supervisor.trainer_node_loss import TrainerNodeLoss
from supervisor.trainer_watch import TrainerWatch

log = logging.getLogger(__name__)

FENCED = "fenced: a newer run of the job took over"  # the outcome of a supervisor of an older run

__all__ = ["Daemon", "JobFailed", "Supervisor", "record_start_failure", "start"]


class Supervisor(submitit.helpers.Checkpointable):
    """The callable Submitit runs in the batch step."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec

    def __call__(self) -> str:
        return start(self.spec).run()


def start(spec: JobSpec) -> Daemon:
    """The job's Daemon; if it cannot even start, the reason goes where `slurmrl status` and
    `slurmrl events` show it (else only Submitit's log would say why the job ended)."""
    try:
        return Daemon(spec)
    except Exception as err:
        reason = f"the supervisor could not start: {err}"
        if spec.job_dir is not None:  # else no job dir to write to: the caller's stderr is all there is
            record_start_failure(JobDir(Path(spec.job_dir)), reason)
        raise JobFailed(reason) from err


def record_start_failure(job_dir: JobDir, reason: str) -> None:
    if not job_dir.root.is_dir():
        return  # no job dir to write to: the caller's stderr is all there is
    job_id = slurm_env.job_id()
    fence = Fence(job_dir, job_id, own_run()) if job_id else None
    try:
        with StateStore(job_dir, fence).update() as state:
            state.job_id = job_id or state.job_id
            state.stop_reason = f"failed: {reason}"
    except Fenced:
        return  # a newer run of the job goes on: not this start's state to write
    events = EventLog(job_dir.events)
    events.emit("job_failed", reason=reason)
    events.close()


class Daemon:
    def __init__(self, spec: JobSpec) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s supervisor %(levelname)s %(message)s")
        ft = spec.fault_tolerance
        if spec.job_dir is None:
            raise ValueError("the spec names no job_dir (submit fills it in before the supervisor starts)")
        job_dir = JobDir(Path(spec.job_dir))
        layout = layouts.from_environment(spec, timeout_s=ft.slurm_command_timeout)
        fence = Fence(job_dir, layout.job_id, own_run())  # once a newer run of the job starts
        self.fence = fence
        store = StateStore(job_dir, fence)
        self.predecessor = adoption.predecessor(store, layout.job_id)
        key = create_key(job_dir)  # a predecessor's key: its steps were started with it
        router = RouterPlace.choose(spec, layout, self.predecessor)
        client = EngineClient(key, ft.rollout_health_check_timeout)
        engines = Engines(layout.engines, RouterClient(router.url, key, ft.router_request_timeout), client, key,
                          listed_timeout_s=ft.engine_admit_timeout, store=store)
        inbox: queue.Queue[Step] = queue.Queue()
        self.job = JobContext(spec=spec, dir=job_dir, layout=layout, events=EventLog(job_dir.events, fence),
                              store=store, engines=engines, client=client, finished=threading.Event(), inbox=inbox)
        srun_steps = StepController(layout.job_id, ft.slurm_command_timeout, ft.step_exit_code_wait,
                                    on_exit=inbox.put, fence=fence)
        self.steps: StepControl = (NodeAgentSteps(srun_steps, agent_shape(self.job, key), engines, on_exit=inbox.put)
                                   if spec.steps.engine_launch == "node_agent" else srun_steps)
        self.launcher = StepLauncher(self.job, self.steps, key, router)
        saved = store.snapshot()  # a `slurmrl stop` holds for every later start of the same job
        self.ending = Ending(user_stop=saved.stop_asked and saved.job_id == layout.job_id)
        # A supervisor of an older run may still answer on the socket (its node was cut off, its
        # processes live on): this run takes the socket over, and the old one is fenced.
        self.take_over = saved.job_id == layout.job_id and saved.requeues < fence.run
        self.left_over = adoption.left_over(saved, layout.job_id)  # the old run's engines SLURM may not have ended
        self.pool = ThreadPoolExecutor(max_workers=max(4, len(layout.engines)), thread_name_prefix="recover")
        self.scalars = ScalarWriter(job_dir.supervisor_tensorboard)
        self.tracker = HealthTracker(ft.health_check_failure_threshold, ft.rollout_health_check_first_wait)
        self.budget = KillBudget(ft.max_kill_fraction, ft.rollout_health_check_interval)
        self.nodes = NodeFailures(self.job)
        self.requeue = Requeue(self.job, self.launcher, self.nodes.tracker, self.ending)
        self.trainer_nodes = TrainerNodeLoss(self.job, self.nodes, self.launcher, self.steps, self.requeue)
        # kept across a supervisor crash, so a crash-looping trainer still meets max_trainer_restarts
        record = self.predecessor.steps.get(TRAINER) if self.predecessor else None
        self.trainer = TrainerWatch(self.job, self.launcher, self.steps, self.requeue, self.ending, self.pool,
                                    restarts=record.restarts if record else 0)
        self.recovery = EngineRecovery(self.job, self.launcher, self.steps, self.nodes, self.tracker, self.requeue,
                                       self.ending, self.pool, self.scalars)
        # started through the control socket; its rollout profiles change how their engines are probed
        self.profiling = Profiling(self.job, self.recovery.serving)
        handlers = ControlHandlers(self.job, self.launcher, self.steps, self.recovery, self.trainer, self.requeue,
                                   self.ending, self.pool, self.profiling, self._last_checkpoint)
        self.control = ControlServer(job_dir, handlers.table(), run=CallerRun.here())
        self.cycles = 0  # monitor cycles: the x axis of the supervisor's TensorBoard scalars

    # ------------------------------------------------------------------ run
    def run(self) -> str:
        job = self.job
        with job.store.update() as state:
            if state.job_id != job.layout.job_id:  # a new job in the same directory: not its lost nodes
                state.lost_nodes = {}
            state.job_id = job.layout.job_id
            state.requeues = own_run()
            state.stop_reason = None
            state.stop_asked = self.ending.by_user  # a new job in the same directory starts without it
        job.engines.record_start()
        # SLURM's warning (--signal=B:USR1@preempt_grace, before a preemption or the time limit).
        signal.signal(signal.SIGUSR1, lambda signum, frame: self.requeue.preemption.warned())
        # SIGTERM (scancel, a site's preemption): save now (Submitit's handler only logs "Bypassing signal").
        signal.signal(signal.SIGTERM, lambda signum, frame: self.requeue.preemption.terminated())
        job.events.emit("supervisor_started", job_id=job.layout.job_id, head=job.layout.head,
                        engines=len(job.engines), requeues=job.store.snapshot().requeues, pid=os.getpid(),
                        watchdog_restarts=int(os.environ.get(RESTARTS_ENV, "0")))
        try:
            adoption.stop_left_over(job, self.steps, self.left_over)
            adopted = adoption.adopt(job, self.predecessor, self.steps, self.launcher, self.trainer)
            # Only now: the trainer's calls wait until the adopted engines' versions are re-checked.
            self.control.start(take_over=self.take_over)
            # No router of ours: an external one, an adopted one, or none at all (--debug-train-only).
            router = (self.launcher.start_router() if job.spec.starts_engines and not job.spec.rollout.external_router
                      and ROUTER not in adopted else None)
            # The engines and the trainer start while the router does; the trainer loads (imports,
            # checkpoint) while the engines start: its first publish waits for them (ready_engines).
            # Colocated, it would take GPU memory they are taking: it starts once they answered.
            beside = TRAINER not in adopted and not job.spec.rollout.colocate

            def launched() -> None:
                if beside:
                    self.trainer.launch()
                if router is not None:
                    self.launcher.await_router(router)  # before the engines' wait: it admits them
            self.recovery.start_all(adopted, then=launched)
            if TRAINER not in adopted and not beside:
                self.trainer.launch()
            outcome = self._monitor()
            self._set_stop_reason(outcome)
            if requeues(outcome):
                self._stop_steps()
                not_requeued = self.requeue.requeue(job.store.snapshot().requeues)
                if not_requeued:
                    self._set_stop_reason(not_requeued)
            return outcome
        except Fenced as err:
            log.warning("%s", err)
            return FENCED
        except JobFailed as err:
            if self.fence.fenced:  # a newer run of the job goes on: its state is not ours to write
                log.warning("fenced, after: %s", err)
                return FENCED
            self._set_stop_reason(f"failed: {err}")
            job.events.emit("job_failed", reason=str(err))
            raise
        finally:
            self._shutdown()

    def _set_stop_reason(self, reason: str) -> None:
        with self.job.store.update() as state:
            state.stop_reason = reason
            state.last_checkpoint = self._last_checkpoint()

    # ------------------------------------------------------------------ monitoring
    def _monitor(self) -> str:
        interval = self.job.ft.rollout_health_check_interval
        next_probe = 0.0
        while True:
            timeout = max(0.0, next_probe - time.monotonic())
            try:
                step = self.job.inbox.get(timeout=timeout)
            except queue.Empty:
                step = None
            self.fence.check()  # a newer run started: nothing more of this one's acts
            if self.ending.failure:
                raise JobFailed(self.ending.failure)
            self.trainer.check_deadline()  # preemption, the job's end
            if step is not None:
                outcome = self._on_exit(step)
                if outcome is not None:
                    return outcome
                continue
            began = time.monotonic()
            self._probe_cycle()
            self._record_steps()
            self.trainer.check_heartbeat()
            self.trainer.check_stranded_engines()
            for engine, why in self.nodes.check_due():
                self.recovery.recover(engine, why)
            self.trainer_nodes.follow_up()
            next_probe = self.tracker.next_cycle(began, time.monotonic(), interval,
                                                 self.job.ft.rollout_health_check_timeout)

    def _on_exit(self, step: Step) -> str | None:
        name = step.spec_name
        if self.launcher.current(name) is not step:
            return None  # a step we replaced on purpose, or a wake-up
        if name == TRAINER:
            self.trainer_nodes.exited(step)  # a lost node: a requeue, not a restart
            return self.trainer.on_exit(step)
        # Steps die with a job SLURM ends (scancel, requeue, time limit): relaunching them would only
        # race it, and the trainer may still be saving: its exit ends the job.
        if self.requeue.slurm_ending([name]):
            return None
        if name == ROUTER:
            self.job.events.emit("router_failed", ROUTER, reason=f"exited with code {step.returncode}")
            self._relaunch_router()
            return None
        self.recovery.recover(self.job.engines[name], f"process exited with code {step.returncode}")
        return None

    def _probe_cycle(self) -> None:
        job = self.job
        targets = {name: e.url for name, e in self.recovery.serving().items()}
        if not targets or job.gpus.trainer_holds:  # colocated engines that released their memory do not answer
            return
        # An engine in a weight update, or writing a rollout profile's trace, answers its generation probe
        # late: then only whether it is alive and reachable counts (a dead or cut-off engine must still leave
        # the router, not hold the job until the update's own timeout).
        publishing, tracing = self.trainer.publishing(), self.profiling.tracing()
        results = job.client.probe_all(
            targets, {name: LIVENESS_PATH if publishing or name in tracing else HEALTH_PATH for name in targets})
        now = time.time()
        with job.store.update() as state:
            for name, result in results.items():
                state.steps[name].last_probe_latency_s = round(result.latency_s, 4)
                state.steps[name].last_probe_time = now
        kill_cap.act_on_probes(job, self.recovery.recover, results, self.tracker.record(results), self.budget)

    def _record_steps(self) -> None:
        job = self.job
        running = self.launcher.all()
        self.steps.refresh(list(running.values()))
        up = job.engines.count(HEALTHY)
        with job.store.update() as state:  # the engines' own fields: their owner saves them on each change
            for name, step in running.items():
                if step.slurm_step and name in state.steps:
                    state.steps[name].slurm_step = step.slurm_step
        self.cycles += 1
        self.scalars.add_scalar("supervisor/engines_up", up, self.cycles)

    def _relaunch_router(self) -> None:
        began = time.time()
        self.launcher.launch_router()
        self.job.engines.rejoin_router()
        self.job.events.emit("router_relaunched", ROUTER, recover_s=round(time.time() - began, 3),
                             engines=sum(e.in_router for e in self.job.engines.values()))

    def _last_checkpoint(self) -> str | None:
        return last_checkpoint(self.job.spec.trainer.save)

    # ------------------------------------------------------------------ the end
    def _shutdown(self) -> None:
        if self.fence.fenced:
            # Its steps' ids may now be the newer run's: no scancel; its srun clients are killed
            # so that none cancels or signals a step later. SLURM ends the step processes left on
            # the cut node once that node registers again (the job no longer runs there).
            self.job.finished.set()
            for step in self.launcher.all().values():
                self.steps.abandon(step, self.job.ft.step_term_grace)
        else:
            self._stop_steps()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.steps.close()  # node agents: told to end (their engines are stopped already)
        self.control.close()
        self.job.client.close()
        self.scalars.close()
        self.job.events.emit("supervisor_stopped")
        self.job.events.close()

    def _stop_steps(self) -> None:
        job = self.job
        job.finished.set()
        why = job.store.snapshot().stop_reason or "the supervisor is ending"
        for name, step in self.launcher.all().items():
            if step.returncode is None:
                _note_in_log(job.dir.log(name), f"slurmrl: the supervisor stops this step ({why}); srun's "
                                                "'Terminated' or 'Killed' lines after this one are that stop")
                try:
                    self.steps.cancel(step, job.ft.step_stop_timeout, job.ft.step_term_grace)
                except Exception:  # keep stopping the others
                    log.exception("could not stop %s", name)
            if name in job.engines:
                job.engines.record_stopped(name)
            else:
                job.store.update_step(name, state="stopped")



def _note_in_log(path: Path, line: str) -> None:
    try:
        with open(path, "a") as log:
            log.write(line + "\n")
    except OSError:  # a log we cannot write to must not keep a step running
        pass
