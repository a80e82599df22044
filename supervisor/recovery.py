"""Engines started, recovered and given up on. Which engines are being recovered is kept by the
engines' owner (supervisor/engines.py): `recover` asks it to check and mark in one step, so the
monitor, a control call and a trainer's report that all see one failure start one recovery.
While an engine is marked, its recovery thread alone asks for changes of its state, place and
restart counts."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import cast

from rollout.engine_client import EngineError, ProbeResult
from slurm.contact import retry_delays
from supervisor.context import Ending, JobContext, restart_backoff
from supervisor.engine_states import FAILED, HEALTHY
from supervisor.engines import Engine, EngineStartError, roles_missing, wait_healthy
from supervisor.fencing import Fenced
from supervisor.launcher import JobFailed, StepLauncher
from supervisor.node_failures import NodeFailures
from supervisor.probe import HealthTracker
from supervisor.requeue import Requeue
from supervisor.step_control import Step, StepControl
from supervisor.tensorboard import ScalarWriter

log = logging.getLogger(__name__)

_SYNC_TRIES = 3  # loads from disk in a row when the trainer keeps publishing meanwhile
_ADMIT_POLL_S = 0.2  # between two looks whether a recovered engine is in the router


class EngineRecovery:
    def __init__(self, job: JobContext, launcher: StepLauncher, steps: StepControl, nodes: NodeFailures,
                 tracker: HealthTracker, requeue: Requeue, ending: Ending, pool: Executor,
                 scalars: ScalarWriter) -> None:
        self.job = job
        self.launcher = launcher
        self.steps = steps
        self.nodes = nodes
        self.tracker = tracker
        self.requeue = requeue
        self.ending = ending
        self.pool = pool
        self.scalars = scalars
        self.started = threading.Event()  # start_all is over: every engine answered, or failed to

    # ------------------------------------------------------------------ what others may ask
    def is_recovering(self, name: str) -> bool:
        return self.job.engines.is_recovering(name)

    def serving(self) -> dict[str, Engine]:
        """Engines that serve, or wait for, the current weights: probed, and given the next version."""
        return self.job.engines.serving()

    # ------------------------------------------------------------------ recovery
    def recover(self, engine: Engine, reason: str) -> bool:
        """Take the engine out and bring it back, in a worker thread (the caller goes on). False
        when it is being recovered already or was given up."""
        if self.ending.by_slurm:  # the job is ending: nothing is relaunched
            return False
        detected = time.time()
        job = self.job
        if not job.engines.start_recovering(engine, reason):
            return False
        job.events.emit("engine_failed", engine.name, reason=reason, url=engine.url)
        if not job.ft.use_fault_tolerance:
            self.ending.fail(f"{engine.name} failed ({reason}) and use_fault_tolerance is off")
            job.wake_monitor(engine.name)
            return True
        self.pool.submit(self._restart, engine, detected)
        return True

    def check_reported(self, engine: Engine, reason: str) -> None:
        """One failed request is not yet a failed engine: the router can send a request on a
        keep-alive connection the engine is just closing (SGLang closes idle ones after 5 s, the
        router keeps them 50 s). One probe decides; a healthy engine stays in."""
        if self.is_recovering(engine.name):
            return
        result = self.job.client.probe_all({engine.name: engine.url})[engine.name]
        if result.ok:
            self.job.events.emit("engine_report_dismissed", engine.name, reason=reason,
                                 probe_s=round(result.latency_s, 3))
            return
        self.recover(engine, f"reported by the trainer: {reason}; then /health_generate: {result.error}")

    def _restart(self, engine: Engine, detected: float) -> None:
        job = self.job
        try:
            while True:
                try:
                    step = self.launcher.current(engine.name)
                    if step is not None and step.returncode is None:
                        self._stop_step(engine, step)
                    break
                except (subprocess.TimeoutExpired, TimeoutError) as err:  # scancel or squeue did not answer
                    if not self._wait_for_slurm(engine, f"stopping its step: {err}"):
                        raise
            job.engines.forget_old_crashes(engine, job.ft.crash_window)
            if not self._relaunch_until_up(engine):
                return
            self._finish(engine)  # out of the recovering set: among the ready engines again
            deadline = time.monotonic() + job.ft.engine_admit_timeout
            # A publish during the sync leaves it one version behind: the next publish includes it.
            while not engine.in_router and time.monotonic() < deadline and not job.finished.wait(_ADMIT_POLL_S):
                pass
            recover_s = round(time.time() - detected, 3)
            job.events.emit("engine_recovered", engine.name, restarts=engine.restarts, recover_s=recover_s,
                            weight_version=engine.version, in_router=engine.in_router)
            total = sum(e.restarts for e in job.engines.values())
            self.scalars.add_scalar("supervisor/engine_restarts", total, total)
            self.scalars.add_scalar("supervisor/recover_seconds", recover_s, total)
        except Fenced:  # a newer run of the job owns its steps: the monitor stops this supervisor
            job.wake_monitor(engine.name)
        except Exception as err:  # a recovery that breaks must not leave the engine half-handled
            log.exception("recovering %s failed", engine.name)
            job.events.emit("engine_restart_failed", engine.name, reason=repr(err))
            self.give_up(engine, cause=f"its recovery failed: {err!r}")
        finally:
            self._finish(engine)

    def _relaunch_until_up(self, engine: Engine) -> bool:
        """Launch again (with backoff) until the engine answers; False when given up meanwhile."""
        ft = self.job.ft
        refusals = 0  # launches SLURM refused for its rate limit, in a row
        while True:
            lost_node = self.nodes.place_on_live_node(engine)
            if lost_node is not None:
                self.give_up(engine, lost_node=lost_node)
                return False
            if engine.recent_restarts >= ft.max_engine_restarts:
                self.give_up(engine)
                return False
            if self.job.finished.wait(restart_backoff(ft, engine.recent_restarts)):
                return False
            if self.job.gpus.trainer_holds:
                self.job.events.emit("engine_start_deferred", engine.name, reason="the trainer holds the GPUs")
            with self.job.gpus.engine_start(self.job.finished) as go:  # colocated: never beside a training trainer
                if not go:
                    return False
                self.job.engines.count_restart(engine)
                launched = time.monotonic()
                step = self.launch(engine)
                try:
                    with self.nodes.watching(engine, step):
                        self.await_engine(engine, step)
                    return True
                except (EngineStartError, EngineError) as err:
                    self.job.events.emit("engine_restart_failed", engine.name, reason=str(err),
                                         attempt=engine.restarts)
                    if step.returncode is None:
                        self._stop_step(engine, step)
                    said = self.steps.rate_limited(step)
                    if said is not None:  # SLURM's refusal, not the engine's failure: again, slower
                        self.job.engines.uncount_crash(engine)
                        if not self._wait_out_rate_limit(engine, said, refusals):
                            return False
                        refusals += 1
                        continue
                    self.steps.query()  # a fresh look: whether SLURM answers now
                    if self.steps.contact.failed_since(launched):
                        # SLURM did not answer meanwhile (srun gives up on a silent slurmctld): not
                        # the engine's failure, so not a restart of its crash loop.
                        self.job.engines.uncount_crash(engine)
                        if not self._wait_for_slurm(engine, f"its relaunch: {err}"):
                            return False

    def _wait_out_rate_limit(self, engine: Engine, said: str, refusals: int) -> bool:
        """SLURM refused the engine's launch for its RPC rate limit (the pace of launches has halved):
        wait retry_delays()[refusals] before the next try. False if the job ends first or SLURM
        kept refusing for SLURM_OUTAGE_LIMIT_S."""
        delays = retry_delays()
        if refusals >= len(delays):
            return False
        self.job.events.emit("slurm_rate_limited", engine.name, said=said, retry_in_s=delays[refusals],
                             refusals=refusals + 1)
        return not self.job.finished.wait(delays[refusals])

    def _wait_for_slurm(self, engine: Engine, during: str) -> bool:
        """Ask SLURM again, with backoff, until it answers: True then; False if the job ends first
        or SLURM stays silent past SLURM_OUTAGE_LIMIT_S."""
        began = time.monotonic()
        self.job.events.emit("slurm_unanswered", engine.name, call=during)
        for delay in retry_delays():
            if self.job.finished.wait(delay):
                return False
            asked = time.monotonic()
            self.steps.query()
            if not self.steps.contact.failed_since(asked):
                self.job.events.emit("slurm_answers", engine.name, waited_s=round(time.monotonic() - began, 3))
                return True
        return False

    def _finish(self, engine: Engine) -> None:
        self.job.engines.finish_recovering(engine)

    def _stop_step(self, engine: Engine, step: Step) -> None:
        """Cancel the engine's step (killed instead once its node is found lost: NodeFailures.watching)."""
        ft = self.job.ft
        with self.nodes.watching(engine, step) as lost:
            try:
                self.steps.cancel(step, ft.step_stop_timeout, ft.step_term_grace)
            except (TimeoutError, subprocess.TimeoutExpired):  # SLURM lists a lost node's steps a while
                if not lost.is_set():
                    raise

    def give_up(self, engine: Engine, lost_node: str | None = None, cause: str | None = None) -> None:
        """No more restarts: after a crash loop, or when its node is lost and no spare is left (no
        fault of the engine's). The job goes on with the engines left while min_engines are; below
        that, a crash loop fails the job and a lost node requeues it without that node."""
        job, ft = self.job, self.job.ft
        if not job.engines.give_up(engine):
            return  # given up already: once is enough
        reason = (f"node {lost_node} is lost and no spare node is left" if lost_node else cause or
                  f"{engine.recent_restarts} restarts in a row, each within crash_window {ft.crash_window:.0f} s")
        job.events.emit("engine_given_up", engine.name, restarts=engine.restarts, reason=reason)
        live = sum(e.state != FAILED for e in job.engines.values())
        missing = roles_missing(job.engines.values())
        if live >= ft.min_engines and not missing:
            job.events.emit("engine_degraded", engine.name, engines=live, min_engines=ft.min_engines)
            return
        short = (f"no {' or '.join(missing)} engine left" if missing
                 else f"{live} engines left, below min_engines {ft.min_engines}")
        if lost_node:
            # The preemption path (Requeue.check): the trainer saves now, the job requeues.
            self.requeue.without_node(lost_node, f"node {lost_node} is lost: {short}; requeue without it")
        else:
            self.ending.fail(f"{short}: {engine.name} kept failing")
        job.wake_monitor(engine.name)

    # ------------------------------------------------------------------ starting and syncing
    def launch(self, engine: Engine) -> Step:
        step = self.launcher.launch_engine(engine)
        self.job.engines.launched(engine)
        self.tracker.started(engine.name)
        return step

    def start_all(self, adopted: set[str], then: Callable[[], None] | None = None) -> None:
        """The job's first start of its engines (or a successor's, with some adopted); `then` runs
        once they are launched, before the wait (the trainer loads meanwhile); waits until each
        answered. JobFailed when too few did. `started` is set once this is over, either way."""
        try:
            self._start_all(adopted, then)
        finally:
            self.started.set()

    def _start_all(self, adopted: set[str], then: Callable[[], None] | None) -> None:
        job, ft = self.job, self.job.ft
        for engine in job.engines.values():
            if engine.name not in adopted:
                self.launch(engine)
                continue
            self.tracker.started(engine.name)
            if engine.state == HEALTHY:  # adopted, and it answered: no first-wait
                self.tracker.record({engine.name: ProbeResult(ok=True, latency_s=0.0)})
        if then is not None:
            then()
        # each engine was launched or adopted above: its step is the current one
        waits = {name: self.pool.submit(self._first_start, engine, cast(Step, self.launcher.current(name)))
                 for name, engine in job.engines.items() if engine.state != HEALTHY}
        problems = {name: str(w.exception()) for name, w in waits.items() if w.exception() is not None}
        for name, problem in problems.items():
            job.events.emit("engine_start_failed", name, reason=problem)
            job.engines.give_up(job.engines[name], reason=problem)
        alive = len(job.engines) - len(problems)
        if problems and (not ft.use_fault_tolerance or alive < ft.min_engines
                         or roles_missing(job.engines.values())):
            raise JobFailed(f"{len(problems)} of {len(job.engines)} engines did not start: "
                            f"{'; '.join(problems.values())}")

    def _first_start(self, engine: Engine, step: Step) -> None:
        """await_engine; a launch SLURM refused for its rate limit is launched again, slower."""
        refusals = 0
        while True:
            try:
                self.await_engine(engine, step)
                return
            except EngineStartError:
                said = self.steps.rate_limited(step)
                if said is None or not self._wait_out_rate_limit(engine, said, refusals):
                    raise
                refusals += 1
                step = self.launch(engine)

    def await_engine(self, engine: Engine, step: Step) -> None:
        """Until the engine answers (EngineStartError if it does not), then at the current weights."""
        job = self.job
        wait_healthy(job.client, engine, job.ft.engine_start_timeout, lambda: step.returncode is None)
        self.tracker.record({engine.name: ProbeResult(ok=True, latency_s=0.0)})  # answered: first-wait is over
        if job.engines.answered(engine, adopted=step.adopted):
            self.sync(engine)

    def sync(self, engine: Engine) -> None:
        """Bring a waiting engine to the current version from disk, if it is there, and admit it.
        The trainer may publish meanwhile: then load the newer version (a few tries)."""
        job = self.job
        for _ in range(_SYNC_TRIES):
            current = job.engines.current
            folder = job.dir.weights_of(current) if current is not None else None
            if current is None or folder is None or not folder.is_dir():
                return  # not on disk (an update group): the trainer's next publish includes it
            if engine.version != current:
                job.engines.loaded(engine, folder, current, timeout_s=job.ft.weight_load_timeout)
            if job.engines.admit(engine):
                return
