"""A trainer node lost (issue 29, item 3), on the devcluster with the real router, a CPU engine and a
two-node trainer, no mocks: the slurmd of the trainer's second node is killed mid-run (its trainer
task lives on, as the issue saw it). The supervisor, which watches the trainer's nodes too, sees the
node lost, has the trainer save at once and requeues the job without the node, spending no trainer
restart on it; the new run resumes from that checkpoint on the nodes left and completes, every
rollout once. (SLURM would set the node DOWN ~45 s after the kill, end the trainer step and shrink
the allocation: before, the trainer was relaunched onto the dead node until the job failed.) The
node is revived after, so the next test gets the whole cluster.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from slurm.devcluster import DevCluster
from slurm.devcluster.daemons import wait_for
from tests.integration.test_isolated_job import finish
from tests.integration.test_resume import resumed_at
from tests.integration.test_rl_job import events, rollouts_done, status, submit

# Rollouts of 0.5 s or more: the job still runs when SLURM calls the node not responding (~20 s after
# the kill; before, when it sets it DOWN, ~45 s after).
ROLLOUTS = 64
FIRST_ROLLOUTS_S = 240  # the job starting and its first rollouts
NODE_BACK_S = 60  # the killed slurmd's node in service again
REQUEUED_S = 120  # SLURM calling the node not responding (~20 s), the save, slack


def test_lost_trainer_node_requeues_the_job_without_it(devcluster: DevCluster, toy, tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    # No periodic checkpoint: the run can only resume from the save the node loss asks for.
    job_id = submit(toy, job_dir, "--num-rollout", str(ROLLOUTS), "--actor-num-nodes", "2",
                    "--rollout-engines-per-node", "2", "--save-interval", "1000", "--node-check-interval", "2")
    node = None
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 3, FIRST_ROLLOUTS_S, "the first rollouts")
        node = status(job_dir)["steps"]["trainer"]["nodes"][1]
        devcluster.kill_slurmd(node)
        killed_at = time.monotonic()
        # (rollouts_done fails at once if the job failed)
        wait_for(lambda: rollouts_done(job_dir) >= 0 and bool(events(job_dir, "requeue")), REQUEUED_S, "the requeue")
        requeued_s = time.monotonic() - killed_at
        state = finish(job_id, job_dir, ROLLOUTS)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
        if node is not None:
            devcluster.revive_slurmd(node, NODE_BACK_S)
    print(f"requeued {requeued_s:.1f} s after the kill")
    lost = events(job_dir, "trainer_node_lost")
    assert [e["node"] for e in lost] == [node] and "NOT_RESPONDING" in lost[0]["reason"], lost
    assert "save now" in lost[0]["action"], lost
    # told once: scancel's signal fails for the lost node only (asking again would hold up the supervisor)
    assert len(events(job_dir, "save_now")) == 1, events(job_dir, "save_now")
    assert state["lost_nodes"] == {node: f"{lost[0]['reason']}: {lost[0]['action']}"}, state["lost_nodes"]
    requeued = events(job_dir, "requeue")
    assert len(requeued) == 1 and requeued[0]["excluding"] == [node], requeued
    trainer = state["steps"]["trainer"]
    assert state["requeues"] == 1 and node not in trainer["nodes"] and len(set(trainer["nodes"])) == 2, trainer
    assert trainer["restarts"] == 0 and not events(job_dir, "trainer_restarted"), "a restart was spent on the node"
    # (each rank logs its resume) at the rollout after the last one done before the requeue: saved on the loss
    resumed = set(resumed_at(job_dir))
    assert len(resumed) == 1 and resumed.pop() >= 3, f"the new run did not resume from the trainer's save: {resumed}"
