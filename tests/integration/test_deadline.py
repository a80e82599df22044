"""The job's end moving while it runs, and saves slower than the time that is left, in one toy job on
the devcluster (issue 29, items 5, 6 and 7; real SLURM, router, engines and trainer). The trainer's
checkpoint folder is on a slow disk (tests/trainer/slow_save_disk.py: each fsync there takes
FSYNC_S, so a save takes several seconds), and preempt_grace is shorter than a save.

- 6: trainer_save_timeout is shorter than a save, longer than one step of it: a save that moves on
  keeps the heartbeat fresh, and no save is taken for a hung trainer (it used to restart the trainer
  into the same save until the job failed).
- 7: the one-minute limit is extended (`scontrol update TimeLimit=`) as soon as the supervisor has
  read it: past the moment the old end would have stopped the job, it goes on (it used to save and
  requeue at the end it read at start).
- 5: the end is then brought close (`scontrol update EndTime=`): the supervisor has the trainer
  save early enough for its measured save to end before it, and the job requeues in time (it used
  to wait for preempt_grace, start the save too late, and SLURM ended the job TIMEOUT mid-save,
  with no requeue).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from ckpt_tools.tracker import iteration_dirname, read_tracker
from slurm.devcluster.daemons import wait_for
from supervisor.deadline import END_TIME_REFRESH_S, REQUEUE_MARGIN_S
from supervisor.preemption import SlurmJob
from tests.integration.test_rl_job import events, rollouts_done, submit
from tests.slurm_helpers import slurm
from tests.trainer.slow_save_disk import DELAY_ENV
from trainer import checkpoint

FSYNC_S = 1  # each fsync under the checkpoint folder: a save takes ~12 s
# preempt_grace: far shorter than a save, and than a trainer's exit (~1.5 s): a supervisor that waits
# for it ends TIMEOUT whatever the trainer is doing
GRACE_S = 1
SAVE_TIMEOUT_S = 6  # trainer_save_timeout: shorter than a save, longer than an fsync and a progress poll
# (4 s once ran out on a loaded machine: "in phase save for 6 s")
START_S = 120  # the supervisor's start; then the first slow save
SEEN_S = END_TIME_REFRESH_S + 10  # the supervisor seeing a new end
LATE_S = 5  # past the moment the old end would have had today's supervisor stop (2 monitor cycles and more)
TRAIN_S = 2  # a rollout's training here, at most
SLACK_S = 8  # the monitor's cycle and a loaded machine, on top of the time the end takes to be seen


def _metrics(job_dir: Path) -> list[dict]:
    path = job_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _slow_saves(job_dir: Path) -> list[float]:
    rollouts_done(job_dir)  # fails at once if the job failed or is gone
    return [m["save_seconds"] for m in _metrics(job_dir) if "save_seconds" in m]


def test_a_moving_time_limit_and_slow_saves_requeue_in_time(devcluster, toy, tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    job_id = submit(toy, job_dir, "--num-rollout", "200", "--rollout-batch-size", "8", "--save-interval", "3",
                    "--time", "1", "--preempt-grace", str(GRACE_S), "--trainer-save-timeout", str(SAVE_TIMEOUT_S),
                    "--custom-rm-path", "tests.trainer.slow_save_disk.toy_reward",
                    "--trainer-setup", f"export {DELAY_ENV}={FSYNC_S}")
    slurm_job = SlurmJob(job_id, timeout_s=10)
    try:
        # 7: the limit is extended once the supervisor runs (it has read the job's end by then).
        wait_for(lambda: events(job_dir, "supervisor_started"), START_S, "the supervisor")
        first_end = slurm_job.end_time()
        assert first_end is not None
        slurm("scontrol", "update", f"JobId={job_id}", "TimeLimit=10")
        # Seen within a refresh, or on a loaded machine at least before the old end would stop the job.
        wait_for(lambda: events(job_dir, "time_limit_changed"), max(SEEN_S, first_end - GRACE_S - time.time()),
                 "the supervisor to see the new end")
        # 6: a slow save ends, its trainer never taken for hung; 7: past the old end's stop, none began.
        wait_for(lambda: _slow_saves(job_dir) and time.time() > first_end - GRACE_S + LATE_S, START_S,
                 "a slow save, and the moment the old end would have stopped the job")
        assert not events(job_dir, "preemption"), "the job stopped for an end that had moved"
        assert not events(job_dir, "trainer_hung") and not events(job_dir, "trainer_restarted")
        assert min(_slow_saves(job_dir)) > SAVE_TIMEOUT_S + GRACE_S, "saves slower than the grace and the timeout"

        # 5: the end is brought close: once the supervisor sees it, more than a save (as slow as the
        # recent ones), the training under way and the requeue margin are left, not much more. The
        # training under way may end in a periodic save (--save-interval 3) that begins just before the
        # supervisor decides, and is then its boundary: room for that save too (CI: without it, 27.2 s
        # were left for 12.9 s of save under way, and 12.5 + 15 more).
        lead = TRAIN_S + 2 * max(_slow_saves(job_dir)) + REQUEUE_MARGIN_S
        short_end = round(time.time() + END_TIME_REFRESH_S + SLACK_S + lead)
        slurm("scontrol", "update", f"JobId={job_id}",
              f"EndTime={time.strftime('%Y-%m-%dT%H:%M:%S', time.localtime(short_end))}")
        wait_for(lambda: events(job_dir, "requeue"), short_end - time.time() + SLACK_S,
                 "the job to save and requeue before its end")
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    [moved, *_] = events(job_dir, "time_limit_changed")
    assert moved["was"] == time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(first_end))
    [preempted] = events(job_dir, "preemption")
    [requeued] = events(job_dir, "requeue")
    assert "as long as the training under way, a save" in preempted["reason"], preempted
    assert preempted["time_left_s"] > preempted["save_s"] > GRACE_S, preempted
    assert requeued["time"] < short_end, "requeued before SLURM's end"
    assert not events(job_dir, "no_time_to_save") and not events(job_dir, "trainer_failed")
    assert not events(job_dir, "trainer_hung")
    saved = read_tracker(job_dir / "checkpoints")
    assert saved is not None and checkpoint.validate(job_dir / "checkpoints" / iteration_dirname(saved)) is None
    assert saved == _metrics(job_dir)[-1]["rollout_id"], "every rollout trained before the requeue was saved"
