"""The kill cap (invariant 5) said aloud: of two engines past the failure threshold at once, one is
restarted and the other, held back by the cap, is kept running and shown so: an engine_held_back
event (once, with the cap), `unhealthy` with the reason in its record and in `slurmrl status`,
until its probe passes again (engine_hold_released) or the cap lets it be restarted. Against the
local step backend (test_recovery_local.py's setup)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rollout.engine_client import ProbeResult
from slurm.devcluster.daemons import wait_for
from supervisor.engine_states import HEALTHY
from supervisor.kill_cap import act_on_probes
from supervisor.probe import KillBudget
from tests.supervisor.test_recovery_local import WAIT_S, _start, _wire, local_job

__all__ = ["local_job"]  # the fixture, shared with test_recovery_local

ROOT = Path(__file__).resolve().parents[2]
FAILING = ProbeResult(ok=False, latency_s=2.0, error="timeout after 2.0 s")
PASSING = ProbeResult(ok=True, latency_s=0.01)


def _events(job_dir: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (job_dir / "events.jsonl").read_text().splitlines()) if e["kind"] == kind]


def test_an_engine_the_kill_cap_holds_back_is_said_to_be_unhealthy(local_job, tmp_path: Path) -> None:
    job, router = local_job
    wiring = _wire(job, router, tmp_path / "steps")
    budget = KillBudget(max_fraction=0.5, interval_s=3600.0)  # two engines: one kill an hour
    try:
        _start(job, wiring)
        both = {"engine-0": FAILING, "engine-1": FAILING}
        act_on_probes(job, wiring.recovery.recover, both, ["engine-0", "engine-1"], budget)
        wait_for(lambda: _events(job.dir.root, "engine_recovered"), WAIT_S, "engine-0 restarted")
        [held] = _events(job.dir.root, "engine_held_back")
        assert held["step"] == "engine-1" and held["kill_cap"] == 1 and FAILING.error in held["reason"], held
        record = job.store.snapshot().steps["engine-1"]
        assert record.state == "unhealthy" and record.last_failure.startswith("held back by the kill cap"), record
        engine = job.engines["engine-1"]
        assert engine.state == HEALTHY and engine.in_router and wiring.launcher.current("engine-1").returncode is None
        job.spec.write(job.dir.spec)  # what makes the folder a job dir to the CLI
        table = subprocess.run([sys.executable, "-m", "jobs.cli", "status", str(job.dir.root)], capture_output=True,
                               text=True, timeout=60, cwd=ROOT).stdout
        row = next(line for line in table.splitlines() if line.startswith("engine-1"))
        assert "unhealthy" in row.split(), table

        # Still failing, still held: said once.
        act_on_probes(job, wiring.recovery.recover, {"engine-1": FAILING}, ["engine-1"], budget)
        assert len(_events(job.dir.root, "engine_held_back")) == 1
        act_on_probes(job, wiring.recovery.recover, {"engine-0": PASSING, "engine-1": PASSING}, [], budget)
        assert [e["step"] for e in _events(job.dir.root, "engine_hold_released")] == ["engine-1"]
        assert job.store.snapshot().steps["engine-1"].state == "healthy"
        assert [e["step"] for e in _events(job.dir.root, "engine_failed")] == ["engine-0"]
    finally:
        wiring.stop()
