"""Submitit against the devcluster: results come back, and a preempted Checkpointable is
requeued and continues from its checkpoint."""

from __future__ import annotations

from pathlib import Path

import cloudpickle
import pytest
import submitit

from slurm.devcluster import DevCluster
from slurm.devcluster.daemons import wait_for
from tests.integration import submitit_tasks
from tests.slurm_helpers import slurm, wait_sacct_states

pytestmark = pytest.mark.integration
cloudpickle.register_pickle_by_value(submitit_tasks)


def _executor(folder: Path) -> submitit.AutoExecutor:
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    executor.update_parameters(timeout_min=10, slurm_partition="dev", cpus_per_task=1)
    return executor


def test_submitit_job_returns_its_result(devcluster: DevCluster, tmp_path: Path) -> None:
    job = _executor(tmp_path).submit(submitit_tasks.where_am_i, 7)
    value, node = job.result()
    assert value == 49
    assert node in devcluster.shape.node_names
    # Submitit reads job state through sacct, so this also proves accounting works for it.
    wait_for(lambda: job.get_info(mode="force").get("State") == "COMPLETED", 30, "Submitit to see COMPLETED")


def test_preempted_checkpointable_is_requeued_and_continues(devcluster: DevCluster, tmp_path: Path) -> None:
    progress = tmp_path / "progress"
    n = 60
    job = _executor(tmp_path).submit(submitit_tasks.CountTo(), n, str(progress))
    wait_for(lambda: progress.exists() and int(progress.read_text() or 0) >= 5, 120, "the job to make progress")
    # What SLURM sends before preempting a job that asked for --signal=USR2@T, as Submitit does:
    # the steps get it, not the batch shell (with --full the shell dies of USR2 and ends the job).
    slurm("scancel", "--signal=USR2", job.job_id)
    # While the requeued job is pending, sacct still lists the first run's failed step, and
    # Submitit's own polling may take that for the job's end: wait for the real end first.
    wait_sacct_states(job.job_id, ["REQUEUED", "COMPLETED"], duplicates=True, timeout_s=180)
    result = job.result()
    assert result["restarts"] == 1
    assert 5 <= result["start"] < n, "the requeued run did not continue from the checkpoint"
    assert result["reached"] == n
