"""The supervisor's probe cycle pauses while the trainer updates the engines' weights: SGLang's
/health is a generation, which waits while an update runs, so a probe then fails on an engine that
is only busy. Outside the publish phase failed probes count as before. No SLURM: the trainer is a
plain process (LocalSteps) whose heartbeat the test writes; the engines' ports have no listener, so
every probe fails."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from contract.job_dir import Phase, write_heartbeat
from contract.spec import FaultToleranceSpec, JobSpec, RolloutSpec
from supervisor.daemon import Daemon
from supervisor.launcher import TRAINER
from supervisor.local_steps import LocalSteps
from supervisor.probe import HealthTracker, KillBudget
from tests.supervisor.job_context import two_engine_job
from tests.supervisor.recovery_wiring import Wiring, wire_recovery

EXIT_WAIT_S = 10.0  # a killed stand-in trainer's exit being seen


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[tuple[Wiring, HealthTracker, SimpleNamespace]]:
    ft = FaultToleranceSpec(use_fault_tolerance=True, step_stop_timeout=5.0, step_term_grace=1.0,
                            slurm_command_timeout=5.0, rollout_health_check_timeout=2.0)
    spec = JobSpec(job_dir=str(tmp_path / "job"), rollout=RolloutSpec(engine="cpu", num_engines=2), fault_tolerance=ft)
    job, router = two_engine_job(spec, head="n0", node="n1", het_group=1)
    wiring = wire_recovery(job, router, LocalSteps(job.layout.job_id, tmp_path / "steps", on_exit=job.inbox.put))
    wiring.launcher.launch(TRAINER, "trainer", [sys.executable, "-c", "import time; time.sleep(60)"], ("n0",), 0)
    wiring.trainer.adopted()  # its heartbeat counts from now
    tracker = HealthTracker(failure_threshold=2, first_wait_s=0.0)  # one failed cycle counts, and acts on none
    for name in job.engines:
        tracker.started(name)
    # what Daemon._probe_cycle reads of itself
    daemon = SimpleNamespace(job=job, recovery=wiring.recovery, trainer=wiring.trainer, tracker=tracker,
                             budget=KillBudget(0.5, 60.0))
    try:
        yield wiring, tracker, daemon
    finally:
        wiring.stop()
        job.events.close()
        job.client.close()


def _failures(tracker: HealthTracker) -> list[int]:
    return [tracker.failures(name) for name in ("engine-0", "engine-1")]


def test_failed_probes_do_not_count_while_the_trainer_publishes(watched) -> None:
    wiring, tracker, daemon = watched
    job = daemon.job
    write_heartbeat(job.dir, Phase.PUBLISH, rollout_id=3)
    assert wiring.trainer.publishing()
    Daemon._probe_cycle(daemon)  # type: ignore[arg-type]
    assert _failures(tracker) == [0, 0]
    write_heartbeat(job.dir, Phase.ROLLOUT, rollout_id=4)
    assert not wiring.trainer.publishing()
    Daemon._probe_cycle(daemon)  # type: ignore[arg-type]
    assert _failures(tracker) == [1, 1]


def test_a_trainer_that_exited_in_the_publish_phase_pauses_nothing(watched) -> None:
    wiring, _, daemon = watched
    write_heartbeat(daemon.job.dir, Phase.PUBLISH, rollout_id=3)
    step = wiring.launcher.current(TRAINER)
    wiring.steps.cancel(step, timeout_s=EXIT_WAIT_S, term_grace_s=1.0)
    assert step.returncode is not None
    assert not wiring.trainer.publishing()
