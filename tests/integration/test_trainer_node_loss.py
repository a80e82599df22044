"""A trainer node lost (issue 29, item 3), on the devcluster with the real router, CPU engines and a
two-node trainer, no mocks: the trainer's second node dies mid-run, its slurmd killed and so is the
trainer task it ran (on a devcluster every node is this host: its processes would outlive their
slurmd). Rank 0 fails at once on its lost peer, but the trainer's srun waits for the dead node.

The supervisor, which watches the trainer's nodes too, sees the node lost, tells the trainer to save
(it cannot: a rank is gone), ends the silent trainer and requeues the job without the node, spending
no trainer restart on it; the new run resumes from the last checkpoint and the rollout journal on
the nodes left and completes, every rollout once. Before, the job waited on that srun for ever (or,
once SLURM ended the step, relaunched the trainer onto the dead node until it failed). The node is
revived after, so the next test gets the whole cluster. (A trainer that can still save, its node's
slurmd alone killed, saves first: tests/supervisor/test_trainer_node_loss.py.)
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psutil

from slurm.devcluster import DevCluster
from slurm.devcluster.daemons import wait_for
from tests.integration.test_isolated_job import finish
from tests.integration.test_resume import resumed_at
from tests.integration.test_rl_job import events, rollouts_done, status, submit
from tests.slurm_helpers import kill_node

ROLLOUTS = 6
SAVE_INTERVAL = 2  # a checkpoint before the node dies (after rollout 1), the rollouts since in the journal
FIRST_ROLLOUTS_S = 240  # the job starting and its first rollouts
# SLURM calling the node not responding (10-30 s), the trainer's silence bound (10 s; the supervisor's
# save-now signal to the step waits MessageTimeout, 10 s, on the dead node), slack.
REQUEUED_S = 120
NODE_BACK_S = 60  # the killed slurmd's node in service again


def trainer_task_on(node: str, job_dir: Path) -> int:
    """The pid of the job's trainer task on `node` (SLURM gives each task its node's name)."""
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "trainer" in cmdline and str(job_dir) in cmdline:
            try:
                if proc.environ().get("SLURMD_NODENAME") == node:
                    return proc.pid
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
    raise AssertionError(f"no trainer task of {job_dir} on {node}")


def test_lost_trainer_node_requeues_the_job_without_it(devcluster: DevCluster, toy, tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    job_id = submit(toy, job_dir, "--num-rollout", str(ROLLOUTS), "--actor-num-nodes", "2",
                    "--rollout-engines-per-node", "2", "--save-interval", str(SAVE_INTERVAL),
                    "--node-check-interval", "2")
    node = None
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 1, FIRST_ROLLOUTS_S, "the first rollout")
        second = status(job_dir)["steps"]["trainer"]["nodes"][1]
        task = trainer_task_on(second, job_dir)
        wait_for(lambda: rollouts_done(job_dir) >= 3, FIRST_ROLLOUTS_S, "three rollouts")
        node = second
        kill_node(devcluster, node, task)
        killed_at = time.monotonic()
        # (rollouts_done fails at once if the job failed)
        wait_for(lambda: rollouts_done(job_dir) >= 0 and bool(events(job_dir, "requeue")), REQUEUED_S, "the requeue")
        requeued_s = time.monotonic() - killed_at
        state = finish(job_id, job_dir, ROLLOUTS)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
        if node is not None:
            devcluster.revive_slurmd(node, NODE_BACK_S)
    print(f"requeued {requeued_s:.1f} s after the node died")
    lost = events(job_dir, "trainer_node_lost")
    assert [e["node"] for e in lost] == [node] and "NOT_RESPONDING" in lost[0]["reason"], lost
    assert state["lost_nodes"] == {node: f"{lost[0]['reason']}: {lost[0]['action']}"}, state["lost_nodes"]
    # told once: scancel's signal fails for the dead node only (asking again would hold up the supervisor)
    assert len(events(job_dir, "save_now")) == 1, events(job_dir, "save_now")
    stopped = events(job_dir, "trainer_abandoned")
    assert len(stopped) == 1 and "cannot save" in stopped[0]["reason"], stopped
    requeued = events(job_dir, "requeue")
    assert len(requeued) == 1 and requeued[0]["excluding"] == [node], requeued
    trainer = state["steps"]["trainer"]
    assert state["requeues"] == 1 and node not in trainer["nodes"] and len(set(trainer["nodes"])) == 2, trainer
    assert trainer["restarts"] == 0 and not events(job_dir, "trainer_restarted"), "a restart was spent on the node"
    # (each rank logs its resume) from a checkpoint of the first run: the rollouts since come from the journal
    [resumed] = set(resumed_at(job_dir))
    assert resumed >= SAVE_INTERVAL and resumed % SAVE_INTERVAL == 0, resumed
