"""When the supervisor decides the job must save and requeue, against real jobs on the devcluster
(their end times are SLURM's own): a warning signal far from the job's end means now; one within
preempt_grace (+ SLURM's minute of earliness) of the end waits for the deadline; the time left
falling below preempt_grace decides on its own; the supervisor's own reason is kept."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm.devcluster import DevCluster
from slurm.devcluster.daemons import wait_for
from supervisor.preemption import SLURM_SIGNAL_EARLY_S, Preemption, SlurmJob
from tests.slurm_helpers import sbatch, wait_job_gone, write_script

LIMIT_S = 600  # the test job's time limit: --time=10


@pytest.fixture
def job(devcluster: DevCluster, tmp_path: Path) -> Iterator[SlurmJob]:
    """A running job with a 10-minute limit."""
    job_id = sbatch(write_script(tmp_path / "job.sh", f"""
#SBATCH --time=10 --output={tmp_path}/out.log --nodes=1
sleep 600
"""))
    job = SlurmJob(job_id, timeout_s=10)
    try:
        wait_for(lambda: job.end_time() is not None, 60, "the job to start")
        yield job
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
        wait_job_gone(job_id)


def test_slurm_job_reads_the_end_and_the_time_left(job: SlurmJob) -> None:
    end = job.end_time()
    assert end is not None and abs(end - time.time() - LIMIT_S) < 30, end - time.time()
    left = job.time_left()
    assert left is not None and left.startswith(("9:", "10:")), left
    assert not job.ending()
    assert SlurmJob("999999", timeout_s=10).end_time() is None and not SlurmJob("999999", timeout_s=10).ending()


def test_a_warning_far_from_the_end_means_now(job: SlurmJob) -> None:
    preemption = Preemption(grace_s=60, job=job)
    assert preemption.check() is None
    preemption.warned()
    assert preemption.check() == "SLURM's warning signal (preemption or the time limit)"
    assert 55 < preemption.seconds_left() <= 60


def test_an_early_warning_waits_for_the_deadline(job: SlurmJob) -> None:
    """SLURM may warn up to a minute before preempt_grace is left: the end time is the deadline."""
    grace = LIMIT_S - SLURM_SIGNAL_EARLY_S + 30  # the end is within grace + a minute: an early warning
    preemption = Preemption(grace_s=grace, job=job)
    preemption.warned()
    assert preemption.check() is None and preemption.end_time == job.end_time()


def test_less_than_the_grace_left_decides_on_its_own(job: SlurmJob) -> None:
    end = job.end_time()
    preemption = Preemption(grace_s=end - time.time() - 2, job=job)  # the grace is crossed 2 s from now
    assert preemption.check() is None
    wait_for(lambda: preemption.check() is not None, 10, "the time left to fall below the grace")
    assert preemption.check().startswith("less than") and preemption.deadline == end


def test_the_supervisors_own_reason_is_kept(job: SlurmJob) -> None:
    preemption = Preemption(grace_s=60, job=job)
    preemption.decide("node node3 is lost")
    preemption.warned()
    preemption.decide("another reason")
    assert preemption.check() == "node node3 is lost" and preemption.seconds_left() <= 0
