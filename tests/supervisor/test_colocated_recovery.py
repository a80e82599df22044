"""Recovery in a colocated job (supervisor/gpu_holder.py): while the trainer holds the shared GPUs
no engine starts, so an engine that dies during training is relaunched only once the trainer has
offloaded and said so; the switch to the trainer waits out a start already under way, and an
engine the trainer did not release (one that came up meanwhile) is released by the supervisor
and named to the trainer, or, if that fails, replaced after training. The recovery runs for real
(EngineRecovery, ControlHandlers) with the launch and the start-up wait replaced by recorders."""

from __future__ import annotations

import dataclasses
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest

from contract.spec import FaultToleranceSpec, JobSpec, RolloutSpec
from slurm.devcluster.daemons import wait_for
from supervisor import adoption
from supervisor.context import Ending, JobContext
from supervisor.control_handlers import ControlHandlers
from supervisor.engine_record import Engine
from supervisor.engine_states import HEALTHY
from supervisor.gpu_holder import GpuHolder
from supervisor.launcher import StepLauncher
from supervisor.layout import EnginePlace
from supervisor.probe import HealthTracker
from supervisor.profiling import Profiling
from supervisor.recovery import EngineRecovery
from supervisor.tensorboard import ScalarWriter
from tests.supervisor.job_context import two_engine_job

QUIET_LOOK_S = 1.0  # how long a deferred start is watched not happening


def test_no_engine_start_while_the_trainer_holds_and_the_switch_waits_out_starts() -> None:
    holder, finished = GpuHolder(), threading.Event()
    entered, leave = threading.Event(), threading.Event()

    def start() -> None:
        with holder.engine_start(finished) as go:
            assert go
            entered.set()
            leave.wait(30)

    starting = threading.Thread(target=start)
    starting.start()
    entered.wait(30)
    assert holder.to_trainer(starts_timeout_s=0.2) is False  # a start under way: not yet
    leave.set()
    assert holder.to_trainer(starts_timeout_s=30) is True
    entered.clear()
    waiting = threading.Thread(target=start)
    waiting.start()
    assert not entered.wait(QUIET_LOOK_S)  # deferred while the trainer holds the GPUs
    holder.to_engines()
    assert entered.wait(30)
    waiting.join(30)
    starting.join(30)
    holder.to_trainer(starts_timeout_s=30)
    finished.set()
    with holder.engine_start(finished) as go:  # the job ends: nothing starts
        assert go is False


@pytest.fixture
def colocated(tmp_path: Path):
    ft = FaultToleranceSpec(use_fault_tolerance=True, max_engine_restarts=3, min_engines=0, restart_backoff=0.0,
                            rollout_health_check_timeout=2.0, engine_start_timeout=5.0)
    spec = JobSpec(job_dir=str(tmp_path), rollout=RolloutSpec(engine="cpu", num_engines=2, colocate=True),
                   fault_tolerance=ft)
    job, router = two_engine_job(spec, head="node1", node="node1", het_group=0)
    pool = ThreadPoolExecutor(max_workers=4)
    nodes = SimpleNamespace(place_on_live_node=lambda engine: None, watching=lambda engine, step: nullcontext())
    launcher = StepLauncher(job, SimpleNamespace(), "key", router)
    running = SimpleNamespace(relaunch_refused=lambda name: False)  # the requeue's word: SLURM is not ending the job
    recovery = EngineRecovery(job, launcher, SimpleNamespace(), nodes, HealthTracker(3, 0.0), running,
                              Ending(user_stop=False), pool, ScalarWriter(job.dir.supervisor_tensorboard))
    launched: list[tuple[str, bool]] = []  # (engine, did the trainer hold the GPUs at its launch)
    recovery.launch = lambda engine: launched.append((engine.name, job.gpus.trainer_holds)) or SimpleNamespace(
        returncode=None)
    def admitted(engine: Engine, step: object) -> None:  # it answers, at the current version, in the router
        engine.state, engine.in_router = HEALTHY, True
    recovery.await_engine = admitted
    handlers = ControlHandlers(job, launcher, SimpleNamespace(), recovery, SimpleNamespace(), SimpleNamespace(),
                               Ending(user_stop=False), pool, Profiling(job, recovery.serving), lambda: None)
    yield job, recovery, handlers, launched
    job.finished.set()
    pool.shutdown(wait=True)
    job.events.close()
    job.client.close()


def _events(job: JobContext) -> list[tuple[str, str | None]]:
    return [(e["kind"], e.get("step")) for e in map(json.loads, job.dir.events.read_text().splitlines())]


