"""A node that dies under the running toy job (issue 7, item 4), on the devcluster with the real
router, CPU engines and trainer, no mocks: the slurmd of engine-1's node is killed, and so is that
node's engine step (on a devcluster every node is this host, so the step's processes would outlive
their slurmd otherwise).

- With a spare rollout node, engine-1 is relaunched there, rejoins the router, and the job completes.
- Without one, the job goes on with engine-0 alone (min_engines 1) and completes.
- Without one and with min_engines 2, the trainer saves, the job requeues itself excluding the
  lost node, and the new start runs both engines on other nodes and completes.

Either way no rollout id is skipped or repeated, and no engine served a rollout with stale weights.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

from slurm.devcluster import DevCluster
from slurm.devcluster.daemons import wait_for
from tests.integration.test_rl_job import (
    assert_never_stale,
    events,
    listening_pid,
    rollouts_done,
    status,
    submit,
)
from tests.slurm_helpers import kill_node, wait_job_gone, wait_sacct_states

ROLLOUTS = 100  # about 1 s each: the job outlives the node's loss and the recovery


def run_and_kill_engine_1_node(cluster: DevCluster, toy: tuple[Path, Path], job_dir: Path, *flags: str,
                               while_down: Callable[[str, str], None] = lambda job_id, node: None) -> tuple[str, dict]:
    """Submit the toy job, kill engine-1's node after a few rollouts, wait for the job to end (with
    `while_down(job_id, node)` called meanwhile). Returns that node and the job's final status."""
    job_id = submit(toy, job_dir, "--num-rollout", str(ROLLOUTS), *flags)
    node = None
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 3, 240, "the first rollouts")
        engine = status(job_dir)["steps"]["engine-1"]
        node = engine["nodes"][0]
        kill_node(cluster, node, listening_pid(engine["url"]))
        while_down(job_id, node)
        wait_job_gone(job_id, timeout_s=300)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
        if node is not None:
            cluster.revive_slurmd(node)
    wait_sacct_states(job_id, {f"{job_id}+0": "COMPLETED", f"{job_id}+1": "COMPLETED"})
    state = status(job_dir)
    assert state["stop_reason"] == "completed", state
    ids = [json.loads(line)["rollout_id"] for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert ids == list(range(ROLLOUTS)), "a rollout id was skipped or repeated"
    assert_never_stale(job_dir)
    lost = events(job_dir, "node_failed")
    assert [e["node"] for e in lost] == [node], lost
    assert "NOT_RESPONDING" in lost[0]["reason"] and lost[0]["allocation"].startswith("released"), lost
    return node, state


def test_engine_of_a_dead_node_moves_to_the_spare_node(devcluster: DevCluster, toy, tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    node, state = run_and_kill_engine_1_node(devcluster, toy, job_dir, "--rollout-spare-nodes", "1")
    moved = events(job_dir, "engine_moved", "engine-1")
    assert len(moved) == 1 and moved[0]["from_nodes"] == [node], moved
    spare = moved[0]["to_node"]
    assert spare not in (node, *state["steps"]["engine-0"]["nodes"], *state["steps"]["trainer"]["nodes"])
    assert state["steps"]["engine-1"]["nodes"] == [spare] and state["steps"]["engine-1"]["url"] == moved[0]["url"]
    recovered = events(job_dir, "engine_recovered", "engine-1")
    assert recovered and recovered[-1]["in_router"] and recovered[-1]["weight_version"] is not None, recovered
    assert not events(job_dir, "engine_given_up")


def test_without_a_spare_node_the_job_goes_on_with_fewer_engines(devcluster: DevCluster, toy,
                                                                  tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    node, state = run_and_kill_engine_1_node(devcluster, toy, job_dir)
    given_up = events(job_dir, "engine_given_up", "engine-1")
    assert len(given_up) == 1 and f"node {node} is lost" in given_up[0]["reason"], given_up
    degraded = events(job_dir, "engine_degraded", "engine-1")
    assert len(degraded) == 1 and degraded[0]["engines"] == 1, degraded
    assert not events(job_dir, "engine_moved") and state["steps"]["engine-1"]["state"] == "failed"


def test_below_min_engines_the_job_requeues_without_the_lost_node(devcluster: DevCluster, toy,
                                                                 tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    seen: dict[str, str] = {}

    def requeued_without_it(job_id: str, node: str) -> None:
        """The job starts again on other nodes while the lost one is still down, SLURM keeps it
        excluded, and both engines come up (its rollout group has its full size again)."""
        # (rollouts_done fails at once if the job failed or left the queue)
        wait_for(lambda: len(events(job_dir, "step_launched", "trainer")) == 2 and rollouts_done(job_dir) > 0, 300,
                 "the requeued job's trainer")
        job = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
        seen["ExcNodeList"] = " ".join(f for f in job.split() if f.startswith("ExcNodeList="))

    node, state = run_and_kill_engine_1_node(devcluster, toy, job_dir, "--min-engines", "2",
                                             while_down=requeued_without_it)
    assert events(job_dir, "engine_given_up", "engine-1") and not events(job_dir, "engine_degraded")
    preempted = events(job_dir, "preemption")
    assert len(preempted) == 1 and f"node {node} is lost" in preempted[0]["reason"], preempted
    requeued = events(job_dir, "requeue")
    assert len(requeued) == 1 and requeued[0]["excluding"] == [node], requeued
    assert node in seen["ExcNodeList"], seen
    assert state["requeues"] == 1
    engine_nodes = [state["steps"][f"engine-{k}"]["nodes"][0] for k in (0, 1)]
    assert node not in engine_nodes and len(set(engine_nodes)) == 2, engine_nodes
    assert all(state["steps"][f"engine-{k}"]["state"] != "failed" for k in (0, 1)), state["steps"]
