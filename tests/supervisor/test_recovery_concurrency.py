"""One failure seen three ways at once (the monitor, `slurmrl restart` over the control socket, and
the trainer's report of a failed request) starts one recovery: EngineRecovery checks and marks
in one step. The recovery runs for real up to its crash-loop breaker (max_engine_restarts 0), so
no step is launched; the engine is then given up once, and later reports change nothing."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import pytest

from contract.control_protocol import Call, ControlClient
from slurm.devcluster.daemons import wait_for
from supervisor.control import ControlServer
from supervisor.engine_states import FAILED
from tests.supervisor.job_context import unplaced_job
from tests.supervisor.recovery_wiring import wire_recovery

CALLERS = 3
pytestmark = pytest.mark.usefixtures("slurm_programs")  # the recovery asks squeue and scancel


def test_three_callers_at_once_start_one_recovery(tmp_path: Path) -> None:
    job, router = unplaced_job(tmp_path)
    wiring = wire_recovery(job, router)
    recovery, handlers, ending, pool = wiring.recovery, wiring.handlers, wiring.ending, wiring.pool
    engine = job.engines["engine-0"]
    start = threading.Barrier(CALLERS)

    def monitor() -> None:  # as Daemon._on_exit does for an engine step that exited
        start.wait()
        recovery.recover(engine, "process exited with code 1")

    def control_call() -> None:  # `slurmrl restart engine-0`
        start.wait()
        ControlClient(job.dir, 10).call(Call.RESTART, target=engine.name)

    def trainer_report() -> None:  # the trainer's failed request: one probe, refused, then recover
        start.wait()
        ControlClient(job.dir, 10).call(Call.ENGINE_FAILED, url=engine.url, reason="connection reset")

    with ControlServer(job.dir, handlers.table()):
        threads = [threading.Thread(target=f) for f in (monitor, control_call, trainer_report)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        wait_for(lambda: engine.state == FAILED and not recovery.is_recovering(engine.name), 30, "the recovery ends")
        pool.shutdown(wait=True)  # the trainer report's probe ran to its end too
        # A later report of the given-up engine starts nothing.
        assert recovery.recover(engine, "late report") is False
    job.events.close()

    kinds = Counter((e["kind"], e["step"]) for e in map(json.loads, job.dir.events.read_text().splitlines()))
    assert kinds[("engine_failed", "engine-0")] == 1, kinds
    assert kinds[("engine_given_up", "engine-0")] == 1, kinds
    assert not any(step == "engine-1" for _, step in kinds), "the other engine was touched"
    assert job.store.snapshot().steps["engine-0"].state == FAILED
    assert ending.failure is None  # min_engines 0: the job goes on degraded
    job.client.close()
