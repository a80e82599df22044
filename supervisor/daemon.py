"""The supervisor: the job's batch step on the head node. It launches the router, one step per
engine and the trainer, watches them (step exits at once; engines' /health_generate in parallel),
restarts what fails per the failure table, keeps the router to engines at the current weight
version, and answers the control socket (`slurmrl status|restart|events|stop`).

Submitted by `slurmrl submit` as `Supervisor(spec)` (Submitit pickles it), or started by a plain
sbatch template as `python -m supervisor --job-dir DIR`.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import asdict
from pathlib import Path
from typing import Any

import requests
import submitit

from ckpt_tools.torch_dist import read_tracker
from jobs.spec import JobSpec
from rollout.launch import (
    EngineLaunch,
    RouterLaunch,
    cpu_engine_command,
    passthrough,
    router_command,
    sglang_command,
)
from rollout.router_client import RouterClient
from supervisor import layout as layouts
from supervisor.control import ControlServer
from supervisor.engines import (
    FAILED,
    HEALTHY,
    RESTARTING,
    STARTING,
    WAITING,
    Engine,
    EngineClient,
    EngineStartError,
    Membership,
    newest_weights,
    wait_healthy,
)
from supervisor.events import EVENTS_FILE, EventLog
from supervisor.keys import create_key, step_env
from supervisor.nodes import LostNodeWatch, NodeTracker
from supervisor.preemption import Preemption, SlurmJob
from supervisor.probe import HealthTracker, KillBudget, Prober, ProbeResult
from supervisor.state import JobState, StateStore, StepRecord
from supervisor.steps import Step, StepController, StepSpec
from supervisor.trainer_files import read_heartbeat, seconds_to_boundary
from supervisor.watchdog import RESTARTS_ENV

log = logging.getLogger(__name__)

ROUTER, TRAINER = "router", "trainer"
REQUEUE = "preempted: saved, then requeued"
# A restart within this many seconds of the previous one continues a crash loop (backoff doubles,
# the breaker counts it); an engine that ran longer starts afresh.
CRASH_WINDOW_S = 300.0
# How often an engine's node is checked while its step is stopped or started again (a lost node
# must be released before SLURM marks it DOWN: see supervisor/nodes.py).
NODE_POLL_S = 1.0
NODE_CHECK_S = 15.0  # every engine and spare node, one scontrol call, this often


class JobFailed(RuntimeError):
    """The job cannot go on; the message is the reason `slurmrl status` shows."""


class Supervisor(submitit.helpers.Checkpointable):
    """The callable Submitit runs in the batch step."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec

    def __call__(self) -> str:
        return Daemon(self.spec).run()


