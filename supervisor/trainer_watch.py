"""The trainer step as the supervisor watches it: its heartbeat against each phase's timeout, its
exit (the job's outcome, or a restart from the latest checkpoint), and restarts asked for."""

from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent.futures import Executor

from contract.job_dir import Phase, read_heartbeat, read_trainer_fatal
from rollout.engine_client import EngineError
from supervisor.context import Ending, JobContext, restart_backoff
from supervisor.engine_states import HEALTHY
from supervisor.gpu_holder import RELEASED_TAGS
from supervisor.launcher import TRAINER, JobFailed, StepLauncher
from supervisor.requeue import Requeue
from supervisor.step_control import Step, StepControl

log = logging.getLogger(__name__)

SAVE_NOW_EXITS = (128 + signal.SIGUSR1, -signal.SIGUSR1)  # a task ended by SIGUSR1 (srun's code; a process's)
# A trainer told to save now in its rollout abandons it at once (the round looks at the request every
# rollout.round_stop.STOP_POLL_S, and ends after its requests' next answer or backoff): one still in it
# this much later never got the signal or cannot act on it, and is cancelled (SIGTERM, itself a
# save-now; then SIGKILL).
SAVE_NOW_ANSWER_S = 30.0


class TrainerWatch:
    def __init__(self, job: JobContext, launcher: StepLauncher, steps: StepControl, requeue: Requeue,
                 ending: Ending, pool: Executor, restarts: int) -> None:
        self.job = job
        self.launcher = launcher
        self.steps = steps
        self.requeue = requeue
        self.ending = ending
        self.pool = pool
        self.restarts = restarts  # in the job's life (kept across a supervisor crash); monitor thread only
        self._lock = threading.Lock()
        self._launched = 0.0  # unix time of the step's (re)launch or adoption: its heartbeat counts from here
        self._ended_why: str | None = None  # why the supervisor ended the step, if it did
        self._beating = False  # its heartbeat has left the start phase: the step is healthy
        # monitor thread only (check_stranded_engines): since when engines are stranded; the step asked to save
        self._stranded_since: float | None = None
        self._save_asked: tuple[Step, float] | None = None

    def launch(self) -> None:
        with self._lock:
            self._launched, self._ended_why, self._beating = time.time(), None, False
        self.launcher.launch_trainer()

    def adopted(self) -> None:
        with self._lock:
            self._launched, self._beating = time.time(), False

    def _end(self, why: str) -> bool:
        """Mark the running step as ended by the supervisor; False if it was already."""
        with self._lock:
            if self._ended_why:
                return False
            self._ended_why = why
            return True

    def _cancel_later(self, step: Step) -> None:
        """Cancel the step in the pool (the monitor goes on meanwhile); its exit is handled by on_exit."""
        self.pool.submit(self.steps.cancel, step, self.job.ft.step_stop_timeout, self.job.ft.step_term_grace)

    def restart_requested(self) -> None:
        """`slurmrl restart trainer` (a control thread): end the step; its exit relaunches it."""
        step = self.launcher.current(TRAINER)
        if step is None:
            raise ValueError("the trainer has not been launched yet")
        self.job.events.emit("restart_requested", TRAINER)
        self._end("restart asked with slurmrl restart")
        self.steps.cancel(step, self.job.ft.step_stop_timeout, self.job.ft.step_term_grace)

    def check_stranded_engines(self) -> None:
        """Engines relaunched behind an update group's version (not on disk) wait outside the router for
        the trainer's next publish; with none serving, a trainer in its rollout waits for them in turn.
        After engine_stranded_timeout of that the trainer is asked to save now (SIGUSR1: it abandons the rollout and
        saves the last one it finished) and end; its exit restarts it, and the restarted trainer publishes
        to them first thing. One still in its rollout SAVE_NOW_ANSWER_S later, or that has not ended within
        trainer_save_timeout, is cancelled."""
        step = self.launcher.current(TRAINER)
        if step is None or step.returncode is not None:
            self._stranded_since = self._save_asked = None
            return
        now = time.monotonic()
        with self._lock:
            launched, ended = self._launched, self._ended_why
        if self._save_asked is not None:
            asked_step, asked_at = self._save_asked
            answered = read_heartbeat(self.job.dir, launched).phase is not Phase.ROLLOUT
            if asked_step is step and now - asked_at > (
                    self.job.ft.trainer_save_timeout if answered else SAVE_NOW_ANSWER_S):
                self._save_asked = None
                if not answered:
                    self.job.events.emit("save_now_unanswered", TRAINER, reason=(
                        f"still in its rollout {SAVE_NOW_ANSWER_S:.0f} s after the save-now signal: cancelled"))
                self._cancel_later(step)
            return
        current = self.job.engines.current
        stranded = self.job.engines.stranded() if current is not None and not self.job.dir.weights_of(
            current).is_dir() else []
        if not stranded or ended or read_heartbeat(self.job.dir, launched).phase is not Phase.ROLLOUT:
            self._stranded_since = None
            return
        if self._stranded_since is None:
            self._stranded_since = now
        why = (f"engines {', '.join(stranded)} wait for weight version {current}, which only a publish brings, "
               "while the trainer's rollout waits for them: restarted to publish it")
        if now - self._stranded_since < self.job.ft.engine_stranded_timeout or not self._end(why):
            return
        self._stranded_since = None
        self.job.events.emit("engines_stranded", TRAINER, reason=why, engines=stranded, weight_version=current)
        if self.requeue.signal_trainer("USR1"):
            self._save_asked = (step, now)
        else:  # SLURM did not take the signal: end it without a save (it resumes from its last checkpoint)
            self._cancel_later(step)

    def check_deadline(self) -> None:
        """Preemption and the job's end (Requeue.check), knowing the running trainer's phase. When no
        save could end before the job does, the trainer is ended at once without one (SIGKILL: its
        SIGTERM handler would begin a save) and the job requeues from its last complete checkpoint."""
        step = self.launcher.current(TRAINER)
        running = step is not None and step.returncode is None
        with self._lock:
            launched = self._launched
        why = self.requeue.check(read_heartbeat(self.job.dir, launched) if running else None)
        if why is None or step is None or not running or not self._end(why):
            return
        if not self.requeue.signal_trainer("KILL"):
            self._cancel_later(step)

    def publishing(self) -> bool:
        """The running trainer is updating the engines' weights (its heartbeat's phase is publish).
        SGLang's /health is a generation, which waits while a weight update runs: a probe then
        times out on an engine that is only busy. The update's own timeout fences an engine that
        hangs in it, and trainer_publish_timeout bounds the phase."""
        step = self.launcher.current(TRAINER)
        if step is None or step.returncode is not None:
            return False
        with self._lock:
            launched = self._launched
        return read_heartbeat(self.job.dir, launched).phase is Phase.PUBLISH

    def check_heartbeat(self) -> None:
        """A trainer whose heartbeat stays in one phase past that phase's timeout is hung (a rank
        stuck in a collective, a dead engine connection...): end its step; its exit restarts it."""
        step = self.launcher.current(TRAINER)
        if step is None or step.returncode is not None:
            return
        with self._lock:
            launched, ended = self._launched, self._ended_why
        if ended:
            return
        beat = read_heartbeat(self.job.dir, launched)
        if beat.phase is not Phase.START and not self._beating:
            self._beating = True  # monitor thread only, like the reset in launch()
            self.job.store.update_step(TRAINER, state=HEALTHY.value)
        age, timeout = time.time() - beat.time, self.job.ft.phase_timeout(beat.phase)
        if age <= timeout:
            return
        why = (f"trainer heartbeat stale: in phase {beat.phase.value} for {age:.0f} s "
               f"(trainer_{beat.phase.value}_timeout {timeout:.0f} s)")
        if self._end(why):
            self.job.events.emit("trainer_hung", TRAINER, reason=why, phase=beat.phase.value,
                                 rollout_id=beat.rollout_id)
            self._cancel_later(step)

    def on_exit(self, step: Step) -> str | None:
        """The trainer step ended: the job's outcome, or None once it is restarted."""
        rc = step.returncode
        with self._lock:
            ended_why, launched = self._ended_why, self._launched
        preempted = self.requeue.preemption.reason is not None
        # A trainer the supervisor ended (hung, `slurmrl restart`) may still exit 0: it saves on SIGTERM.
        if rc == 0 and not ended_why:
            self.job.events.emit("trainer_finished", TRAINER)
            if self.ending.by_user:
                return "stopped by user"
            if preempted:
                return self._after_preemption()
            # Saved on SLURM's SIGTERM (scancel, scontrol requeue): SLURM requeues or ends the job.
            return self._ended_by_slurm() or "completed"
        fatal = read_trainer_fatal(self.job.dir, launched) if rc else None
        stopped = None if fatal else self._stopped_for_requeue(rc, ended_why)
        if stopped is not None:
            self.job.events.emit("trainer_stopped", TRAINER, reason=stopped, code=rc)
            return self._after_preemption()
        reason = fatal or ended_why or f"trainer exited with code {rc} (see {self.job.dir.log(TRAINER)})"
        self.job.events.emit("trainer_failed", TRAINER, reason=reason, fatal=fatal is not None)
        if fatal:  # a restart (or a requeue) would fail the same way
            raise JobFailed(fatal)
        if preempted:  # no restart now: the job requeues from its last checkpoint
            return self._after_preemption()
        ending = self.requeue.slurm_job.ending_state()
        if ending is not None:  # it died with the job: a restart would only race SLURM
            return f"ended by SLURM ({ending}): {reason}"
        self._restart(reason)
        return None

    def _stopped_for_requeue(self, rc: int | None, ended_why: str | None) -> str | None:
        """Why an exit the preemption caused is no failure, or None: the supervisor ended the trainer
        because no save could end in time, or its save-now signal reached a trainer that had saved
        and was ending (Python gives SIGUSR1 its default action back as it exits: code 138)."""
        if self.requeue.unsaved is not None and ended_why == self.requeue.unsaved:
            return f"ended by the supervisor without a save: {ended_why}"
        if rc in SAVE_NOW_EXITS and self.requeue.save_now_sent:
            return (f"exited with code {rc}: the supervisor's save-now signal (SIGUSR1) reached it as it was "
                    "ending; the job requeues from its last checkpoint")
        return None

    def _after_preemption(self) -> str:
        """As SLURM intends: a job it is ending (scancel, a preemption that requeues by itself) just
        ends; one it keeps running (its warning, a SIGTERM to the batch step alone) is requeued."""
        return self._ended_by_slurm() or self.requeue.outcome

    def _ended_by_slurm(self) -> str | None:
        state = self.requeue.slurm_job.ending_state()
        return f"ended by SLURM ({state}) after the trainer saved" if state else None

    def _engines_take_back(self) -> None:
        """--colocate: a trainer that died holding the GPUs left the engines released; they take
        their memory back (each tag alone: the trainer may have resumed some) before the new
        trainer starts, which publishes to them at once."""
        if not self.job.gpus.trainer_holds:
            return
        urls = self.job.gpus.to_engines()
        for url in urls:
            for tag in RELEASED_TAGS:
                try:
                    self.job.client.resume_memory(url, [tag])
                except EngineError as err:  # not released (resumed already), or the engine is gone
                    log.info("resuming %s of %s: %s", tag, url, err)
        self.job.events.emit("gpus_to_engines", reason="the trainer died holding them", resumed=urls)

    def _restart(self, reason: str) -> None:
        ft = self.job.ft
        if not ft.use_fault_tolerance or self.restarts >= ft.max_trainer_restarts:
            raise JobFailed(reason)
        if self.job.finished.wait(restart_backoff(ft, self.restarts)):
            return
        self.restarts += 1
        self._engines_take_back()
        self.launch()  # it resumes from the latest checkpoint and republishes its weights
        self.job.store.update_step(TRAINER, restarts=self.restarts)
        self.job.events.emit("trainer_restarted", TRAINER, restarts=self.restarts)
