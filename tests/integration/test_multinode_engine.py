"""An engine over two nodes (issue 15, item 1) in the toy job on the devcluster, no mocks: the real
router, the trainer, and one CPU engine of two node ranks in one srun step (one task per node;
--rollout-num-gpus-per-engine 8 over nodes of 4 makes engines of 2 nodes). Mid-run its rank-1
process is SIGKILLed: the whole step ends, the supervisor relaunches it on the same two nodes, it
comes back at the current weight version and the job completes with rewards rising, every rollout id
once, and never a rollout served with stale weights.

The weights go over an update group (--update-weight-transport nccl; gloo on the CPU), so the current
version is on no disk: only the trainer's next publish brings the relaunched engine back, and with the
job's only engine gone, a trainer in its rollout waits for it in turn. Then the supervisor has the trainer
save now and restarts it (--engine-stranded-timeout), and it publishes to the engine first thing.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections import Counter
from pathlib import Path

import psutil

from contract.job_dir import JOB_DIR_ENV
from slurm.devcluster.daemons import wait_for
from tests.integration.test_rl_job import SERVED, events, heartbeat, rollouts_done, status, submit
from tests.slurm_helpers import wait_job_gone, wait_sacct_states

ROLLOUTS = 12
STRANDED_S = 5  # --engine-stranded-timeout: the trainer is in a rollout that no engine can serve
RECOVERED_S = 120  # a relaunch, the trainer's save and restart, its first publish
FOLLOWER = re.compile(r"cpu_engine: node rank 1 of 2 \(pid (\d+)\) follows node rank 0")


def rank_1_pids(job_dir: Path) -> list[int]:
    """Every rank-1 process engine-0's step has started, in order (its log is appended to)."""
    log = job_dir / "logs" / "engine-0.log"
    return [int(pid) for pid in FOLLOWER.findall(log.read_text())] if log.exists() else []


def test_a_two_node_engine_survives_the_death_of_its_rank_1(devcluster, toy, tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    job_id = submit(toy, job_dir, "--num-rollout", str(ROLLOUTS), "--rollout-num-engines", "1",
                    "--rollout-num-gpus-per-engine", "8", "--rollout-num-gpus-per-node", "4",
                    "--update-weight-transport", "nccl", "--engine-stranded-timeout", str(STRANDED_S))
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 3, 120, "the first rollouts")
        engine = status(job_dir)["steps"]["engine-0"]
        assert len(engine["nodes"]) == 2, engine
        (pid,) = rank_1_pids(job_dir)
        follower = psutil.Process(pid)
        # It is the task on the engine's second node, of this job's step (not some other process).
        env = follower.environ()
        assert env["SLURMD_NODENAME"] == engine["nodes"][1] and env["SLURM_JOB_NAME"] == "engine-0", env
        assert env[JOB_DIR_ENV] == str(job_dir), env
        # in a rollout: the trainer then waits for the engine, which waits for the trainer's publish
        wait_for(lambda: heartbeat(job_dir).get("phase") == "rollout" and (os.kill(pid, signal.SIGKILL) or True),
                 120, "a rollout being generated", interval_s=0.002)
        wait_for(lambda: events(job_dir, "engine_recovered", "engine-0"), RECOVERED_S, "engine-0 recovered")
        wait_job_gone(job_id, timeout_s=120)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    wait_sacct_states(job_id, {f"{job_id}+0": "COMPLETED", f"{job_id}+1": "COMPLETED"})
    state = status(job_dir)
    assert state["stop_reason"] == "completed", state
    assert state["steps"]["engine-0"]["nodes"] == engine["nodes"]
    # The whole step was relaunched: a new rank 1 joined a new rank 0.
    relaunched = rank_1_pids(job_dir)
    assert len(relaunched) == 2 and relaunched[0] == pid and not psutil.pid_exists(pid), relaunched
    assert len(events(job_dir, "step_launched", "engine-0")) == 2
    (failed,) = events(job_dir, "engine_failed", "engine-0")
    assert "exited" in failed["reason"] or "reported by the trainer" in failed["reason"], failed
    (stranded,) = events(job_dir, "engines_stranded")
    assert stranded["engines"] == ["engine-0"] and stranded["weight_version"] >= 3, stranded
    assert len(events(job_dir, "trainer_restarted")) == 1 and not events(job_dir, "save_now_unanswered")
    # asked to save now, the trainer kept its last finished rollout: its restart publishes the very version
    (recovered,) = events(job_dir, "engine_recovered", "engine-0")
    assert recovered["in_router"] and recovered["weight_version"] == stranded["weight_version"], recovered
    metrics = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout_id"] for m in metrics] == list(range(ROLLOUTS)), "a rollout id was skipped or repeated"
    rewards = [m["reward_mean"] for m in metrics]
    assert rewards[0] < 0.2 and max(rewards[-4:]) > 0.5, rewards
    served = Counter()  # invariant 1: rollout R is served at version R, before the kill and after
    for rollout, version in SERVED.findall((job_dir / "logs" / "engine-0.log").read_text()):
        assert version == rollout, f"engine-0 served rollout {rollout} with weight version {version}"
        served[int(rollout)] += 1
    assert sorted(served) == list(range(ROLLOUTS)), served
