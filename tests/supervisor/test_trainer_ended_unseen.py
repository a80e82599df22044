"""A trainer that ends while no supervisor watches (the supervisor crashed; its watchdog starts
another) ends in the new supervisor with its own exit code, without SLURM's accounting: the
trainer's record of its finish (trainer_finished.json) says 0. Against the local step backend, which
(as a cluster without slurmdbd) keeps no exit code of a step no supervisor saw end."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from contract.job_dir import write_trainer_finished
from contract.spec import FaultToleranceSpec, JobSpec, RolloutSpec
from supervisor import adoption
from supervisor.launcher import TRAINER
from supervisor.local_steps import LocalSteps
from supervisor.state import StepRecord
from supervisor.step_control import UNKNOWN_EXIT
from tests.supervisor.job_context import two_engine_job
from tests.supervisor.recovery_wiring import wire_recovery

STAND_IN_EXIT_S = 10.0  # the adopted trainer's stand-in exiting once released


@pytest.mark.parametrize(("finish", "expected"), [
    ("after its launch", 0),
    ("a predecessor's, before its launch", UNKNOWN_EXIT),
    ("none", UNKNOWN_EXIT),
])
def test_a_trainer_that_ended_unseen_ends_with_its_own_record_of_a_finish(tmp_path: Path, finish: str,
                                                                          expected: int) -> None:
    ft = FaultToleranceSpec(slurm_command_timeout=5.0, step_exit_code_wait=0.5)
    spec = JobSpec(job_dir=str(tmp_path / "job"), rollout=RolloutSpec(engine="cpu", num_engines=2), fault_tolerance=ft)
    job, router = two_engine_job(spec, head="n0", node="n1", het_group=1)
    launched = time.time() - 60
    with job.store.update() as state:  # what the crashed supervisor recorded of its trainer step
        state.job_id = job.layout.job_id
        state.steps[TRAINER] = StepRecord(TRAINER, "trainer", 0, ["n0"], slurm_step="999999.5", launched_at=launched)
    if finish == "after its launch":
        write_trainer_finished(job.dir)
    elif finish.startswith("a predecessor's"):
        job.dir.trainer_finished.write_text(json.dumps({"time": launched - 30, "pid": 1}))
    wiring = wire_recovery(job, router, LocalSteps(job.layout.job_id, tmp_path / "steps"))
    try:
        adopted = adoption.adopt(job, job.store.snapshot(), wiring.steps, wiring.launcher, wiring.trainer)
        trainer = wiring.launcher.current(TRAINER)
        assert adopted == {TRAINER} and trainer is not None and trainer.proc is not None
        assert trainer.proc.wait(STAND_IN_EXIT_S) == expected
        [unseen] = [e for e in map(json.loads, job.dir.events.read_text().splitlines())
                    if e["kind"] == "step_ended_unseen"]
        assert unseen["exit_code"] == expected and unseen["slurm_step"] == "999999.5"
    finally:
        wiring.stop()
        job.events.close()
        job.client.close()
