"""Trainer failures inside a running toy job on the devcluster (two CPU trainer ranks, the real
router, CPU engines, no mocks): the supervisor restarts the trainer step in the same allocation,
it resumes from its latest checkpoint, the engines are brought to the restored weight version,
and the job completes with every rollout id once.

- A rank dies mid-step (SIGKILL rank 1): srun ends the step, its exit is seen at once.
- A rank hangs (SIGSTOP rank 0): only its heartbeat, stuck in one phase past that phase's
  timeout, can tell.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import psutil

from slurm.devcluster.daemons import wait_for
from tests.integration.test_rl_job import assert_never_stale, events, heartbeat, rollouts_done, status, submit
from tests.slurm_helpers import wait_job_gone

TIMEOUTS = ("--trainer-rollout-timeout", "20", "--trainer-train-timeout", "5", "--trainer-publish-timeout", "20",
            "--trainer-save-timeout", "20")


def trainer_rank(job_dir: Path, rank: int) -> int:
    """The pid of the trainer task SLURM started as `rank` for this job dir. (A process the trainer
    forks, such as a checkpoint writer, has its command line and environment: it is left out.)"""
    found: dict[int, int] = {}  # pid -> parent pid
    for proc in psutil.process_iter(["cmdline", "ppid"]):
        cmdline = proc.info["cmdline"] or []
        if cmdline[1:3] == ["-m", "trainer"] and str(job_dir) in cmdline:  # not srun, not a helper process
            try:
                if proc.environ().get("SLURM_PROCID") == str(rank):
                    found[proc.pid] = proc.info["ppid"]
            except psutil.Error:
                continue
    tasks = [pid for pid, parent in found.items() if parent not in found]
    assert len(tasks) == 1, f"expected one trainer rank {rank}, found {found} (pid: parent)"
    return tasks[0]


def when_training(job_dir: Path, act) -> None:
    """Run `act` the moment rank 0's heartbeat says it is in an optimizer step."""
    wait_for(lambda: heartbeat(job_dir).get("phase") == "train" and (act() or True), 120, "a training step",
             interval_s=0.002)


def test_dead_or_hung_trainer_rank_is_restarted_in_the_job(toy, devcluster, tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    job_id = submit(toy, job_dir, "--num-rollout", "24", "--save-interval", "4", "--rollout-batch-size", "8",
                    "--actor-num-cpu-workers", "2", *TIMEOUTS)
    frozen = None
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 5, 300, "the first rollouts")
        rank1 = trainer_rank(job_dir, 1)
        when_training(job_dir, lambda: os.kill(rank1, signal.SIGKILL))
        wait_for(lambda: events(job_dir, "trainer_restarted"), 120, "the trainer restarted")
        done = rollouts_done(job_dir)
        wait_for(lambda: rollouts_done(job_dir) >= done + 3, 300, "rollouts after the restart")

        frozen = heartbeat(job_dir)["pid"]  # rank 0, the one that beats
        when_training(job_dir, lambda: os.kill(frozen, signal.SIGSTOP))
        wait_for(lambda: events(job_dir, "trainer_hung"), 120, "the hang detected")
        wait_for(lambda: len(events(job_dir, "trainer_restarted")) >= 2, 120, "the trainer restarted again")
        wait_job_gone(job_id, timeout_s=600)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
        if frozen is not None and psutil.pid_exists(frozen):
            os.kill(frozen, signal.SIGKILL)
    state = status(job_dir)
    assert state["stop_reason"] == "completed" and state["requeues"] == 0, state
    assert state["steps"]["trainer"]["restarts"] == 2, "the count a restarted supervisor resumes from"
    failed = [e["reason"] for e in events(job_dir, "trainer_failed")]
    assert len(failed) == 2 and "exited with code" in failed[0], failed
    assert "heartbeat stale: in phase" in failed[1], failed
    log = (job_dir / "logs" / "trainer.log").read_text()
    assert log.count("resumed from") >= 2, "each restart resumes from the latest checkpoint"
    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout_id"] for m in rows] == list(range(24)), "a rollout id was skipped or repeated"
    assert max(m["reward_mean"] for m in rows[-4:]) > 0.5, "the restarted trainer should go on learning"
    assert_never_stale(job_dir)