def test_an_engine_that_dies_during_training_restarts_after_the_trainer_offloads(colocated) -> None:
    job, recovery, handlers, launched = colocated
    e0, e1 = job.engines["engine-0"], job.engines["engine-1"]
    # The trainer released both engines itself and takes the GPUs
    assert handlers.gpu_holder("trainer", [e0.url, e1.url]) == {"released": []}
    recovery.recover(e0, "process exited with code 137")
    wait_for(lambda: ("engine_start_deferred", "engine-0") in _events(job), 30, "the deferred start")
    assert not wait_until_quiet(lambda: launched, QUIET_LOOK_S), "an engine started beside the training trainer"
    handlers.gpu_holder("engines", [])  # offloaded, engines resumed
    wait_for(lambda: launched == [("engine-0", False)], 30, "the relaunch once the engines hold the GPUs")
    wait_for(lambda: not recovery.is_recovering("engine-0"), 30, "the recovery's end")


def test_an_engine_the_trainer_did_not_release_is_released_or_replaced_after_training(colocated) -> None:
    job, recovery, handlers, launched = colocated
    e0 = job.engines["engine-0"]
    # engine-1 came up after the trainer listed the engines: the supervisor releases it (its port is
    # closed here, so the release fails) and, as it would hold memory, its step is replaced later.
    assert handlers.gpu_holder("trainer", [e0.url]) == {"released": []}
    events = _events(job)
    assert ("engine_failed", "engine-1") in events and ("engine_failed", "engine-0") not in events
    wait_for(lambda: ("engine_start_deferred", "engine-1") in _events(job), 30, "the deferred start")
    assert launched == []
    handlers.gpu_holder("engines", [])
    wait_for(lambda: launched == [("engine-1", False)], 30, "the relaunch after training")


def wait_until_quiet(probe, look_s: float):
    """probe()'s value after look_s: a bounded look that something does not happen."""
    threading.Event().wait(look_s)
    return probe()


def test_a_real_engine_released_by_the_supervisor_and_taken_back_when_the_trainer_dies(colocated,
                                                                                      tmp_path: Path) -> None:
    """With a CPU engine: the supervisor releases an engine the trainer did not (and names it), and
    a trainer that dies holding the GPUs leaves them to the engines, resumed, before its restart."""
    from supervisor.trainer_watch import TrainerWatch
    from tests.rollout.cpu_engine_helpers import EngineProcess, make_tiny_model

    job, recovery, handlers, launched = colocated
    proc = EngineProcess(make_tiny_model(tmp_path / "model"), tmp_path / "engine.log", api_key="key",
                         extra=["--skip-server-warmup", "--enable-memory-saver"])
    try:
        proc.wait_ready()
        live = job.engines["engine-1"]
        live.place = EnginePlace("engine-1", 1, ("node1",), "127.0.0.1", proc.port, 0, 0)  # the test's engine
        assert handlers.gpu_holder("trainer", [job.engines["engine-0"].url]) == {"released": [live.url]}
        assert not job.client.healthy(live.url)  # released: no answer to the probe
        watch = TrainerWatch(job, SimpleNamespace(), SimpleNamespace(), SimpleNamespace(), Ending(user_stop=False),
                             SimpleNamespace(), restarts=0)
        watch._engines_take_back()  # what a trainer restart does first
        assert not job.gpus.trainer_holds
        wait_for(lambda: job.client.healthy(live.url), 30, "the engine serving again")
        assert "memory resumed tags=weights" in proc.log_text() and "memory resumed tags=kv_cache" in proc.log_text()
        assert ("gpus_to_engines", None) in _events(job) and launched == []
    finally:
        proc.stop()


def test_a_restarted_supervisor_keeps_who_holds_the_gpus(colocated) -> None:
    job, _, handlers, _ = colocated
    e0, e1 = job.engines["engine-0"], job.engines["engine-1"]
    handlers.gpu_holder("trainer", [e1.url, e0.url])
    previous = job.store.snapshot()  # what the crashed supervisor left in supervisor_state.json
    successor = dataclasses.replace(job, gpus=GpuHolder())
    nothing_running = SimpleNamespace(adopt=lambda recorded: [])
    adoption.adopt(successor, previous, nothing_running, SimpleNamespace(), SimpleNamespace())
    assert successor.gpus.trainer_holds, "a successor let engines start beside the training trainer"
    assert successor.gpus.to_engines() == sorted([e0.url, e1.url]), "the released engines to resume"
    handlers.gpu_holder("engines", [])
    assert (job.store.snapshot().gpu_holder, job.store.snapshot().gpus_released) == ("engines", [])
