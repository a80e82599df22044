"""What the supervisor answers on its control socket (contract/control_protocol.py): one handler per
call, in a table. Each runs in a connection's thread; the work that takes long goes to the pool."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import asdict
from typing import Any

from contract.control_protocol import Call
from rollout.engine_client import EngineError
from supervisor.context import Ending, JobContext
from supervisor.control import Handler
from supervisor.engine_states import LIVE
from supervisor.gpu_holder import ENGINES, RELEASED_TAGS
from supervisor.launcher import ROUTER, TRAINER, StepLauncher
from supervisor.profiling import Profiling
from supervisor.recovery import EngineRecovery
from supervisor.requeue import Requeue
from supervisor.step_control import StepControl
from supervisor.trainer_watch import TrainerWatch


class ControlHandlers:
    def __init__(self, job: JobContext, launcher: StepLauncher, steps: StepControl, recovery: EngineRecovery,
                 trainer: TrainerWatch, requeue: Requeue, ending: Ending, pool: Executor, profiling: Profiling,
                 last_checkpoint: Callable[[], str | None]) -> None:
        self.job = job
        self.launcher = launcher
        self.steps = steps
        self.recovery = recovery
        self.trainer = trainer
        self.requeue = requeue
        self.ending = ending
        self.pool = pool
        self.last_checkpoint = last_checkpoint
        self.profiling = profiling

    def table(self) -> dict[Call, Handler]:
        return {Call.STATUS: self.status, Call.RESTART: self.restart, Call.STOP: self.stop,
                Call.READY_ENGINES: self.ready_engines, Call.PUBLISHED: self.published,
                Call.ENGINE_FAILED: self.engine_failed, Call.ENGINE_UNRESPONSIVE: self.engine_unresponsive,
                Call.TRAINER_POLL: self.trainer_poll, Call.GPU_HOLDER: self.gpu_holder, Call.PROFILE: self.profile,
                Call.PLUGIN_ERROR: self.plugin_error}

    # ------------------------------------------------------------------ the CLI's calls
    def status(self) -> dict[str, Any]:
        state = asdict(self.job.store.snapshot())
        state["last_checkpoint"] = self.last_checkpoint()
        state["time_left"] = self.requeue.slurm_job.time_left()
        return {"state": state}

    def restart(self, target: str) -> dict[str, Any]:
        job = self.job
        if target in job.engines:
            self.recovery.recover(job.engines[target], "restart asked with slurmrl restart")
        elif target == TRAINER:
            self.trainer.restart_requested()
        elif target == ROUTER:
            job.events.emit("restart_requested", ROUTER)
            step = self.launcher.current(ROUTER)
            if step is None:
                raise ValueError("the router is not a step of this job (an external router, or "
                                 "--debug-train-only, which starts none)")
            self.steps.cancel(step, job.ft.step_stop_timeout, job.ft.step_term_grace)  # its exit relaunches it
        else:
            raise ValueError(f"unknown step {target!r}; one of: {', '.join([*job.engines, ROUTER, TRAINER])}")
        return {"restarting": target}

    def profile(self, target: str, steps: int) -> dict[str, Any]:
        return self.profiling.start(target, steps)

    def stop(self) -> dict[str, Any]:
        with self.job.store.update() as state:
            state.stop_asked = True
        self.ending.stop(by_user=True)
        self.job.events.emit("stop_requested")
        return {"stopping": True}

    # ------------------------------------------------------------------ the trainer's calls
    def ready_engines(self) -> dict[str, Any]:
        """The engines that get the next version, with how often each was launched again; `starting` while
        none does yet because the engines' first start is under way (the trainer, launched beside them,
        waits for one)."""
        serving = list(self.recovery.serving().values())
        urls = [e.url for e in serving]
        # launches: each engine's relaunches so far. A higher count at the same url is a new process, which
        # left the trainer's weight-update group with its old one: the trainer forms the group again.
        return {"engines": urls, "launches": {e.url: e.restarts for e in serving},
                "starting": not urls and not self.recovery.started.is_set()}

    def published(self, version: int, updated: list[str], dropped: dict[str, str]) -> dict[str, Any]:
        """dropped: the engines left out of this update, url -> why; each is recovered."""
        job = self.job
        behind = job.engines.published(version, set(updated))
        for url, reason in dropped.items():
            if (engine := job.engines.by_url(url)) is not None:
                self.recovery.recover(engine, f"weight update failed: {reason}")
        for engine in behind:
            if engine.url not in dropped:
                self.pool.submit(self.recovery.sync, engine)
        job.events.emit("weights_published", version=version, updated=len(updated), dropped=len(dropped))
        return {}

    def engine_failed(self, url: str, reason: str) -> dict[str, Any]:
        engine = self.job.engines.by_url(url)
        if engine is not None and not self.recovery.is_recovering(engine.name):
            self.pool.submit(self.recovery.check_reported, engine, reason)
        return {}

    def engine_unresponsive(self, url: str, reason: str) -> dict[str, Any]:
        """Its requests time out or come back unparseable (the trainer checked it with a request of
        its own): a probe that passes proves nothing here, so it is replaced as a failed engine is."""
        engine = self.job.engines.by_url(url)
        if engine is not None:
            self.pool.submit(self.recovery.recover, engine, f"reported by the trainer: {reason}")
        return {}

    def plugin_error(self, plugin: str, error: str, sample: int) -> dict[str, Any]:
        """A user function failed on a sample for the first time (later ones: the trainer's
        sample_errors metric): said once, with its exception."""
        self.job.events.emit("plugin_error", TRAINER, plugin=plugin, error=error, sample=sample)
        return {}

    def gpu_holder(self, holder: str, released: list[str]) -> dict[str, Any]:
        """--colocate (supervisor/gpu_holder.py). To the trainer: once no engine start is under way,
        release every live engine the trainer did not (one that came up meanwhile) and name them."""
        job = self.job
        if holder == ENGINES:
            job.gpus.to_engines()
            self._keep_gpu_holder(ENGINES, [])
            job.events.emit("gpus_to_engines")
            return {"released": []}
        if holder != TRAINER:
            raise ValueError(f"holder must be {ENGINES} or {TRAINER}, got {holder!r}")
        job.gpus.to_trainer(job.ft.engine_start_timeout)
        mine = []
        for engine in job.engines.values():
            if engine.state in LIVE and engine.url not in released:
                try:
                    job.client.release_memory(engine.url, RELEASED_TAGS)
                    mine.append(engine.url)
                except EngineError as err:  # its step is stopped (the memory with it) and restarted later
                    self.recovery.recover(engine, f"release of its memory failed: {err}")
        job.gpus.released(released + mine)
        self._keep_gpu_holder(TRAINER, released + mine)
        job.events.emit("gpus_to_trainer", released_by_trainer=len(released), released_by_supervisor=mine)
        return {"released": mine}

    def _keep_gpu_holder(self, holder: str, released: list[str]) -> None:
        with self.job.store.update() as state:
            state.gpu_holder, state.gpus_released = holder, sorted(released)

    def trainer_poll(self, rollout_id: int) -> dict[str, Any]:
        return {"stop": self.ending.stop_requested, "profile": self.profiling.take_train_request()}
