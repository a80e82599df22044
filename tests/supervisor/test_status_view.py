"""`slurmrl status` and `slurmrl events` as a person reads them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from contract.job_dir import Heartbeat, JobDir, Phase, write_heartbeat
from supervisor.cli import event_line, since_time
from supervisor.events import EventLog
from supervisor.state import StateStore, StepRecord
from supervisor.status_view import header, sacct_step, table

ROOT = Path(__file__).resolve().parents[2]


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.cli", *argv], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, stdin=subprocess.DEVNULL)


def test_step_ids_are_named_as_sacct_names_them() -> None:
    assert sacct_step("4.1", "3", het=True) == "3+1.1"
    assert sacct_step("3.0", "3", het=True) == "3+0.0"
    assert sacct_step("3.0", "3", het=False) == "3.0"
    assert sacct_step(None, "3", het=True) == "-"


def test_the_trainer_row_shows_its_phase_and_unknowns_show_a_dash() -> None:
    steps = {"trainer": StepRecord("trainer", "trainer", 0, ["node1"], slurm_step="3.1", state="healthy"),
             "engine-0": StepRecord("engine-0", "engine", 1, ["node2"], slurm_step="4.0", state="stopped",
                                    last_probe_latency_s=0.004, last_probe_time=90.0)}
    rows = {name: vars(record) for name, record in steps.items()}
    shown = table(rows, "3", Heartbeat(Phase.ROLLOUT, 95.0, 7), now=100.0).splitlines()
    trainer = next(line for line in shown if line.startswith("trainer")).split()
    engine = next(line for line in shown if line.startswith("engine-0")).split()
    assert trainer[3:5] == ["rollout", "7"] and "5 s ago" in " ".join(trainer) and trainer[-1] == "3+0.1"
    # a stopped engine's last probe is history, not its present
    assert engine[3] == "stopped" and engine[6:8] == ["-", "-"] and engine[-1] == "3+1.0"
    assert header({"job_id": "3", "weight_version": None, "requeues": 0, "last_checkpoint": None}) == \
        "job 3  weight version -  requeues 0  time left -  last checkpoint -  steps 0"
    # the job's SLURM steps against MaxStepCount, once read
    assert header({"job_id": "3", "weight_version": 2, "requeues": 0, "last_checkpoint": None, "steps_launched": 36001,
                   "max_step_count": 40000}).endswith("steps 36001/40000")


def test_since_takes_an_age_or_an_iso_time() -> None:
    assert abs(since_time("10m") - (time.time() - 600)) < 5
    assert since_time("2026-11-24T06:00") == since_time("2026-11-24T06:00+00:00")
    with pytest.raises(Exception, match="neither an age"):
        since_time("yesterday")


def test_events_prints_the_history_and_since_filters_it(tmp_path: Path) -> None:
    job = JobDir(tmp_path)
    job.spec.write_text("name: x\n")
    with EventLog(job.events) as events:
        old = events.emit("engine_failed", "engine-1", reason="process exited with code 137")
        events.emit("engine_restarted", "engine-1", recover_s=1.5)
    shown = _cli("events", str(tmp_path))
    assert shown.returncode == 0, shown.stderr
    assert [line.split()[2] for line in shown.stdout.splitlines()] == ["engine_failed", "engine_restarted"]
    assert "reason=\"process exited with code 137\"" in shown.stdout and event_line(old) in shown.stdout
    raw = _cli("events", str(tmp_path), "--json", "--since", "1d")
    assert [json.loads(line)["kind"] for line in raw.stdout.splitlines()] == ["engine_failed", "engine_restarted"]
    assert _cli("events", str(tmp_path), "--since", "2999-01-01T00:00").stdout == ""


def test_status_shows_the_trainer_phase_from_its_heartbeat(tmp_path: Path) -> None:
    job = JobDir(tmp_path)
    job.spec.write_text("name: x\n")
    with StateStore(job).update() as state:
        state.job_id = "3"
        state.steps["trainer"] = StepRecord("trainer", "trainer", 0, ["node1"], state="healthy",
                                            launched_at=time.time() - 60)
    write_heartbeat(job, Phase.TRAIN, 4)
    shown = _cli("status", str(tmp_path))
    assert shown.returncode == 0, shown.stderr
    assert "weight version -" in shown.stdout and " training " in shown.stdout
