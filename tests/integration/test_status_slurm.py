"""`slurmrl status` before the supervisor runs reads SLURM's own state: a held job is pending with
its reason, a job cancelled before its start says so, and a job id SLURM has forgotten is found
under the default jobs folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from contract.job_dir import JobDir
from slurm.devcluster import DevCluster
from slurm.devcluster.daemons import wait_for
from tests.integration.test_rl_job import events, rollouts_done, submit
from tests.slurm_helpers import slurm, wait_job_gone

ROOT = Path(__file__).resolve().parents[2]


def _status(*argv: str, env: dict[str, str] | None = None, drop: str = "") -> subprocess.CompletedProcess:
    env = {name: value for name, value in {**os.environ, **(env or {})}.items() if name != drop}
    return subprocess.run([sys.executable, "-m", "jobs.cli", "status", *argv], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, stdin=subprocess.DEVNULL, env=env)


def _job_dir(root: Path, job_id: str) -> JobDir:
    job = JobDir(root)
    root.mkdir(parents=True)
    job.spec.write_text("name: x\n")
    job.slurm_job_id.write_text(f"{job_id}\n")
    return job


def test_status_before_the_supervisor_reads_slurm(devcluster: DevCluster, tmp_path: Path) -> None:
    job_id = slurm("sbatch", "--parsable", "--hold", "--wrap", "true").strip().split(";")[0]
    try:
        job = _job_dir(tmp_path / "jobs" / "held", job_id)
        shown = _status(str(job.root))
        assert shown.returncode == 0, shown.stderr
        assert f"job {job_id} is pending (JobHeldUser)" in shown.stdout
        # by id: scontrol still knows the job, but its StdOut is not a job dir; the jobs folder has it
        by_id = _status(job_id, env={"SLURMRL_JOBS_DIR": str(tmp_path / "jobs")})
        assert f"job {job_id} is pending (JobHeldUser)" in by_id.stdout, by_id.stderr
    finally:
        slurm("scancel", job_id)
    wait_job_gone(job_id)
    ended = _status("--watch", "0.1", str(job.root))  # the job is over: --watch returns at once
    assert ended.returncode == 1
    assert f"job {job_id} ended (CANCELLED" in ended.stdout + ended.stderr


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="needs a SLURM client that cannot find its cluster")
def test_status_by_id_says_when_slurm_does_not_answer() -> None:
    shown = _status("3", drop="SLURM_CONF")
    assert shown.returncode == 1
    assert "job 3: SLURM did not answer:" in shown.stderr and "is SLURM_CONF set?" in shown.stderr


def test_status_by_id_says_when_there_is_no_slurm_client() -> None:
    shown = _status("3", env={"PATH": str(Path(sys.executable).parent)})  # python, and no scontrol
    assert shown.returncode == 1
    assert "job 3: SLURM did not answer: there is no scontrol here (no SLURM client)" in shown.stderr


def test_a_cancelled_job_relaunches_nothing_and_says_cancelled(devcluster: DevCluster, toy, tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    job_id = submit(toy, job_dir, "--num-rollout", "50")
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 1, 300, "the first rollout")
        cancelled_at = time.time()
        slurm("scancel", job_id)
        wait_job_gone(job_id)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    relaunched = [e for kind in ("step_launched", "engine_restarted", "router_relaunched", "trainer_restarted")
                  for e in events(job_dir, kind) if e["time"] > cancelled_at]
    assert not relaunched, f"relaunched while SLURM ended the job: {relaunched}"
    shown = _status(str(job_dir))
    assert "cancelled" in shown.stdout.lower(), shown.stdout + shown.stderr
    assert "failed" not in shown.stdout, shown.stdout
