"""SIGTERM to the batch step alone (`scancel --signal=TERM --batch JOB`, how some sites preempt) in
the toy job on the devcluster. Found by experiment on the devcluster (KillWait 5 s): `scancel JOB`
sends SIGCONT and SIGTERM to the batch step and to every step at once and the job turns COMPLETING;
`scancel --signal=TERM --batch JOB` reaches the batch step only and the job stays RUNNING. The
supervisor used to leave it to Submitit ("Bypassing signal SIGTERM") and nothing was saved. Now it
is the short-grace preemption path: the trainer saves at once, the job (which SLURM keeps running)
requeues and resumes from that checkpoint, and completes.

All of it with the cluster's slurmdbd stopped (as on a cluster without accounting, where sacct
answers nothing): submit, the requeue, the trainer's exit codes as the supervisor sees them, and
the job's end as `slurmrl status` and Submitit see it need no sacct."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckpt_tools.tracker import read_tracker
from contract.job_dir import JobDir, read_trainer_finished
from jobs.hetjob import HetSlurmJob
from slurm.devcluster import DevCluster
from slurm.devcluster.daemons import wait_for
from supervisor.slurm_jobs import job_state
from tests.integration.test_rl_job import events, rollouts_done, slurmrl, status, submit
from tests.slurm_helpers import wait_job_gone

ACCOUNTING_BACK_S = 60  # slurmdbd started again and answering sacct (seen: 2 s)
ROLLOUTS = 12  # the SIGTERM comes at rollout 2 and saves at once: the requeued run has rollouts left


def _sacct_answers() -> bool:
    return subprocess.run(["sacct", "-n", "-X", "-j", "1"], capture_output=True, timeout=30).returncode == 0


@pytest.fixture
def slurmdbd_stopped(devcluster: DevCluster) -> Iterator[None]:
    """The session's cluster with its slurmdbd stopped (by its PID file), started again after."""
    if devcluster.accounting is None:
        pytest.skip("this devcluster has no accounting to stop")
    slurmdbd = devcluster.accounting.slurmdbd()
    assert slurmdbd.stop(), "slurmdbd was not running"
    try:
        assert not _sacct_answers()
        yield
    finally:
        slurmdbd.start()
        wait_for(_sacct_answers, ACCOUNTING_BACK_S, "sacct to answer again")


def test_sigterm_to_the_batch_step_saves_now_and_requeues(devcluster, slurmdbd_stopped, toy, tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    job_id = submit(toy, job_dir, "--num-rollout", str(ROLLOUTS), "--save-interval", "100", "--rollout-batch-size", "8",
                    "--preempt-grace", "1")
    save_dir = job_dir / "checkpoints"
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 2, 300, "a few rollouts")
        subprocess.run(["scancel", "--signal=TERM", "--batch", job_id], check=True)
        wait_for(lambda: events(job_dir, "requeue"), 120, "the job to save and requeue")
        saved = read_tracker(save_dir)
        assert saved is not None and 1 <= saved < ROLLOUTS - 1, "a checkpoint at the rollout boundary, before the end"
        wait_job_gone(job_id, timeout_s=300)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    [preempted] = events(job_dir, "preemption")
    assert "SIGTERM to the batch step" in preempted["reason"]
    assert len(events(job_dir, "save_now")) == 1
    state = status(job_dir)
    assert state["stop_reason"] == "completed" and state["requeues"] == 1, state
    log = (job_dir / "logs" / "trainer.log").read_text()
    assert f"next rollout {saved + 1}" in log, "the requeued job resumes from the checkpoint saved on SIGTERM"
    # The trainer's exits as the supervisor saw them (srun's codes): saved and stopped for the
    # requeue (0, or SIGUSR1's code as it ended), then finished; none a failure.
    exits = [e["kind"] for e in map(json.loads, (job_dir / "events.jsonl").read_text().splitlines())
             if e["kind"] in ("trainer_finished", "trainer_stopped", "trainer_failed")]
    assert len(exits) == 2 and exits[-1] == "trainer_finished" and "trainer_failed" not in exits, exits
    # ... and its own record of its finish, for a supervisor that would not have seen it end.
    assert read_trainer_finished(JobDir(job_dir), state["steps"]["trainer"]["launched_at"])
    # The job's end without the accounting: squeue, which still lists it.
    assert job_state(job_id, 30.0).state == "COMPLETED"
    assert '"stop_reason": "completed"' in slurmrl("status", job_id, "--json").stdout
    submitit = HetSlurmJob(job_dir / "submitit", job_id)
    assert submitit.components() == {f"{job_id}+0": "COMPLETED", f"{job_id}+1": "COMPLETED"}
    assert submitit.state == "COMPLETED" and submitit.done()
