"""A supervisor that cannot start leaves its reason where `slurmrl status` and events.jsonl show it,
not only in Submitit's log."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from contract.job_dir import JobDir
from contract.spec import JobSpec, RolloutSpec
from supervisor.daemon import JobFailed, start

ROOT = Path(__file__).resolve().parents[2]


def test_a_supervisor_outside_slurm_says_why_in_status(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SLURM_JOB_ID", "SLURM_JOBID"):
        monkeypatch.delenv(name, raising=False)
    spec = JobSpec(job_dir=str(tmp_path), rollout=RolloutSpec(engine="cpu", num_engines=1))
    spec.write(JobDir(tmp_path).spec)
    with pytest.raises(JobFailed, match="the supervisor could not start: SLURM_JOB_ID is not set"):
        start(spec)
    shown = subprocess.run([sys.executable, "-m", "jobs.cli", "status", str(tmp_path)], capture_output=True,
                           text=True, timeout=60, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert shown.returncode == 0, shown.stderr
    assert "stopped: failed: the supervisor could not start: SLURM_JOB_ID is not set" in shown.stdout
    failed = [json.loads(line) for line in JobDir(tmp_path).events.read_text().splitlines()]
    assert [e["kind"] for e in failed] == ["job_failed"] and "SLURM_JOB_ID" in failed[0]["reason"]


def test_python_m_supervisor_records_an_unreadable_spec(tmp_path: Path) -> None:
    JobDir(tmp_path).spec.write_text("rollout: [not, a, mapping]\n")
    done = subprocess.run([sys.executable, "-m", "supervisor", "--job-dir", str(tmp_path)], capture_output=True,
                          text=True, timeout=60, cwd=ROOT, stdin=subprocess.DEVNULL,
                          env={"PATH": "/usr/bin:/bin", "SLURMRL_SUPERVISOR_CHILD": "1"})
    assert done.returncode == 2, done.stderr
    state = json.loads(JobDir(tmp_path).state.read_text())
    assert state["stop_reason"].startswith("failed: the job spec cannot be read:")
