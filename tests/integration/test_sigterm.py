"""SIGTERM to the batch step alone (`scancel --signal=TERM --batch JOB`, how some sites preempt) in
the toy job on the devcluster. Found by experiment on the devcluster (KillWait 5 s): `scancel JOB`
sends SIGCONT and SIGTERM to the batch step and to every step at once and the job turns COMPLETING;
`scancel --signal=TERM --batch JOB` reaches the batch step only and the job stays RUNNING. The
supervisor used to leave it to Submitit ("Bypassing signal SIGTERM") and nothing was saved. Now it
is the short-grace preemption path: the trainer saves at once, the job (which SLURM keeps running)
requeues and resumes from that checkpoint, and completes."""

from __future__ import annotations

import subprocess
from pathlib import Path

from ckpt_tools.tracker import read_tracker
from slurm.devcluster.daemons import wait_for
from tests.integration.test_rl_job import events, rollouts_done, status, submit
from tests.slurm_helpers import wait_job_gone


def test_sigterm_to_the_batch_step_saves_now_and_requeues(devcluster, toy, tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    job_id = submit(toy, job_dir, "--num-rollout", "30", "--save-interval", "100", "--rollout-batch-size", "8",
                    "--preempt-grace", "1")
    save_dir = job_dir / "checkpoints"
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 2, 300, "a few rollouts")
        subprocess.run(["scancel", "--signal=TERM", "--batch", job_id], check=True)
        wait_for(lambda: events(job_dir, "requeue"), 120, "the job to save and requeue")
        saved = read_tracker(save_dir)
        assert saved is not None and 1 <= saved < 29, "a checkpoint at the rollout boundary, before the end"
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