class Daemon:
    def __init__(self, spec: JobSpec) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s supervisor %(levelname)s %(message)s")
        self.spec = spec
        self.ft = spec.fault_tolerance
        self.job_dir = Path(spec.job_dir)
        self.layout = layouts.from_environment(spec)
        self.python = spec.python or sys.executable
        self.events = EventLog(self.job_dir / EVENTS_FILE)
        self.store = StateStore(self.job_dir)
        self.predecessor = self._predecessor()
        self.key = create_key(self.job_dir)  # a predecessor's key: its steps were started with it
        self.env = {**step_env(self.key), "SLURMRL_JOB_DIR": str(self.job_dir)}
        self.steps = StepController(self.layout.job_id, on_exit=lambda step: self.exits.put(step))
        self.exits: queue.Queue[Step] = queue.Queue()
        self.running: dict[str, Step] = {}
        self.client = EngineClient(self.key, self.ft.rollout_health_check_timeout)
        self.router_ports = self._router_ports()
        router_url = (f"http://{spec.rollout.sglang_router_ip}:{spec.rollout.sglang_router_port}"
                      if spec.rollout.external_router else f"http://{self.layout.head_address}:{self.router_ports[0]}")
        self.router_url = router_url
        self.membership = Membership(RouterClient(router_url, self.key), self.client, self.key)
        self.engines = {place.name: Engine(place) for place in self.layout.engines}
        self.recovering: set[str] = set()
        # Node failures: the rollout group's spare nodes, the nodes lost so far.
        self.nodes = NodeTracker(self.layout.job_id, self.layout.spare_nodes, keep=self.layout.trainer_nodes)
        self.node_watch = LostNodeWatch(self.nodes.check, self._node_lost, NODE_POLL_S)
        self.next_node_check = 0.0  # monotonic time of the next _check_nodes
        self.requeue_excluding: set[str] = set()  # lost nodes the job requeues to get off (see _give_up)
        self.tracker = HealthTracker(self.ft.health_check_failure_threshold, self.ft.rollout_health_check_first_wait)
        # One prober (event loop thread, HTTP session) for the job's life, not one per cycle.
        self.prober = Prober(self.ft.rollout_health_check_timeout, self.key)
        self.budget = KillBudget(self.ft.max_kill_fraction, self.ft.rollout_health_check_interval)
        self.pool = ThreadPoolExecutor(max_workers=max(4, len(self.engines)), thread_name_prefix="recover")
        # a `slurmrl stop` holds for every later start of the same job (a crash, a requeue)
        saved = self.store.snapshot()
        self.user_stop = saved.stop_asked and saved.job_id == self.layout.job_id
        self.stop_requested = self.user_stop
        # kept across a supervisor crash, so a crash-looping trainer still meets max_trainer_restarts
        trainer_record = self.predecessor.steps.get(TRAINER) if self.predecessor else None
        self.trainer_restarts = trainer_record.restarts if trainer_record else 0
        self.failure: str | None = None
        self.cycles = 0  # monitor cycles: the x axis of the supervisor's TensorBoard scalars
        self.slurm_job = SlurmJob(self.layout.job_id)
        self.preemption = Preemption(self.ft.preempt_grace, self.slurm_job)
        self.save_now_sent = False
        self.trainer_launched = 0.0  # unix time of the trainer step's (re)launch
        self.trainer_ended_why: str | None = None  # why the supervisor ended the trainer step, if it did
        self.finished = threading.Event()
        self.control = ControlServer(self.job_dir)
        for name in ("status", "restart", "stop", "ready_engines", "published", "engine_failed", "trainer_poll"):
            self.control.register(name, getattr(self, f"_on_{name}"))
        from torch.utils.tensorboard import SummaryWriter

        self.tensorboard = SummaryWriter(str(self.job_dir / "tensorboard" / "supervisor"))

    # ------------------------------------------------------------------ run
    def run(self) -> str:
        with self.store.update() as state:
            state.job_id = self.layout.job_id
            state.requeues = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
            state.stop_reason = None
            state.stop_asked = self.user_stop  # a new job in the same directory starts without it
            for engine in self.engines.values():
                state.steps[engine.name] = StepRecord(engine.name, "engine", engine.place.het_group,
                                                      list(engine.place.nodes), url=engine.url)
        # SLURM's warning (--signal=B:USR1@preempt_grace, before a preemption or the time limit).
        signal.signal(signal.SIGUSR1, lambda signum, frame: self.preemption.warned())
        self.events.emit("supervisor_started", job_id=self.layout.job_id, head=self.layout.head,
                         engines=len(self.engines), requeues=self.store.snapshot().requeues, pid=os.getpid(),
                         watchdog_restarts=int(os.environ.get(RESTARTS_ENV, "0")))
        try:
            adopted = self._adopt()
            # Only now: the trainer's calls wait until the adopted engines' versions are re-checked.
            self.control.start()
            if not self.spec.rollout.external_router and ROUTER not in adopted:
                self._launch_router()
            self._start_engines(adopted)
            if TRAINER not in adopted:
                self._launch_trainer()
            outcome = self._monitor()
            self._set_stop_reason(outcome)
            if outcome == REQUEUE:
                self._stop_steps()
                self._requeue()
            return outcome
        except JobFailed as err:
            self._set_stop_reason(f"failed: {err}")
            self.events.emit("job_failed", reason=str(err))
            raise
        finally:
            self._shutdown()

    def _set_stop_reason(self, reason: str) -> None:
        with self.store.update() as state:
            state.stop_reason = reason
            state.last_checkpoint = self._last_checkpoint()

    # ------------------------------------------------------------------ launching
    def _launch(self, name: str, kind: str, argv: list[str], nodes: tuple[str, ...], het_group: int, *,
                ntasks: int = 1, gpus_per_node: int = 0, cpus_per_task: int | None = None,
                overlap: bool = False, env: dict[str, str] | None = None) -> Step:
        spec = StepSpec(name=name, argv=tuple(argv), nodes=nodes, log=self.job_dir / "logs" / f"{name}.log",
                        het_group=het_group if self.spec.het_groups > 1 else None, ntasks=ntasks,
                        gpus_per_node=gpus_per_node, cpus_per_task=cpus_per_task, overlap=overlap,
                        env={**self.env, **(env or {})},
                        # where the job was submitted from: relative paths and plug-ins resolve there
                        workdir=os.environ.get("SLURM_SUBMIT_DIR"))
        step = self.steps.launch(spec)
        self.running[name] = step
        with self.store.update() as state:
            record = state.steps.get(name) or StepRecord(name, kind, het_group, list(nodes))
            record.state, record.slurm_step = STARTING, None
            state.steps[name] = record
        self.events.emit("step_launched", name, step_kind=kind, nodes=list(nodes))
        return step

    def _with_key(self, argv: list[str]) -> list[str]:
        """[python, -m, MODULE, ARGS...] run so that the job's key joins ARGS only inside the process."""
        python, dash_m, module, *args = argv
        assert dash_m == "-m", argv
        return [python, "-m", "supervisor.with_key", module, *args]

    def _launch_router(self) -> None:
        launch = RouterLaunch(self.layout.head_address, *self.router_ports,
                              policy="round_robin", router_args=passthrough(self.spec.rollout.router_args, "router"))
        # --overlap: the router shares the head node's CPUs with the trainer's tasks.
        self._launch(ROUTER, "router", self._with_key(router_command(launch, self.python)), (self.layout.head,), 0,
                     overlap=True)
        deadline = time.monotonic() + 60
        while not self.membership.router.alive():
            if self.running[ROUTER].returncode is not None or time.monotonic() > deadline:
                raise JobFailed(f"the router did not start (see {self.job_dir}/logs/router.log)")
            time.sleep(0.2)
        self.store.update_step(ROUTER, state=HEALTHY, url=self.router_url)

    def _launch_engine(self, engine: Engine) -> None:
        place, r = engine.place, self.spec.rollout
        launch = EngineLaunch(self.spec.trainer.hf_checkpoint, place.address, place.port,
                              tp=max(1, place.gpus_per_node))
        command = cpu_engine_command(launch, self.python) if r.engine == "cpu" else sglang_command(launch, self.python)
        self._launch(engine.name, "engine", self._with_key(command + passthrough(r.sglang_args, "sglang")),
                     place.nodes, place.het_group, gpus_per_node=place.gpus_per_node,
                     cpus_per_task=r.cpus_per_engine)
        engine.state, engine.version, engine.in_router = STARTING, None, False
        self.tracker.started(engine.name)

    def _predecessor(self) -> JobState | None:
        """The state left by a supervisor of this same allocation that crashed (its watchdog started
        this one); None on the job's first start and after a requeue, whose steps SLURM ended."""
        state = self.store.snapshot()
        same_run = state.requeues == int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        return state if state.job_id == self.layout.job_id and same_run else None

    def _router_ports(self) -> tuple[int, int]:
        """The router runs here, on the head node: its ports are checked free (and kept on relaunch);
        a predecessor's router keeps its port (adopted, or relaunched on it)."""
        record = self.predecessor.steps.get(ROUTER) if self.predecessor else None
        head = self.layout.head_address
        port = (int(record.url.rsplit(":", 1)[1]) if record and record.url
                else layouts.port_free_here(head, self.layout.router_port))
        return port, layouts.port_free_here(head, self.layout.router_metrics_port)

    def _adopt(self) -> set[str]:
        """Steps a predecessor (see _predecessor) left running are kept, not duplicated, and its
        engines re-checked; a trainer that ended meanwhile ends here as if seen. (After a requeue
        SLURM has ended them all: everything is launched afresh.)"""
        if self.predecessor is None:
            return set()
        recorded = {name: record.slurm_step for name, record in self.predecessor.steps.items()}
        steps = self.steps.adopt({name: recorded.get(name) for name in (ROUTER, *self.engines, TRAINER)})
        if steps is None:
            raise JobFailed("SLURM did not answer which steps are still running; not launching duplicates")
        for step in steps:
            self.running[step.spec_name] = step
            self.events.emit("step_adopted", step.spec_name, slurm_step=step.slurm_step)
        adopted = {step.spec_name for step in steps}
        if TRAINER in adopted:
            self.trainer_launched = time.time()  # its heartbeat is judged from here on
        elif recorded.get(TRAINER):
            self._trainer_ended_unseen(recorded[TRAINER])
            adopted.add(TRAINER)
        self._restore_engines(self.predecessor, adopted)
        return adopted

    def _trainer_ended_unseen(self, step_id: str) -> None:
        """The trainer ended while no supervisor watched: its end reaches the monitor like any
        trainer exit, with the exit code SLURM's accounting has (0: the job is complete)."""
        step = self.steps.ended(TRAINER, step_id)
        self.running[TRAINER] = step
        self.events.emit("step_ended_unseen", TRAINER, slurm_step=step_id, exit_code=step.proc.wait())

    def _restore_engines(self, predecessor: JobState, adopted: set[str]) -> None:
        """The predecessor's weight version, and its router's members re-checked: an adopted engine
        stays in the router only if it answers with the current version; any other leaves it."""
        self.membership.current = predecessor.weight_version
        router_kept = ROUTER in adopted or self.spec.rollout.external_router
        listed = set(self.membership.router.workers()) if router_kept else set()
        for engine in self.engines.values():
            record = predecessor.steps.get(engine.name)
            engine.restarts = record.restarts if record else 0
            engine.in_router = engine.url in listed
            if engine.name in adopted:
                engine.version = self._served_version(engine)
            if engine.name in adopted and engine.in_router and engine.version == self.membership.current:
                engine.state = HEALTHY
            else:
                self.membership.expel(engine)

    def _served_version(self, engine: Engine) -> str | None:
        try:
            return self.client.version(engine.url)
        except requests.RequestException:
            return None  # not answering: not at the current version, as far as routing goes

    def _start_engines(self, adopted: set[str]) -> None:
        for engine in self.engines.values():
            if engine.name not in adopted:
                self._launch_engine(engine)
                continue
            self.tracker.started(engine.name)
            if engine.state == HEALTHY:  # adopted, and it answered: no first-wait
                self.tracker.record({engine.name: ProbeResult(ok=True, latency_s=0.0)})
        waits = {name: self.pool.submit(self._await_engine, engine) for name, engine in self.engines.items()
                 if engine.state != HEALTHY}
        problems = {name: str(w.exception()) for name, w in waits.items() if w.exception() is not None}
        for name, problem in problems.items():
            self.events.emit("engine_start_failed", name, reason=problem)
            self.engines[name].state = FAILED
            self.store.update_step(name, state=FAILED, last_failure=problem)
        alive = len(self.engines) - len(problems)
        if problems and (not self.ft.use_fault_tolerance or alive < self.ft.min_engines):
            raise JobFailed(f"{len(problems)} of {len(self.engines)} engines did not start: "
                            f"{'; '.join(problems.values())}")

    def _await_engine(self, engine: Engine) -> None:
        step = self.running[engine.name]
        wait_healthy(self.client, engine, max(60.0, self.ft.rollout_health_check_first_wait),
                     lambda: step.returncode is None)
        self.tracker.record({engine.name: ProbeResult(ok=True, latency_s=0.0)})  # answered: its first-wait is over
        with self.membership.lock:  # a publish meanwhile finds it waiting, or has made its version current
            engine.state = WAITING  # until it serves the current weight version
            # An adopted engine off the current version took a publish during the gap (its report
            # is on the way) or was being synced: the trainer's report or next publish brings it in;
            # a sync from disk could take it a version back.
            off_version = step.adopted and engine.version != self.membership.current
        self.store.update_step(engine.name, state=WAITING)
        if not off_version:
            self._sync(engine)

    def _launch_trainer(self) -> None:
        t, layout = self.spec.trainer, self.layout
        argv = [self.python, "-m", "trainer", *t.train_args, "--job-dir", str(self.job_dir), "--supervised",
                "--sglang-router-ip", self.router_url.split("//")[1].split(":")[0],
                "--sglang-router-port", self.router_url.rsplit(":", 1)[1],
                "--master-port", str(layouts.port_free_here(layout.head_address, layout.trainer_master_port))]
        # The master by address: a node's name need not resolve (the devcluster's do not).
        self.trainer_launched, self.trainer_ended_why = time.time(), None
        self._launch(TRAINER, "trainer", argv, layout.trainer_nodes, 0, ntasks=len(layout.trainer_nodes) * t.tasks_per_node,
                     gpus_per_node=t.actor_num_gpus_per_node, cpus_per_task=t.cpus_per_task,
                     env={"MASTER_ADDR": layout.head_address})

    # ------------------------------------------------------------------ weights
    def _sync(self, engine: Engine) -> None:
        """Bring a waiting engine to the current version from disk, if it is there, and admit it.
        The trainer may publish meanwhile: then load the newer version (a few tries)."""
        for _ in range(3):
            with self.membership.lock:
                current = self.membership.current
            folder = newest_weights(self.job_dir / "weights", current)
            if folder is None:
                return  # not on disk (an update group): the trainer's next publish includes it
            if engine.version != current:
                self.client.load_from_disk(engine.url, folder, current, timeout_s=600)
                engine.version = current
            if self.membership.admit(engine):
                self.store.update_step(engine.name, state=HEALTHY, weight_version=engine.version)
                return

    # ------------------------------------------------------------------ monitoring
    def _monitor(self) -> str:
        interval = self.ft.rollout_health_check_interval
        next_probe = time.monotonic()
        while True:
            timeout = max(0.0, next_probe - time.monotonic())
            try:
                step = self.exits.get(timeout=timeout)
            except queue.Empty:
                step = None
            if self.failure:
                raise JobFailed(self.failure)
            self._check_preemption()
            if step is not None:
                outcome = self._on_exit(step)
                if outcome is not None:
                    return outcome
                continue
            self._probe_cycle()
            self._record_steps()
            self._check_trainer_heartbeat()
            self._check_nodes()
            next_probe = time.monotonic() + interval

    def _on_exit(self, step: Step) -> str | None:
        name = step.spec_name
        rc = step.returncode
        if self.running.get(name) is not step:
            return None  # a step we replaced on purpose
        if name == TRAINER:
            # A trainer the supervisor ended (hung, `slurmrl restart`) may still exit 0: it saves on SIGTERM.
            if rc == 0 and not self.trainer_ended_why:
                self.events.emit("trainer_finished", TRAINER)
                if self.user_stop:
                    return "stopped by user"
                if self.preemption.reason:
                    return REQUEUE
                # Saved on SLURM's SIGTERM (scancel, scontrol requeue): SLURM requeues or ends the job.
                return "ended by SLURM after the trainer saved" if self.slurm_job.ending() else "completed"
            reason = self.trainer_ended_why or f"trainer exited with code {rc} (see {self.job_dir}/logs/trainer.log)"
            if self.preemption.reason:  # no restart now: the job requeues from its last checkpoint
                self.events.emit("trainer_failed", TRAINER, reason=reason)
                return REQUEUE
            return self._trainer_failed(reason)
        if name == ROUTER:
            self.events.emit("router_failed", ROUTER, reason=f"exited with code {rc}")
            self._relaunch_router()
            return None
        engine = self.engines[name]
        if name not in self.recovering:
            self._recover(engine, f"process exited with code {rc}")
        return None

    def _probe_cycle(self) -> None:
        targets = {e.name: e.url for e in self.engines.values()
                   if e.state in (WAITING, HEALTHY) and e.name not in self.recovering}
        if not targets:
            return
        results = self.prober.probe_all(targets)
        now = time.time()
        with self.store.update() as state:
            for name, result in results.items():
                state.steps[name].last_probe_latency_s = round(result.latency_s, 4)
                state.steps[name].last_probe_time = now
        failed = self.tracker.record(results)
        for name in self.budget.allow(failed, dead=set(), total_engines=len(self.engines)):
            self._recover(self.engines[name], f"/health_generate failed {self.ft.health_check_failure_threshold} "
                                              f"times in a row ({results[name].error})")

    def _record_steps(self) -> None:
        statuses = self.steps.refresh(list(self.running.values()))
        up = sum(e.state == HEALTHY for e in self.engines.values())
        with self.store.update() as state:
            for name, step in self.running.items():
                if step.slurm_step and name in state.steps:
                    state.steps[name].slurm_step = step.slurm_step
            for engine in self.engines.values():
                record = state.steps[engine.name]
                record.state, record.restarts, record.weight_version = engine.state, engine.restarts, engine.version
            state.weight_version = self.membership.current
        self.cycles += 1
        self.tensorboard.add_scalar("supervisor/engines_up", up, self.cycles)
        log.debug("steps: %s", statuses)

    # ------------------------------------------------------------------ recovery
    def _recover(self, engine: Engine, reason: str) -> None:
        """Take the engine out and bring it back, in a worker thread (the monitor goes on)."""
        if engine.name in self.recovering or engine.state == FAILED:
            return
        detected = time.time()
        self.recovering.add(engine.name)
        engine.state = RESTARTING
        self.membership.expel(engine)
        self.events.emit("engine_failed", engine.name, reason=reason, url=engine.url)
        self.store.update_step(engine.name, state=RESTARTING, last_failure=reason)
        if not self.ft.use_fault_tolerance:
            self.failure = f"{engine.name} failed ({reason}) and use_fault_tolerance is off"
            self.exits.put(Step(engine.name, None))  # wake the monitor
            return
        self.pool.submit(self._restart_engine, engine, detected)

    def _restart_engine(self, engine: Engine, detected: float) -> None:
        try:
            step = self.running.get(engine.name)
            if step is not None and step.returncode is None:
                self._stop_engine_step(engine, step)
            if time.time() - engine.last_restart > CRASH_WINDOW_S:
                engine.recent_restarts = 0
            while True:
                if not self._on_live_node(engine):
                    return  # its node is lost and no spare is left: given up
                if engine.recent_restarts >= self.ft.max_engine_restarts:
                    self._give_up(engine)
                    return
                if self.finished.wait(self._backoff(engine.recent_restarts)):
                    return
                engine.restarts += 1
                engine.recent_restarts += 1
                engine.last_restart = time.time()
                self._launch_engine(engine)
                try:
                    with self._watching_node(engine, self.running[engine.name]):
                        self._await_engine(engine)
                    break
                except EngineStartError as err:
                    self.events.emit("engine_restart_failed", engine.name, reason=str(err), attempt=engine.restarts)
                    step = self.running[engine.name]
                    if step.returncode is None:
                        self._stop_engine_step(engine, step)
            # A publish during the sync leaves it one version behind: the next publish includes it
            # (it is among the ready engines again once out of `recovering`).
            self.recovering.discard(engine.name)
            deadline = time.monotonic() + 120
            while not engine.in_router and time.monotonic() < deadline and not self.finished.wait(0.2):
                pass
            recover_s = round(time.time() - detected, 3)
            self.events.emit("engine_recovered", engine.name, restarts=engine.restarts, recover_s=recover_s,
                             weight_version=engine.version, in_router=engine.in_router)
            total = sum(e.restarts for e in self.engines.values())
            self.tensorboard.add_scalar("supervisor/engine_restarts", total, total)
            self.tensorboard.add_scalar("supervisor/recover_seconds", recover_s, total)
        except Exception as err:  # a recovery that breaks must not leave the engine half-handled
            log.exception("recovering %s failed", engine.name)
            self.events.emit("engine_restart_failed", engine.name, reason=repr(err))
            self._give_up(engine)
        finally:
            self.recovering.discard(engine.name)
            self.store.update_step(engine.name, state=engine.state, restarts=engine.restarts,
                                   weight_version=engine.version)

    def _stop_engine_step(self, engine: Engine, step: Step) -> None:
        """Cancel the engine's step (killed instead once its node is found lost: _watching_node)."""
        with self._watching_node(engine, step) as lost:
            try:
                self.steps.cancel(step)
            except (TimeoutError, subprocess.TimeoutExpired):  # SLURM lists a lost node's steps a while
                if not lost.is_set():
                    raise

    @contextmanager
    def _watching_node(self, engine: Engine, step: Step) -> Iterator[threading.Event]:
        """While in the block, watch the engine's node; once SLURM calls it unusable, release it and
        kill the step's srun (or an adopted step's stand-in), which ends the block's wait on the
        step, and set the event yielded. Seen on a dead node: scancel ends the step's srun after some
        seconds, but an srun launched there again waits for the dead step's CPUs."""
        def kill_srun() -> None:
            with suppress(ProcessLookupError):
                os.killpg(step.proc.pid, signal.SIGKILL)

        with self.node_watch.watching(engine.place.nodes, kill_srun) as lost:
            yield lost

    def _on_live_node(self, engine: Engine) -> bool:
        """Before a (re)launch: if the engine's node is lost, move the engine to a spare node (a fresh
        start there: not part of a crash loop) or, with none left, give it up. False when given up."""
        lost = self.nodes.check(engine.place.nodes)
        if not lost:
            return True
        for node, why in {**lost, **self.nodes.check(self.nodes.spares)}.items():
            self._node_lost(node, why)
        spare = self.nodes.take_spare()
        if spare is None:
            self._give_up(engine, lost_node=next(iter(lost)))
            return False
        old = engine.place.nodes
        self.membership.expel(engine)  # under its old url, if it is still listed
        engine.place = self.layout.moved(engine.place, spare)
        engine.recent_restarts = 0
        self.store.update_step(engine.name, nodes=[spare], url=engine.url)
        self.events.emit("engine_moved", engine.name, from_nodes=list(old), to_node=spare, url=engine.url)
        return True

    def _check_nodes(self) -> None:
        """Every NODE_CHECK_S, all engine and spare nodes in one query: a lost node is released
        before SLURM marks it DOWN (which would requeue the whole hetjob), even one whose engine
        still answers or that holds no engine yet."""
        if time.monotonic() < self.next_node_check:
            return
        self.next_node_check = time.monotonic() + NODE_CHECK_S
        watched = {node for e in self.engines.values() if e.state != FAILED for node in e.place.nodes}
        for node, why in self.nodes.check(sorted(watched | set(self.nodes.spares))).items():
            self._node_lost(node, why)
            for engine in self.engines.values():
                if node in engine.place.nodes:
                    self._recover(engine, f"its node {node} is lost: {why}")

    def _node_lost(self, node: str, why: str) -> None:
        """The first time a node is seen lost: release it from the job, report it."""
        if self.nodes.lose(node, why):
            self.events.emit("node_failed", node=node, reason=why, allocation=self.nodes.release(node))

    def _backoff(self, recent_restarts: int) -> float:
        """None before the first restart of a loop, then restart_backoff, doubling."""
        return 0.0 if recent_restarts == 0 else self.ft.restart_backoff * 2 ** (recent_restarts - 1)

    def _give_up(self, engine: Engine, lost_node: str | None = None) -> None:
        """No more restarts: after a crash loop, or when its node is lost and no spare is left (no
        fault of the engine's). The job goes on with the engines left while min_engines are; below
        that, a crash loop fails the job and a lost node requeues it without that node."""
        engine.state = FAILED
        reason = (f"node {lost_node} is lost and no spare node is left" if lost_node else
                  f"{engine.recent_restarts} restarts in a row, each within {CRASH_WINDOW_S:.0f} s")
        self.events.emit("engine_given_up", engine.name, restarts=engine.restarts, reason=reason)
        live = sum(e.state != FAILED for e in self.engines.values())
        if live >= self.ft.min_engines:
            self.events.emit("engine_degraded", engine.name, engines=live, min_engines=self.ft.min_engines)
            return
        if lost_node:
            # The preemption path (see _check_preemption): the trainer saves now, the job requeues.
            self.requeue_excluding.add(lost_node)
            self.preemption.decide(f"node {lost_node} is lost: {live} engines left, below min_engines "
                                   f"{self.ft.min_engines}; requeue without it")
        else:
            self.failure = f"only {live} engines left (min_engines {self.ft.min_engines}): {engine.name} kept failing"
        self.exits.put(Step(engine.name, None))  # wake the monitor

    def _relaunch_router(self) -> None:
        began = time.time()
        self._launch_router()
        self.membership.rejoin_router([e for e in self.engines.values() if e.state == HEALTHY])
        self.events.emit("router_relaunched", ROUTER, recover_s=round(time.time() - began, 3),
                         engines=sum(e.in_router for e in self.engines.values()))

    def _trainer_failed(self, reason: str) -> str | None:
        self.events.emit("trainer_failed", TRAINER, reason=reason)
        if self.slurm_job.ending():
            raise JobFailed(f"{reason}; the job is ending (cancelled or out of time)")
        if not self.ft.use_fault_tolerance or self.trainer_restarts >= self.ft.max_trainer_restarts:
            raise JobFailed(reason)
        if self.finished.wait(self._backoff(self.trainer_restarts)):
            return None
        self.trainer_restarts += 1
        self._launch_trainer()  # it resumes from the latest checkpoint and republishes its weights
        self.store.update_step(TRAINER, restarts=self.trainer_restarts)
        self.events.emit("trainer_restarted", TRAINER, restarts=self.trainer_restarts)
        return None

    # ------------------------------------------------------------------ control socket
    def _engine_by_url(self, url: str) -> Engine | None:
        return next((e for e in self.engines.values() if e.url == url), None)

    def _on_status(self) -> dict[str, Any]:
        state = asdict(self.store.snapshot())
        state["last_checkpoint"] = self._last_checkpoint()
        state["time_left"] = self.slurm_job.time_left()
        return {"state": state}

    def _on_restart(self, target: str) -> dict[str, Any]:
        if target in self.engines:
            self._recover(self.engines[target], "restart asked with slurmrl restart")
        elif target in (ROUTER, TRAINER):
            self.events.emit("restart_requested", target)
            if target == TRAINER:
                self.trainer_ended_why = "restart asked with slurmrl restart"
            self.steps.cancel(self.running[target])  # its exit handler relaunches it
        else:
            raise ValueError(f"unknown step {target!r}; one of: {', '.join([*self.engines, ROUTER, TRAINER])}")
        return {"restarting": target}

    def _on_stop(self) -> dict[str, Any]:
        with self.store.update() as state:
            state.stop_asked = True
        self.user_stop = self.stop_requested = True
        self.events.emit("stop_requested")
        return {"stopping": True}

    def _on_ready_engines(self) -> dict[str, Any]:
        return {"engines": [e.url for e in self.engines.values()
                            if e.state in (WAITING, HEALTHY) and e.name not in self.recovering]}

    def _on_published(self, version: int, updated: list[str], fenced: dict[str, str]) -> dict[str, Any]:
        behind = self.membership.published(str(version), list(self.engines.values()), set(updated))
        with self.store.update() as state:
            state.weight_version = str(version)
            for engine in self.engines.values():
                state.steps[engine.name].weight_version = engine.version
        for url, reason in fenced.items():
            if (engine := self._engine_by_url(url)) is not None:
                self._recover(engine, f"weight update failed: {reason}")
        for engine in behind:
            if engine.url not in fenced:
                self.pool.submit(self._sync, engine)
        self.events.emit("weights_published", version=str(version), updated=len(updated), fenced=len(fenced))
        return {}

    def _on_engine_failed(self, url: str, reason: str) -> dict[str, Any]:
        if (engine := self._engine_by_url(url)) is not None and engine.name not in self.recovering:
            self.pool.submit(self._check_reported, engine, reason)
        return {}

    def _check_reported(self, engine: Engine, reason: str) -> None:
        """One failed request is not yet a failed engine: the router can send a request on a
        keep-alive connection the engine is just closing (SGLang closes idle ones after 5 s, the
        router keeps them 50 s). One probe decides; a healthy engine stays in."""
        result = self.prober.probe_all({engine.name: engine.url})[engine.name]
        if result.ok:
            self.events.emit("engine_report_dismissed", engine.name, reason=reason,
                             probe_s=round(result.latency_s, 3))
            return
        self._recover(engine, f"reported by the trainer: {reason}; then /health_generate: {result.error}")

    def _check_trainer_heartbeat(self) -> None:
        """A trainer whose heartbeat stays in one phase past that phase's timeout is hung (a rank
        stuck in a collective, a dead engine connection...): end its step; its exit restarts it."""
        step = self.running.get(TRAINER)
        if step is None or step.returncode is not None or self.trainer_ended_why:
            return
        beat = read_heartbeat(self.job_dir, self.trainer_launched)
        age, timeout = time.time() - beat.since, self.ft.phase_timeout(beat.phase)
        if age <= timeout:
            return
        self.trainer_ended_why = (f"trainer heartbeat stale: in phase {beat.phase} for {age:.0f} s "
                             f"(trainer_{beat.phase}_timeout {timeout:.0f} s)")
        self.events.emit("trainer_hung", TRAINER, reason=self.trainer_ended_why, phase=beat.phase,
                         rollout_id=beat.rollout_id)
        self.pool.submit(self.steps.cancel, step)

    def _on_trainer_poll(self, rollout_id: int) -> dict[str, Any]:
        return {"stop": self.stop_requested}

    # ------------------------------------------------------------------ helpers
    def _last_checkpoint(self) -> str | None:
        save = self.spec.trainer.save
        try:
            iteration = read_tracker(Path(save)) if save else None
        except (FileNotFoundError, ValueError):
            return None
        return f"{save}/iter_{iteration:07d}" if iteration is not None else None

    # ------------------------------------------------------------------ preemption and time limit
    def _check_preemption(self) -> None:
        """Once the job must stop (see supervisor/preemption.py): the trainer saves at its next
        rollout boundary and ends; then the job is requeued (see run). If the time left would not
        cover a rollout and a save (as the last ones took), it saves now instead."""
        reason = self.preemption.check()
        if reason is None:
            return
        time_left = self.preemption.seconds_left()
        needed = 2 * seconds_to_boundary(self.job_dir)  # twice: rollouts vary
        if not self.stop_requested:
            self.stop_requested = True
            self.events.emit("preemption", reason=reason, time_left_s=round(time_left, 1),
                             boundary_s=round(needed / 2, 1))
        if not self.save_now_sent and time_left < needed:
            self._tell_trainer_save_now(f"{time_left:.0f} s left, a rollout and a save take about {needed / 2:.0f} s")

    def _tell_trainer_save_now(self, why: str) -> None:
        """SIGUSR1 to every trainer task: abandon the running rollout, or skip the publish, and save."""
        step = self.running.get(TRAINER)
        if step is None or step.returncode is not None or step.slurm_step is None:
            return  # not running (or SLURM has not listed it yet: the next cycle retries)
        done = subprocess.run(["scancel", "--signal=USR1", step.slurm_step], capture_output=True, text=True,
                              timeout=30)
        if done.returncode == 0:
            self.save_now_sent = True
            self.events.emit("save_now", TRAINER, reason=why)

    def _requeue(self) -> None:
        requeues = self.store.snapshot().requeues
        if requeues >= self.ft.max_requeues:
            self._set_stop_reason(f"preempted and saved; not requeued: max_requeues ({self.ft.max_requeues}) reached")
            return
        self.events.emit("requeue", requeues=requeues + 1, excluding=sorted(self.requeue_excluding))
        # SLURM answers the requeue with SIGTERM to the batch step: it must not cut the exclusion below
        # short (the steps are stopped already; KillWait's SIGKILL still ends this process).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            submitit_handler = signal.getsignal(signal.SIGUSR2)
            if callable(submitit_handler):
                # Submitit's own checkpoint-and-requeue (it pickles Supervisor again, then scontrol requeue).
                submitit_handler(signal.SIGUSR2, None)
            else:
                subprocess.run(["scontrol", "requeue", self.layout.job_id], check=True, capture_output=True, timeout=60)
        finally:  # (Submitit's handler ends in sys.exit) SLURM takes ExcNodeList only once requeued
            if self.requeue_excluding and not self.nodes.exclude(self.requeue_excluding):
                self.events.emit("exclude_failed", nodes=sorted(self.requeue_excluding),
                                 reason="scontrol update ExcNodeList was refused until the deadline")

    def _shutdown(self) -> None:
        self.finished.set()
        self._stop_steps()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.control.close()
        self.prober.close()
        self.tensorboard.close()
        self.events.emit("supervisor_stopped")
        self.events.close()

    def _stop_steps(self) -> None:
        self.finished.set()
        for name, step in list(self.running.items()):
            if step.returncode is None:
                try:
                    self.steps.cancel(step, timeout_s=20)
                except Exception:  # keep stopping the others
                    log.exception("could not stop %s", name)
            record_state = "stopped"
            if name in self.engines and self.engines[name].state == FAILED:
                record_state = FAILED
            self.store.update_step(name, state=record_state)
