"""The engines' first start and the trainer's: the trainer is launched once the engines are
launched, before their wait (it loads while they start), and its ready_engines call says
`starting` while none of them is ready and that start is under way."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.engine_states import STARTING
from supervisor.launcher import JobFailed
from tests.supervisor.job_context import unplaced_job
from tests.supervisor.recovery_wiring import wire_recovery

pytestmark = pytest.mark.usefixtures("slurm_programs")  # the recovery's preemption check asks squeue


def test_the_trainer_is_launched_between_the_engines_launch_and_their_wait(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    job, router = unplaced_job(tmp_path)
    wiring = wire_recovery(job, router)
    recovery, order = wiring.recovery, []
    for engine in job.engines.values():
        engine.state = STARTING

    def launch(engine) -> None:
        order.append(f"launch {engine.name}")

    def await_engine(engine, step) -> None:
        assert "trainer" in order, "an engine was waited for before the trainer was launched"
        order.append(f"answered {engine.name}")
        assert handlers.ready_engines() == {"engines": [], "launches": {}, "starting": True}

    handlers = wiring.handlers
    monkeypatch.setattr(recovery, "launch", launch)
    monkeypatch.setattr(recovery, "await_engine", await_engine)
    recovery.start_all(set(), then=lambda: order.append("trainer"))
    assert order[:3] == ["launch engine-0", "launch engine-1", "trainer"]
    assert sorted(order[3:]) == ["answered engine-0", "answered engine-1"]
    # The start is over: an empty answer now means no engine serves, and the trainer goes on.
    assert recovery.started.is_set() and handlers.ready_engines() == {"engines": [], "launches": {}, "starting": False}
    wiring.pool.shutdown()


def test_a_failed_start_ends_the_wait_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job, router = unplaced_job(tmp_path)
    job.ft.min_engines = 2
    wiring = wire_recovery(job, router)
    for engine in job.engines.values():
        engine.state = STARTING

    def never_answers(engine, step) -> None:
        raise RuntimeError(f"{engine.name} did not answer")

    monkeypatch.setattr(wiring.recovery, "launch", lambda engine: None)
    monkeypatch.setattr(wiring.recovery, "await_engine", never_answers)
    with pytest.raises(JobFailed, match="2 of 2 engines did not start"):
        wiring.recovery.start_all(set())
    assert wiring.recovery.started.is_set()
    assert wiring.handlers.ready_engines() == {"engines": [], "launches": {}, "starting": False}
    wiring.pool.shutdown()


def test_ready_engines_lists_a_serving_engine_while_others_still_start(tmp_path: Path) -> None:
    job, router = unplaced_job(tmp_path)  # both engines HEALTHY
    wiring = wire_recovery(job, router)
    job.engines["engine-1"].state = STARTING
    job.engines["engine-0"].restarts = 2  # launched again twice: the trainer learns it, to form its group again
    assert wiring.handlers.ready_engines() == {"engines": [job.engines["engine-0"].url],
                                               "launches": {job.engines["engine-0"].url: 2}, "starting": False}
    wiring.pool.shutdown()
