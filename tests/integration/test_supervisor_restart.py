"""Kill the supervisor itself (SIGKILL, as a crash or the OOM killer would) in a running toy job on
the devcluster, no mocks: the batch step's watchdog starts it again in the same allocation, and it
adopts the router, the engines and the trainer, which ran on through the gap. Nothing is
relaunched, no rollout is lost or repeated, no engine serves stale weights, the job completes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from slurm.devcluster.daemons import wait_for
from tests.integration.test_rl_job import (
    assert_never_stale,
    events,
    rollouts_done,
    slurmrl,
    status,
    submit,
)
from tests.slurm_helpers import wait_job_gone, wait_sacct_states

ROLLOUTS = 12


def test_a_killed_supervisor_is_restarted_and_adopts_its_steps(devcluster, toy, tmp_path: Path) -> None:  # noqa: F811
    job_dir = tmp_path / "job"
    job_id = submit(toy, job_dir, "--num-rollout", str(ROLLOUTS))
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 3, 300, "a few rollouts")
        [first] = events(job_dir, "supervisor_started")
        os.kill(first["pid"], signal.SIGKILL)
        wait_for(lambda: len(events(job_dir, "supervisor_started")) == 2, 120, "the supervisor to be restarted")
        wait_job_gone(job_id, timeout_s=300)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, check=False)
    wait_sacct_states(job_id, {f"{job_id}+0": "COMPLETED", f"{job_id}+1": "COMPLETED"})

    restarted = events(job_dir, "supervisor_started")[1]
    assert restarted["watchdog_restarts"] == 1 and restarted["pid"] != first["pid"], restarted
    assert {e["step"] for e in events(job_dir, "step_adopted")} == {"router", "engine-0", "engine-1", "trainer"}
    relaunched = [e["step"] for e in events(job_dir, "step_launched") if e["time"] > restarted["time"]]
    assert not relaunched, f"relaunched instead of adopted: {relaunched}"
    for kind in ("engine_failed", "router_failed", "trainer_failed", "job_failed"):
        assert not events(job_dir, kind), events(job_dir, kind)
    assert status(job_dir)["stop_reason"] == "completed"

    metrics = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout_id"] for m in metrics] == list(range(ROLLOUTS)), "a rollout id was skipped or repeated"
    rewards = [m["reward_mean"] for m in metrics]
    assert rewards[0] < 0.2 and max(rewards[-4:]) > 0.5, rewards
    assert_never_stale(job_dir)
    # The trainer waits for a restarted supervisor instead of failing (its retry is
    # tests/trainer/test_supervisor_link.py's): whether one of its calls fell in this gap is timing.


def test_a_stop_asked_just_before_a_crash_still_ends_the_job(devcluster, toy, tmp_path: Path) -> None:  # noqa: F811
    # The stop is kept in supervisor_state.json: the restarted supervisor ends the job as asked,
    # whether the trainer heard of it before the crash or asks the new supervisor.
    job_dir = tmp_path / "job"
    job_id = submit(toy, job_dir, "--num-rollout", "200")
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 2, 300, "a few rollouts")
        slurmrl("stop", job_id)
        [first] = events(job_dir, "supervisor_started")
        os.kill(first["pid"], signal.SIGKILL)
        wait_job_gone(job_id, timeout_s=300)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, check=False)
    assert len(events(job_dir, "supervisor_started")) == 2
    state = status(job_dir)
    assert state["stop_reason"] == "stopped by user" and state["last_checkpoint"], state
    ids = [json.loads(line)["rollout_id"] for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert ids == list(range(len(ids))) and len(ids) < 20, ids
