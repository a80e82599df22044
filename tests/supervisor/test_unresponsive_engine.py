"""An engine whose requests time out (or come back unparseable) while its probes pass: the
trainer's report of a failed request is checked with one probe and dismissed, but its report of an
unresponsive engine (the engine_unresponsive call) takes the engine out and into EngineRecovery's
path for a failed engine, probes notwithstanding. In process, over the real control socket; the
engine's port is served by a stand-in whose /health_generate answers 200. The recovery runs for
real up to its crash-loop breaker (max_engine_restarts 0), so no step is launched."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from contract.control_protocol import Call, ControlClient
from slurm.devcluster.daemons import wait_for
from supervisor.control import ControlServer
from supervisor.engine_states import FAILED, HEALTHY
from tests.supervisor.job_context import unplaced_job
from tests.supervisor.recovery_wiring import wire_recovery

pytestmark = pytest.mark.usefixtures("slurm_programs")  # the recovery asks squeue
WHY = "no answer within its deadline of 30 s (8 tokens at most); then a 1-token /generate got no answer"


class _Healthy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # every probe passes
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_an_engine_reported_unresponsive_is_replaced_though_its_probe_passes(tmp_path: Path) -> None:
    job, router = unplaced_job(tmp_path)
    wiring = wire_recovery(job, router)
    recovery, handlers, pool = wiring.recovery, wiring.handlers, wiring.pool
    engine = job.engines["engine-0"]
    control = ControlClient(job.dir, 10)
    stand_in = ThreadingHTTPServer(("127.0.0.1", engine.place.port), _Healthy)
    serving = threading.Thread(target=stand_in.serve_forever, daemon=True)
    serving.start()

    def kinds() -> list[tuple[str, str, str]]:
        return [(e["kind"], e.get("step") or "", e.get("reason", ""))
                for e in map(json.loads, job.dir.events.read_text().splitlines())]

    try:
        with ControlServer(job.dir, handlers.table()):
            # A failed request is not enough: one probe passes, the engine stays in.
            control.call(Call.ENGINE_FAILED, url=engine.url, reason="connection reset")
            wait_for(lambda: any(k == "engine_report_dismissed" for k, _, _ in kinds()), 30, "the report dismissed")
            assert engine.state == HEALTHY and not recovery.is_recovering(engine.name)
            # Requests that time out while the probes pass: taken out and recovered as a failed engine.
            control.call(Call.ENGINE_UNRESPONSIVE, url=engine.url, reason=WHY)
            wait_for(lambda: engine.state == FAILED and not recovery.is_recovering(engine.name), 30,
                     "the recovery ends")
            pool.shutdown(wait=True)
    finally:
        stand_in.shutdown()
        stand_in.server_close()
        job.events.close()
        job.client.close()
    failed = [(step, reason) for kind, step, reason in kinds() if kind == "engine_failed"]
    assert failed == [("engine-0", f"reported by the trainer: {WHY}")], kinds()
    assert [k for k, _, _ in kinds()].count("engine_given_up") == 1  # the breaker's rule, max_engine_restarts 0
    assert job.store.snapshot().steps["engine-0"].state == FAILED
    assert job.engines["engine-1"].state == HEALTHY  # the other engine was not touched
