"""A node that dies under the running toy job (issue 7, item 4), on the devcluster with the real
router, CPU engines and trainer, no mocks: the slurmd of engine-1's node is killed, and so is that
node's engine step (on a devcluster every node is this host, so the step's processes would outlive
their slurmd otherwise).

- With a spare rollout node, engine-1 is relaunched there and rejoins the router; when that node
  dies next, no spare is left, and the job goes on with engine-0 alone (min_engines 1) (one job
  for both cases: the second loss comes once the first is recovered).
- Without a spare and with min_engines 2, the trainer saves, the job requeues itself excluding the
  lost node, and the new start runs both engines on other nodes.

Either way the job trains AFTER_S more rollouts once the last loss is dealt with, and is then stopped
(`slurmrl stop`: a job long enough to outlive the losses whatever the machine's pace, ended as soon
as it has shown it goes on); no rollout id is skipped or repeated, and no engine served a rollout
with stale weights.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from functools import partial
from pathlib import Path

from slurm.devcluster import DevCluster
from slurm.devcluster.daemons import wait_for
from tests.integration.test_rl_job import (
    assert_never_stale,
    events,
    listening_pid,
    rollouts_done,
    slurmrl,
    status,
    submit,
)
from tests.slurm_helpers import kill_node, wait_job_gone, wait_sacct_states

ROLLOUTS = 100000  # the job outlives the nodes' losses and recoveries: it is stopped
AFTER = 3  # rollouts trained after the last loss is dealt with, before the stop
RECOVERY_S = 180  # bound on one engine's recovery (or giving up) after its node died


def run_and_kill_engine_nodes(cluster: DevCluster, toy: tuple[Path, Path], job_dir: Path, *flags: str,
                              engines: tuple[str, ...] = ("engine-1",),
                              while_down: Callable[[str, str], None] = lambda job_id, node: None) -> tuple[list[str], dict]:
    """Submit the toy job and, after a few rollouts, kill the node of each of `engines` in turn, the
    next once the last is recovered (or given up); `while_down(job_id, node)` is called after the
    last, then AFTER more rollouts are waited for and the job stopped. Returns the killed nodes and
    the job's final status."""
    job_id = submit(toy, job_dir, "--num-rollout", str(ROLLOUTS), *flags)
    nodes: list[str] = []
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 3, 240, "the first rollouts")
        for previous, name in zip((None, *engines), engines):
            if previous is not None:
                wait_for(partial(_settled, job_dir, previous), RECOVERY_S, f"{previous}'s recovery")
            engine = status(job_dir)["steps"][name]
            nodes.append(engine["nodes"][0])
            kill_node(cluster, nodes[-1], listening_pid(engine["url"]))
        while_down(job_id, nodes[-1])
        wait_for(partial(_settled, job_dir, engines[-1]), RECOVERY_S, f"{engines[-1]}'s recovery")
        done = rollouts_done(job_dir)
        wait_for(lambda: rollouts_done(job_dir) >= done + AFTER, RECOVERY_S, "the job going on")
        slurmrl("stop", job_id)
        wait_job_gone(job_id, timeout_s=RECOVERY_S)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
        for node in nodes:
            cluster.revive_slurmd(node)
    wait_sacct_states(job_id, {f"{job_id}+0": "COMPLETED", f"{job_id}+1": "COMPLETED"})
    state = status(job_dir)
    assert state["stop_reason"] == "stopped by user", state
    ids = [json.loads(line)["rollout_id"] for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert ids == list(range(len(ids))), "a rollout id was skipped or repeated"
    assert_never_stale(job_dir)
    lost = events(job_dir, "node_failed")
    assert [e["node"] for e in lost] == nodes, lost
    assert all("NOT_RESPONDING" in e["reason"] and e["allocation"].startswith("released") for e in lost), lost
    return nodes, state


def _settled(job_dir: Path, engine: str) -> bool:
    """Whether the supervisor has dealt with `engine`'s lost node: recovered it, or given it up."""
    return bool(events(job_dir, "engine_recovered", engine) or events(job_dir, "engine_given_up", engine))


def test_a_dead_engine_node_moves_to_the_spare_then_with_none_left_the_job_goes_on_with_fewer(
        devcluster: DevCluster, toy, tmp_path: Path) -> None:
    # engine-1's node dies, then the spare it moved to: engine-0's node is its group's first, whose
    # loss SLURM answers by requeueing the whole job (the requeue test's case), so it is spared here
    job_dir = tmp_path / "job"
    (first, spare), state = run_and_kill_engine_nodes(devcluster, toy, job_dir, "--rollout-spare-nodes", "1",
                                                      engines=("engine-1", "engine-1"))
    moved = events(job_dir, "engine_moved", "engine-1")
    assert len(moved) == 1 and moved[0]["from_nodes"] == [first] and moved[0]["to_node"] == spare, moved
    assert spare not in (first, *state["steps"]["engine-0"]["nodes"], *state["steps"]["trainer"]["nodes"])
    recovered = events(job_dir, "engine_recovered", "engine-1")
    assert recovered and recovered[0]["in_router"] and recovered[0]["weight_version"] is not None, recovered
    # then the spare's loss, with no spare left: the job went on with engine-0 alone
    given_up = events(job_dir, "engine_given_up", "engine-1")
    assert len(given_up) == 1 and f"node {spare} is lost" in given_up[0]["reason"], given_up
    assert given_up[0]["time"] > recovered[0]["time"]
    degraded = events(job_dir, "engine_degraded", "engine-1")
    assert len(degraded) == 1 and degraded[0]["engines"] == 1, degraded
    assert state["steps"]["engine-1"]["state"] == "failed" and state["steps"]["engine-0"]["restarts"] == 0


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

    (node,), state = run_and_kill_engine_nodes(devcluster, toy, job_dir, "--min-engines", "2",
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
