"""Submission on the devcluster: a stand-in for the supervisor runs as ONE heterogeneous job in its
batch step, sees both groups' nodes and returns through Submitit; `slurmrl submit --json --wait`;
the preemption signal (B:USR1) checkpoints and requeues through Submitit and the job continues."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import types
import uuid
from datetime import datetime
from pathlib import Path

import cloudpickle
import pytest

from jobs import cli
from contract.job_dir import JobDir
from contract.spec_loading import spec_from_yaml
from jobs.submit import make_executor, prepare, submit
from slurm.devcluster import DevCluster
from slurm.devcluster.daemons import wait_for
from tests.integration import submitit_tasks
from tests.jobs import standin
from tests.jobs.helpers import job_flags
from tests.ports import free_port
from tests.slurm_helpers import sacct_rows, slurm, wait_job_gone, wait_sacct_states

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
cloudpickle.register_pickle_by_value(standin)
cloudpickle.register_pickle_by_value(submitit_tasks)


def _nodes(nodelist: str) -> list[str]:
    return slurm("scontrol", "show", "hostnames", nodelist).split()


def test_standin_runs_as_one_heterogeneous_job(devcluster: DevCluster, tmp_path: Path) -> None:
    spec = prepare(None, job_flags(tmp_path, f"het-{uuid.uuid4().hex[:6]}"))
    job = submit(spec, standin.ReportEnv(spec))
    try:
        groups = job.result()
    finally:
        if not job.done():
            job.cancel(check=False)
    job_dir = Path(spec.job_dir)
    env = json.loads((job_dir / "env.json").read_text())
    assert env["SLURM_HET_SIZE"] == "2"
    assert groups["SLURMD_NODENAME"] == _nodes(groups["SLURM_JOB_NODELIST_HET_GROUP_0"])[0], \
        "the batch step is not on the first node of group 0"
    assert len(_nodes(groups["SLURM_JOB_NODELIST_HET_GROUP_1"])) == 1  # two engines on one rollout node
    assert env["SLURM_NTASKS_HET_GROUP_1"] == "2" and env["SLURM_CPUS_PER_TASK_HET_GROUP_0"] == "1"
    # The batch shell itself (exec) is the watchdog; the callable runs in its child.
    assert env["ppid"] == env["SLURM_TASK_PID"], "the callable is not the child of the batch shell (exec)"
    assert env["SLURMRL_JOB_DIR"] == spec.job_dir
    assert spec_from_yaml(JobDir(job_dir).spec) == spec
    assert JobDir(job_dir).slurm_job_id.read_text().strip() == job.job_id
    assert job.paths.stdout.parent == job_dir / "submitit" and job.paths.stdout.exists()
    wait_sacct_states(job.job_id, {f"{job.job_id}+0": "COMPLETED", f"{job.job_id}+1": "COMPLETED"})
    assert job.components() == {f"{job.job_id}+0": "COMPLETED", f"{job.job_id}+1": "COMPLETED"}
    assert job.state == "COMPLETED"


@pytest.fixture
def fake_supervisor(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """`supervisor.daemon.Supervisor(spec)` as `slurmrl submit` builds it: the stand-in instead."""
    module = types.ModuleType("supervisor.daemon")
    module.Supervisor = standin.ReportEnv  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "supervisor.daemon", module)
    return module


def test_cli_submit_json_wait(devcluster: DevCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              fake_supervisor: types.ModuleType) -> None:
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("name: overridden\ntrainer: {actor_num_cpu_workers: 2}\n")
    rc = cli.main(["submit", str(spec_file), *job_flags(tmp_path, "cli-ok"), "--json", "--wait"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    reply = json.loads(out)
    assert set(reply) == {"job_id", "job_dir"} and reply["job_dir"] == str(tmp_path / "job")
    assert f"job {reply['job_id']}: COMPLETED" in err
    env = json.loads((tmp_path / "job" / "env.json").read_text())
    assert env["SLURM_JOB_ID"] == reply["job_id"] and env["SLURM_JOB_NAME"] == "cli-ok"
    assert env["SLURM_NTASKS_PER_NODE_HET_GROUP_0"] == "2", "the YAML file's field was lost"


def test_cli_wait_reports_a_failed_job(devcluster: DevCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       fake_supervisor: types.ModuleType) -> None:
    fake_supervisor.Supervisor = lambda spec: standin.ReportEnv(spec, fail=True)  # type: ignore[attr-defined]
    rc = cli.main(["submit", *job_flags(tmp_path, "cli-fail"), "--wait"])
    out, err = capsys.readouterr()
    assert rc == 1
    job_id = out.split()[2]
    assert f"job {job_id}: FAILED" in out and f"job {job_id} ended FAILED" in err


# A stand-in supervisor for `slurmrl submit` run as its own process (the fake_supervisor fixture's, there).
_CLI_WITH_STANDIN = """
import sys, types, cloudpickle
from tests.jobs import standin
cloudpickle.register_pickle_by_value(standin)
module = types.ModuleType("supervisor.daemon")
module.Supervisor = standin.ReportEnv
sys.modules["supervisor.daemon"] = module
from jobs import cli
raise SystemExit(cli.main(sys.argv[1:]))
"""
WAIT_WITHOUT_ACCOUNTING_S = 90  # a job of seconds followed to its end (before: never, UNKNOWN every 2 s)


def test_cli_wait_without_accounting_ends_with_the_job(devcluster: DevCluster, tmp_path: Path) -> None:
    """slurmdbd unreachable for this client (its slurm.conf names a port nothing listens on; the
    cluster's own accounting is left alone): `slurmrl submit --wait` says so once, follows the job
    with squeue and ends with it."""
    etc = tmp_path / "etc"
    etc.mkdir()
    conf = devcluster.paths.slurm_conf.read_text()
    (etc / "slurm.conf").write_text(re.sub(r"(?m)^AccountingStoragePort=\d+$", f"AccountingStoragePort={free_port()}",
                                           conf))
    shutil.copy(devcluster.paths.gres_conf, etc / "gres.conf")
    env = {**os.environ, "SLURM_CONF": str(etc / "slurm.conf"), "PYTHONPATH": str(ROOT)}
    try:
        done = subprocess.run([sys.executable, "-c", _CLI_WITH_STANDIN, "submit", *job_flags(tmp_path, "no-dbd"),
                               "--wait"], capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=WAIT_WITHOUT_ACCOUNTING_S)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"--wait did not end with the job: {str(err.stdout)[-600:]}")
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = done.stdout.split()[2]
    lines = done.stdout.splitlines()
    said = [line for line in lines if "accounting does not answer" in line]
    assert len(said) == 1 and said[0].startswith(f"job {job_id}: accounting does not answer ("), lines
    assert lines[-1] == f"job {job_id}: COMPLETED (squeue)", lines
    assert "sacct: error" not in done.stderr + "".join(line for line in lines if line not in said)
    assert json.loads((tmp_path / "job" / "env.json").read_text())["SLURM_JOB_ID"] == job_id


def test_preempt_signal_checkpoints_requeues_and_continues(devcluster: DevCluster, tmp_path: Path) -> None:
    spec = prepare(None, job_flags(tmp_path, "preempt"))
    Path(spec.job_dir).mkdir()
    progress = tmp_path / "progress"
    job = make_executor(spec).submit(submitit_tasks.CountTo(), 60, str(progress))
    try:
        wait_for(lambda: progress.exists() and int(progress.read_text() or 0) >= 5, 120, "the job to make progress")
        # What SLURM sends preempt_grace seconds before the time limit: USR1 to the batch shell only.
        slurm("scancel", "--batch", "--signal=USR1", job.job_id)
        def requeued_at() -> float | None:
            rows = sacct_rows(job.job_id, "State", "End", duplicates=True)
            ends = [r["End"] for r in rows if r["State"] == "REQUEUED"]
            return datetime.fromisoformat(ends[0]).timestamp() if ends else None

        wait_for(lambda: requeued_at() is not None, 60, "the job to be requeued")
        # SLURM holds a requeued job ~120 s (BeginTime); release it early, but not within the second
        # of the requeue: slurmd revokes the old run's credential with one-second resolution, and a
        # restart in that second is killed ("Job credential revoked") and ends FAILED.
        wait_for(lambda: set(slurm("squeue", "-h", "-j", job.job_id, "-o", "%T").split()) == {"PENDING"}, 60,
                 "the requeued job to be done completing its first run")
        released = max(time.time(), requeued_at() or 0)
        wait_for(lambda: time.time() > released + 2, 10, "two seconds past the requeue")
        subprocess.run(["scontrol", "update", f"JobId={job.job_id}", "StartTime=now"], capture_output=True, timeout=60)
        result = job.result()
    finally:
        if not job.done():
            job.cancel(check=False)
            wait_job_gone(job.job_id)
    assert result["restarts"] == 1 and 5 <= result["start"] < 60 and result["reached"] == 60
    assert "Caught signal SIGUSR1" in job.stderr()
