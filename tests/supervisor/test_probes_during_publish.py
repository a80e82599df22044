"""While the trainer updates the engines' weights the supervisor's probes ask only whether an engine
is alive (SGLang's /ping): its /health is a generation, which waits while an update runs, so a
generation probe then fails on an engine that is only busy, but an engine that is dead or cut off
must still leave the router. Outside the publish phase the probe is the generation, as before. So
too for an engine whose rollout profile may be writing its trace (`slurmrl profile --rollout`). No
SLURM: the trainer is a plain process (LocalSteps) whose heartbeat the test writes; engine-0 is a
stand-in that answers /ping and holds /health_generate past the probe timeout (busy in an update),
engine-1's port has no listener (dead)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from contract.job_dir import Phase, write_heartbeat
from contract.spec import FaultToleranceSpec, JobSpec, RolloutSpec
from supervisor.daemon import Daemon
from supervisor.launcher import TRAINER
from supervisor.local_steps import LocalSteps
from supervisor import profiling
from supervisor.probe import HealthTracker, KillBudget
from supervisor.profiling import ROLLOUT, Profiling
from tests.supervisor.job_context import two_engine_job
from tests.supervisor.recovery_wiring import Wiring, wire_recovery

EXIT_WAIT_S = 10.0  # a killed stand-in trainer's exit being seen
PROBE_TIMEOUT_S = 2.0
BUSY_S = PROBE_TIMEOUT_S + 1.0  # how long the busy engine holds a generation probe


class _BusyEngine(BaseHTTPRequestHandler):
    """An engine in a weight update: alive (/ping), its generation probe late."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/health_generate":
            threading.Event().wait(BUSY_S)
        self.send_response(200 if self.path in ("/ping", "/health_generate") else 404)
        self.end_headers()

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200 if self.path == "/start_profile" else 404)  # SGLang's answer: plain text
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[tuple[Wiring, HealthTracker, SimpleNamespace]]:
    ft = FaultToleranceSpec(use_fault_tolerance=True, step_stop_timeout=5.0, step_term_grace=1.0,
                            slurm_command_timeout=5.0, rollout_health_check_timeout=PROBE_TIMEOUT_S)
    spec = JobSpec(job_dir=str(tmp_path / "job"), rollout=RolloutSpec(engine="cpu", num_engines=2), fault_tolerance=ft)
    job, router = two_engine_job(spec, head="n0", node="n1", het_group=1)
    busy = ThreadingHTTPServer(("127.0.0.1", int(job.engines["engine-0"].url.rsplit(":", 1)[1])), _BusyEngine)
    busy.daemon_threads = True
    serving = threading.Thread(target=busy.serve_forever, daemon=True)
    serving.start()
    wiring = wire_recovery(job, router, LocalSteps(job.layout.job_id, tmp_path / "steps", on_exit=job.inbox.put))
    wiring.launcher.launch(TRAINER, "trainer", [sys.executable, "-c", "import time; time.sleep(60)"], ("n0",), 0)
    wiring.trainer.adopted()  # its heartbeat counts from now
    tracker = HealthTracker(failure_threshold=2, first_wait_s=0.0)  # one failed cycle counts, and acts on none
    for name in job.engines:
        tracker.started(name)
    # what Daemon._probe_cycle reads of itself
    daemon = SimpleNamespace(job=job, recovery=wiring.recovery, trainer=wiring.trainer, tracker=tracker,
                             budget=KillBudget(0.5, 60.0), profiling=Profiling(job, wiring.recovery.serving))
    try:
        yield wiring, tracker, daemon
    finally:
        busy.shutdown()
        busy.server_close()
        serving.join()
        wiring.stop()
        job.events.close()
        job.client.close()


def _failures(tracker: HealthTracker) -> list[int]:
    return [tracker.failures(name) for name in ("engine-0", "engine-1")]


def test_while_the_trainer_publishes_a_busy_engine_passes_and_a_dead_one_fails(watched) -> None:
    wiring, tracker, daemon = watched
    job = daemon.job
    write_heartbeat(job.dir, Phase.PUBLISH, rollout_id=3)
    assert wiring.trainer.publishing()
    Daemon._probe_cycle(daemon)  # type: ignore[arg-type]
    assert _failures(tracker) == [0, 1]
    write_heartbeat(job.dir, Phase.ROLLOUT, rollout_id=4)
    assert not wiring.trainer.publishing()
    Daemon._probe_cycle(daemon)  # type: ignore[arg-type]
    assert _failures(tracker) == [1, 2]  # the generation probe again: the busy engine is late


def test_a_trainer_that_exited_in_the_publish_phase_pauses_nothing(watched) -> None:
    wiring, _, daemon = watched
    write_heartbeat(daemon.job.dir, Phase.PUBLISH, rollout_id=3)
    step = wiring.launcher.current(TRAINER)
    wiring.steps.cancel(step, timeout_s=EXIT_WAIT_S, term_grace_s=1.0)
    assert step.returncode is not None
    assert not wiring.trainer.publishing()


@pytest.mark.parametrize("window_s", [profiling.PROFILE_TRACE_S, 0.0])
def test_an_engine_writing_its_rollout_profile_passes_within_the_window(watched, monkeypatch, window_s) -> None:
    """engine-0 took the profile (the dead engine-1 did not): within PROFILE_TRACE_S its late generation probe
    is not asked, only whether it is alive; past it (window 0) the generation probe is asked again."""
    wiring, tracker, daemon = watched
    write_heartbeat(daemon.job.dir, Phase.ROLLOUT, rollout_id=4)
    monkeypatch.setattr(profiling, "PROFILE_TRACE_S", window_s)
    started = daemon.profiling.start(ROLLOUT, 3)
    assert started["engines"] == ["engine-0"] and list(started["failed"]) == ["engine-1"], started
    assert daemon.profiling.tracing() == ({"engine-0"} if window_s else set())
    Daemon._probe_cycle(daemon)  # type: ignore[arg-type]
    assert _failures(tracker) == ([0, 1] if window_s else [1, 1])
