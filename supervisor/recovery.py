"""Engines started, recovered and given up on. Which engines are being recovered is kept by the
engines' owner (supervisor/engines.py): `recover` asks it to check and mark in one step, so the
monitor, a control call and a trainer's report that all see one failure start one recovery.
While an engine is marked, its recovery thread alone asks for changes of its state, place and
restart counts, and the mark is cleared once, by that thread, as its last act (end_recovery or,
cut short, abandon_recovery): two recoveries of one engine never overlap.

A recovery is a series of tries: stop the step, launch it again, wait until the engine answers and
serves the current weights, wait for the router to admit it. A failure seen while it waits for
admission (the trainer's publish dropped it, its probes fail) is that recovery's next try, not a
second recovery. The tries are bounded: max_engine_restarts in a row, and a try that fails the
same way as the one before (the same error line in the engine's log, the same wrong weight
version) gives the engine up at once: a restart does not fix it."""

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
from supervisor.engine_marks import RecoveryStart
from supervisor.engine_record import Engine, roles_missing
from supervisor.engine_start import EngineStartError, Tries, error_line, log_size, wait_healthy
from supervisor.engine_states import FAILED, HEALTHY
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
        self._log_starts: dict[str, int] = {}  # engine -> where its latest launch's output starts in its log

    # ------------------------------------------------------------------ what others may ask
    def is_recovering(self, name: str) -> bool:
        return self.job.engines.is_recovering(name)

    def serving(self) -> dict[str, Engine]:
        """Engines that serve, or wait for, the current weights: probed, and given the next version."""
        return self.job.engines.serving()

    # ------------------------------------------------------------------ recovery
    def recover(self, engine: Engine, reason: str) -> bool:
        """Take the engine out and bring it back, in a worker thread (the caller goes on). False
        when it is being recovered already or was given up; True also when its recovery was
        waiting for its admission: that recovery tries again."""
        if self.requeue.relaunch_refused(engine.name):  # the job is ending: nothing is relaunched
            return False
        detected = time.time()
        job = self.job
        started = job.engines.start_recovering(engine, reason)
        if started is RecoveryStart.REFUSED:
            return False
        retry = started is RecoveryStart.RETRY
        job.events.emit("engine_failed", engine.name, reason=reason, url=engine.url,
                        **({"during": "its recovery, waiting for admission"} if retry else {}))
        if not job.ft.use_fault_tolerance:
            self.ending.fail(f"{engine.name} failed ({reason}) and use_fault_tolerance is off")
            job.wake_monitor(engine.name)
            return True
        if not retry:
            if job.engines.count(HEALTHY) == 0:  # the router has no worker left: rollouts wait for one
                job.events.emit("no_engine_serving", engine.name,
                                engines={e.name: e.state.value for e in job.engines.values()})
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
        tries, over = Tries(), False
        try:
            job.engines.forget_old_crashes(engine, job.ft.crash_window)
            while True:
                self._stop_current(engine)
                if not self._relaunch_until_up(engine, tries):
                    return
                # A publish during the sync leaves it one version behind: the next publish includes it.
                retry, admitted = self._await_admission(engine)
                if job.finished.is_set():
                    return
                retry = retry or job.engines.end_recovery(engine)
                if retry is None:
                    over = True
                    break
                tries.failed(retry, None)
                job.events.emit("engine_restart_failed", engine.name, reason=retry, attempt=engine.restarts)
            recover_s = round(time.time() - detected, 3)
            # in_router: seen admitted (CI read the router's state after a publish had left it out)
            job.events.emit("engine_recovered", engine.name, restarts=engine.restarts, recover_s=recover_s,
                            weight_version=engine.version, in_router=admitted)
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
            if not over:  # ended short of end_recovery: the mark goes with it
                job.engines.abandon_recovery(engine)

    def _stop_current(self, engine: Engine) -> None:
        """Its step, if still running, cancelled (waiting out a SLURM that does not answer)."""
        while True:
            try:
                step = self.launcher.current(engine.name)
                if step is not None and step.returncode is None:
                    self._stop_step(engine, step)
                return
            except (subprocess.TimeoutExpired, TimeoutError) as err:  # scancel or squeue did not answer
                if not self._wait_for_slurm(engine, f"stopping its step: {err}"):
                    raise

    def _await_admission(self, engine: Engine) -> tuple[str | None, bool]:
        """Until the router lists the engine (the next publish brings it in), for engine_admit_timeout
        at most; a failure meanwhile (a publish dropped it, its probes failed) ends the wait, and the
        recovery tries again. Returns that failure's reason (or None), and whether it was admitted."""
        job = self.job
        job.engines.await_admission(engine)  # admitted already too: a failure from now on is this recovery's
        deadline = time.monotonic() + job.ft.engine_admit_timeout
        while time.monotonic() < deadline and not job.finished.wait(_ADMIT_POLL_S):
            if engine.in_router:
                return None, True
            if (retry := job.engines.take_retry(engine)) is not None:
                return retry, False
        return None, False

    def _relaunch_until_up(self, engine: Engine, tries: Tries) -> bool:
        """Launch again (with backoff) until the engine answers; False when given up meanwhile."""
        ft = self.job.ft
        refusals = 0  # launches SLURM refused for its rate limit, in a row
        while True:
            lost_node = self.nodes.place_on_live_node(engine)
            if lost_node is not None:
                self.give_up(engine, lost_node=lost_node)
                return False
            if tries.repeated:
                self.give_up(engine, cause=f"two tries in a row failed the same way ({tries.cause}): "
                                           f"a restart does not fix it; the last: {tries.last}")
                return False
            if engine.recent_restarts >= ft.max_engine_restarts:
                self.give_up(engine, cause=self._crash_loop(engine, tries))
                return False
            if self.job.finished.wait(restart_backoff(ft, engine.recent_restarts)):
                return False
            if self.job.gpus.trainer_holds:
                self.job.events.emit("engine_start_deferred", engine.name, reason="the trainer holds the GPUs")
            with self.job.gpus.engine_start(self.job.finished) as go:  # colocated: never beside a training trainer
                if not go or self.requeue.relaunch_refused(engine.name):  # or SLURM is ending the job
                    return False
                self.job.engines.count_restart(engine)
                launched = time.monotonic()
                step = self.launch(engine)
                try:
                    with self.nodes.watching(engine, step):
                        self.await_engine(engine, step)
                    return True
                except (EngineStartError, EngineError) as err:
                    cause = getattr(err, "cause", None)
                    tries.failed(str(err), cause)
                    self.job.events.emit("engine_restart_failed", engine.name, reason=str(err),
                                         attempt=engine.restarts, **({"cause": cause} if cause else {}))
                    if step.returncode is None:
                        self._stop_step(engine, step)
                    said = self.steps.rate_limited(step)
                    if said is not None:  # SLURM's refusal, not the engine's failure: again, slower
                        self.job.engines.uncount_crash(engine)
                        tries.failed(str(err), None)
                        if not self._wait_out_rate_limit(engine, said, refusals):
                            return False
                        refusals += 1
                        continue
                    self.steps.query()  # a fresh look: whether SLURM answers now
                    if self.steps.contact.failed_since(launched):
                        # SLURM did not answer meanwhile (srun gives up on a silent slurmctld): not
                        # the engine's failure, so not a restart of its crash loop.
                        self.job.engines.uncount_crash(engine)
                        tries.failed(str(err), None)
                        if not self._wait_for_slurm(engine, f"its relaunch: {err}"):
                            return False

    def _crash_loop(self, engine: Engine, tries: Tries) -> str:
        loop = (f"{engine.recent_restarts} restarts in a row, each within crash_window "
                f"{self.job.ft.crash_window:.0f} s")
        return f"{loop}; the last: {tries.last}" if tries.last else loop

    def _wait_out_rate_limit(self, engine: Engine, said: str, refusals: int) -> bool:
        """SLURM refused the engine's launch for its RPC rate limit (the pace of launches has halved):
        wait retry_delays()[refusals] before the next try. False if the job ends first (SLURM ends it
        included) or SLURM kept refusing for SLURM_OUTAGE_LIMIT_S."""
        delays = retry_delays()
        if refusals >= len(delays):
            return False
        self.job.events.emit("slurm_rate_limited", engine.name, said=said, retry_in_s=delays[refusals],
                             refusals=refusals + 1)
        return not self.job.finished.wait(delays[refusals]) and not self.requeue.relaunch_refused(engine.name)

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
        """No more restarts, and its step stopped: after a crash loop, a failure that repeats, or when
        its node is lost and no spare is left (no fault of the engine's). The job goes on with the
        engines left while min_engines are (and at least one); below that, a crash loop fails the
        job and a lost node requeues it without that node."""
        job, ft = self.job, self.job.ft
        if not job.engines.give_up(engine):
            return  # given up already: once is enough
        reason = (f"node {lost_node} is lost and no spare node is left" if lost_node else cause or
                  f"{engine.recent_restarts} restarts in a row, each within crash_window {ft.crash_window:.0f} s")
        job.events.emit("engine_given_up", engine.name, restarts=engine.restarts, reason=reason)
        self._stop_if_running(engine)
        live = sum(e.state != FAILED for e in job.engines.values())
        missing = roles_missing(job.engines.values())
        if live >= max(1, ft.min_engines) and not missing:
            job.events.emit("engine_degraded", engine.name, engines=live, min_engines=ft.min_engines)
            return
        short = (f"no {' or '.join(missing)} engine left" if missing
                 else "no engine left" if not live else f"{live} engines left, below min_engines {ft.min_engines}")
        if lost_node:
            # The preemption path (Requeue.check): the trainer saves now, the job requeues.
            self.requeue.without_node(lost_node, f"node {lost_node} is lost: {short}; requeue without it")
        else:
            self.ending.fail(f"{short}: {engine.name} was given up ({reason})")
        job.wake_monitor(engine.name)

    def _stop_if_running(self, engine: Engine) -> None:
        """A given-up engine's step must not run on (and hold its node's CPUs and GPUs)."""
        step = self.launcher.current(engine.name)
        if step is None or step.returncode is not None:
            return
        try:
            self._stop_step(engine, step)
        except Exception:  # SLURM did not answer, a newer run took over: the job's end stops it
            log.exception("could not stop the step of %s, given up", engine.name)

    # ------------------------------------------------------------------ starting and syncing
    def launch(self, engine: Engine) -> Step:
        self._log_starts[engine.name] = log_size(self.job.dir.log(engine.name))
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
        if problems and self.requeue.slurm_ending(problems):  # CI: an engine still starting at a scancel
            return
        for name, problem in problems.items():
            job.events.emit("engine_start_failed", name, reason=problem)
            job.engines.give_up(job.engines[name], reason=problem)
            self._stop_if_running(job.engines[name])
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
        """Until the engine answers (EngineStartError if it does not, with the error line of its
        log), then at the current weights (WrongVersion if it reports another after a load)."""
        job = self.job
        try:
            wait_healthy(job.client, engine.name, engine.url, job.ft.engine_start_timeout,
                         lambda: step.returncode is None)
        except EngineStartError as err:
            since = self._log_starts.get(engine.name)
            cause = error_line(job.dir.log(engine.name), since) if since is not None else None
            if cause is None:
                raise
            raise EngineStartError(f"{err}; its log says: {cause}", cause=cause) from None
        self.tracker.record({engine.name: ProbeResult(ok=True, latency_s=0.0)})  # answered: first-wait is over
        if job.engines.answered(engine, adopted=step.adopted):
            self._sync(engine)

    def sync(self, engine: Engine) -> None:
        """After a publish left the engine behind: bring it to the current version (below); a load
        that fails, or leaves it at another version, is a failure of the engine's."""
        try:
            self._sync(engine)
        except EngineError as err:
            self.recover(engine, f"its weight sync failed: {err}")

    def _sync(self, engine: Engine) -> None:
        """Bring a waiting engine to the current version from disk, if it is there, and admit it.
        The trainer may publish meanwhile, leaving it out: then load the newer version (a few tries)."""
        job = self.job
        with job.engines.syncing(engine) as mine:
            if not mine:
                return  # its sync under way takes the newer version (the loop below)
            for _ in range(_SYNC_TRIES):
                current = job.engines.current
                folder = job.dir.weights_of(current) if current is not None else None
                if current is None or folder is None or not folder.is_dir():
                    return  # not on disk (an update group): the trainer's next publish includes it
                if engine.version != current:
                    job.engines.loaded(engine, folder, current, timeout_s=job.ft.weight_load_timeout)
                if job.engines.admit(engine):
                    return
