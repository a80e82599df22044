"""The toy RL job on an isolated devcluster (one network namespace per node), and the supervisor
under network faults there (issue 18), with the real router, CPU engines and trainer, no mocks:

- The job runs to completion with every cross-node connection at a node's own address: the
  engines and the router are listed at their nodes' addresses, none at 127.0.0.1.
- An engine's node is cut off mid-rollout (its link down, its processes alive): the engine leaves
  the router within the probe bound (a publish in progress or not), is replaced on the spare node,
  the job goes on while the node is cut off, and after the node heals no stale engine is back in
  the router; no rollout is lost or run twice, none served stale.
- An engine's node gets 200 ms delay each way and 5% loss for some rollouts: the job completes and
  the engine is never taken out (the failure threshold of 3 probes in a row rides out single lost
  probes). The same job's trainer has two nodes, one gloo group across two namespaces. (These
  faults are independent: one job serves them, as a job's start is most of each one's time.)
- The trainer's node (with the supervisor and the router) is cut off: SLURM requeues the job
  without it, the new run completes with every rollout once, the old supervisor stops on seeing
  the newer run, and the old run's steps do nothing when the node heals (supervisor/fencing.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import requests

from contract.job_dir import JobDir
from slurm.devcluster import DevCluster, netns
from slurm.devcluster.daemons import wait_for
from supervisor.keys import load_key
from tests.integration.netfaults import fault
from tests.integration.test_resume import replayed_after, resumed_at
from tests.integration.test_rl_job import (
    STATUS_POLL_S,
    assert_never_stale,
    events,
    heartbeat,
    rollouts_done,
    slurmrl,
    status,
    submit,
)
from tests.slurm_helpers import wait_job_gone, wait_sacct_states

FIRST_ROLLOUTS_S = 240  # the job starting and its first rollouts
BOTH_LISTED_S = 60  # after the first rollout, until the router lists both engines
JOB_END_S = 300
# Out of the router after a cut: 3 failed probes (2 s timeout) 2 s apart, the recovery's expel, slack.
OUT_OF_ROUTER_S = 40
REPLACED_S = 180  # the replacement on the spare node serving (SLURM noticing the node, a fresh engine)
# The trainer's node cut: SlurmdTimeout (30 s) until SLURM marks it down and requeues, the new start, slack.
REQUEUED_S = 150
# The old supervisor seeing the newer run: its monitor loop looks at each turn, after a probe round
# (2 s timeout) or a SLURM command that the cut leaves unanswered (slurm_command_timeout).
FENCED_S = 90
# The toy job runs a rollout in about a second: CI saw 13 done before the node was slowed, so 30 leave room
ISOLATED_ROLLOUTS = 30
# rollouts with an engine's node slow (200 ms each way, 5% loss): 2-4 s each (the trainer's calls to the engine keep
# their connection, so only the first pays the handshake's delay)
SLOW_ROLLOUTS = 8
SLOW_ROLLOUTS_S = 180
AGREE_S = 30  # the engines in the router at one weight version again (a publish moves them one by one)
STOP_S = 15  # processes the test stops itself, until gone


def router_workers(job_dir: Path) -> list[str]:
    """The urls sglang-router lists now (the test reaches every node's address from the host side)."""
    url, key = status(job_dir)["steps"]["router"]["url"], load_key(JobDir(job_dir))
    listed = requests.get(url + "/workers", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    listed.raise_for_status()
    return [w["url"] for w in listed.json()["workers"]]


def weight_version(url: str, key: str) -> str:
    info = requests.get(url + "/model_info", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    return info.json()["weight_version"]


def stop_left_over_steps(cluster: DevCluster) -> int:
    """Stop every step process left on the cluster (its job has ended), and their slurmstepd;
    returns how many there were. (A slurmstepd is known by its node's network namespace: its
    title overwrites its environment.)"""
    plan = netns.load_plan(cluster.paths.root)
    assert plan is not None
    nodes_netns = {os.stat(netns.NETNS_DIR / plan.namespace(node)).st_ino for node in plan.nodes}
    stepds = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if (proc.info["cmdline"] or [""])[0].startswith("slurmstepd: [") and \
                    os.stat(f"/proc/{proc.pid}/ns/net").st_ino in nodes_netns:
                stepds.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, FileNotFoundError):
            pass
    tasks = [child for stepd in stepds for child in _children(stepd)]
    for proc in tasks:
        _kill(proc)
    psutil.wait_procs(tasks, timeout=STOP_S)
    _, alive = psutil.wait_procs(stepds, timeout=STOP_S)  # each reports its tasks' end, then exits
    for stepd in alive:
        _kill(stepd)
    _, alive = psutil.wait_procs(tasks + stepds, timeout=STOP_S)
    assert all(_zombie(p) for p in alive), f"still running: {alive}"
    return len(tasks)


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _kill(proc: psutil.Process) -> None:
    try:
        proc.kill()
    except psutil.NoSuchProcess:
        pass


def _zombie(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def finish(job_id: str, job_dir: Path, rollouts: int) -> dict:
    """Wait for the job to end; check it completed with every rollout exactly once, none stale."""
    wait_job_gone(job_id, timeout_s=JOB_END_S)
    wait_sacct_states(job_id, {f"{job_id}+0": "COMPLETED", f"{job_id}+1": "COMPLETED"})
    state = status(job_dir)
    assert state["stop_reason"] == "completed", state
    ids = [json.loads(line)["rollout_id"] for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert ids == list(range(rollouts)), f"a rollout was lost or run twice: {ids}"
    assert_never_stale(job_dir)
    return state


def _lists_both(job_dir: Path, listed: list[str]) -> bool:
    """Whether the router lists two engines now; listed: what it lists."""
    listed[:] = router_workers(job_dir)
    return len(listed) == 2


def test_toy_job_on_isolated_nodes_with_a_slow_engine_node(isolated_devcluster: DevCluster, toy,
                                                           tmp_path: Path) -> None:
    """Three independent checks in one job (a job's start is most of each one's time):
    - every cross-node connection is at a node's own address: the engines and the router are listed
      at their nodes' addresses, and the router lists both engines;
    - two trainer tasks, one per node, form one gloo group across two namespaces (its rendezvous at
      the first node's address, each rank's gloo device on its own node's address);
    - engine-1's node then gets 200 ms delay each way and 5% loss: the job completes and the engine
      is never taken out (the failure threshold of 3 probes in a row rides out single lost probes)."""
    job_dir, net, root = tmp_path / "job", isolated_devcluster.net, isolated_devcluster.paths.root
    # Rollouts to spare: the router must still serve when both engines are listed (a rollout or two in).
    job_id = submit(toy, job_dir, "--num-rollout", str(ISOLATED_ROLLOUTS), "--actor-num-nodes", "2")
    listed: list[str] = []
    slow = None
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 1, FIRST_ROLLOUTS_S, "the first rollout")
        # An engine that answers after the first publish joins once it has loaded the current version
        # (the supervisor leaves it out of publishes meanwhile): a rollout or two later.
        wait_for(lambda: _lists_both(job_dir, listed), BOTH_LISTED_S, "the router to list both engines",
                 interval_s=STATUS_POLL_S)
        slow = status(job_dir)["steps"]["engine-1"]["nodes"][0]
        fault(root, "slow", slow, "--delay-ms", "200", "--loss", "5")
        slowed_at = rollouts_done(job_dir)
        wait_for(lambda: rollouts_done(job_dir) >= slowed_at + SLOW_ROLLOUTS, SLOW_ROLLOUTS_S,
                 f"{SLOW_ROLLOUTS} rollouts with a slow engine node")
        slow_probe_s = status(job_dir)["steps"]["engine-1"]["last_probe_latency_s"]
        fault(root, "heal", slow)
        slow = None
        state = finish(job_id, job_dir, ISOLATED_ROLLOUTS)
    finally:
        if slow is not None:
            fault(root, "heal", slow)
        subprocess.run(["scancel", job_id], capture_output=True)
    for name in ("engine-0", "engine-1", "router"):
        step = state["steps"][name]
        assert urlsplit(step["url"]).hostname == net.node_addr(step["nodes"][0]), step
    assert sorted(listed) == sorted(state["steps"][e]["url"] for e in ("engine-0", "engine-1")), listed

    trainer_nodes = state["steps"]["trainer"]["nodes"]
    assert len(set(trainer_nodes)) == 2, trainer_nodes
    engine_nodes = {n for e in ("engine-0", "engine-1") for n in state["steps"][e]["nodes"]}
    assert not engine_nodes & set(trainer_nodes) and len({net.node_addr(n) for n in trainer_nodes}) == 2

    assert not events(job_dir, "engine_failed") and not events(job_dir, "engine_recovered"), \
        "a slow engine was taken out"
    print(f"engine-1's last probe under the delay took {slow_probe_s} s")
    assert state["steps"]["engine-1"]["restarts"] == 0 and slow_probe_s >= 0.4  # the probe's round trip was delayed


def _router_view(job_dir: Path, key: str, view: dict) -> bool:
    """Whether the router lists exactly the engines the job has now, every one at one weight version;
    view: what it saw (a publish moves the engines one at a time, so agreement is waited for)."""
    now = status(job_dir)["steps"]
    view["listed"] = sorted(router_workers(job_dir))
    view["current"] = sorted(now[e]["url"] for e in ("engine-0", "engine-1"))
    view["versions"] = {url: weight_version(url, key) for url in view["listed"]}
    return view["listed"] == view["current"] and len(set(view["versions"].values())) == 1


def test_cut_engine_node_is_replaced_and_never_rejoins_stale(isolated_devcluster: DevCluster, toy,
                                                             tmp_path: Path) -> None:
    # More rollouts than the test needs: the job must still be running (its router serving) when the
    # router is read after the heal; the test stops it then.
    job_dir, root = tmp_path / "job", isolated_devcluster.paths.root
    job_id = submit(toy, job_dir, "--num-rollout", "200", "--rollout-spare-nodes", "1")
    node, view = None, {}
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 3, FIRST_ROLLOUTS_S, "the first rollouts")
        old = status(job_dir)["steps"]["engine-1"]
        node = old["nodes"][0]
        fault(root, "cut", node)
        cut_at = time.monotonic()
        wait_for(lambda: old["url"] not in router_workers(job_dir), OUT_OF_ROUTER_S, "engine-1 out of the router",
                 interval_s=STATUS_POLL_S)
        out_s = time.monotonic() - cut_at
        wait_for(lambda: events(job_dir, "engine_recovered", "engine-1"), REPLACED_S, "engine-1 replaced")
        # The job goes on while the node is still cut off, even if the cut fell in a publish (the
        # trainer stops waiting for an engine the supervisor took out).
        done = rollouts_done(job_dir)
        wait_for(lambda: rollouts_done(job_dir) >= done + 2, REPLACED_S, "rollouts while the node is cut off")
        fault(root, "heal", node)
        node = None
        done = rollouts_done(job_dir)
        wait_for(lambda: rollouts_done(job_dir) >= done + 2, REPLACED_S, "rollouts after the heal")
        key = load_key(JobDir(job_dir))
        try:
            wait_for(lambda: _router_view(job_dir, key, view), AGREE_S, "the router's engines at one version",
                     interval_s=STATUS_POLL_S)
        except TimeoutError as e:
            raise AssertionError(f"{e}: {view}") from None
        assert old["url"] not in view["listed"], view
        slurmrl("stop", job_id)
        wait_job_gone(job_id, timeout_s=JOB_END_S)
    finally:
        if node is not None:
            fault(root, "heal", node)
        subprocess.run(["scancel", job_id], capture_output=True)
    print(f"engine-1 out of the router {out_s:.1f} s after the cut; after the heal {view}")
    state = status(job_dir)
    assert state["stop_reason"] == "stopped by user", state
    ids = [json.loads(line)["rollout_id"] for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert ids == list(range(len(ids))) and len(ids) >= done + 2, f"a rollout was lost or run twice: {ids}"
    assert_never_stale(job_dir)
    moved = events(job_dir, "engine_moved", "engine-1")
    assert len(moved) == 1 and moved[0]["from_nodes"] == [old["nodes"][0]], moved
    assert state["steps"]["engine-1"]["url"] != old["url"]


def test_cut_trainer_node_requeues_without_it_and_fences_the_old_run(isolated_devcluster: DevCluster, toy,
                                                                      tmp_path: Path) -> None:
    """The trainer's node (with the supervisor and the router) is cut off mid-run, its processes
    alive: SLURM finds the node not responding and requeues the job without it; the new run resumes
    (the rollouts the old one did come from its checkpoint and rollout journal) and completes. The
    old supervisor, still cut off, sees the newer run in the state store and stops without acting.
    Then the node heals while the new run is under way: the old router and trainer come back (the
    old trainer would be refused on the control socket, and saves nothing): no write to the job's
    state, no cancel of the new run's steps (their ids start at 0 again), no duplicate rollout."""
    job_dir, root, rollouts = tmp_path / "job", isolated_devcluster.paths.root, 30
    job_id = submit(toy, job_dir, "--num-rollout", str(rollouts))
    node = None
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 3, FIRST_ROLLOUTS_S, "the first rollouts")
        old = status(job_dir)["steps"]["trainer"]
        node = old["nodes"][0]
        old_steps = {name: step["slurm_step"] for name, step in status(job_dir)["steps"].items()}
        old_pids = {"supervisor": events(job_dir, "supervisor_started")[0]["pid"], "trainer": heartbeat(job_dir)["pid"]}
        fault(root, "cut", node)
        cut_at = time.monotonic()
        wait_for(lambda: [e for e in events(job_dir, "supervisor_started") if e["requeues"] == 1], REQUEUED_S,
                 "the job requeued without the cut node")
        requeued_s = time.monotonic() - cut_at
        done_before = rollouts_done(job_dir)
        alive = {name: psutil.pid_exists(pid) for name, pid in old_pids.items()}
        # Still cut off, the old supervisor sees the newer run in the state store (the job dir is on
        # shared storage here) and stops on its own. (Healed first, the node would race it: slurmctld
        # kills the steps a returning node reports of a requeued job.)
        wait_for(lambda: not psutil.pid_exists(old_pids["supervisor"]), FENCED_S, "the old supervisor stopping")
        fenced_s = time.monotonic() - cut_at - requeued_s
        fault(root, "heal", node)
        node = None
        state = finish(job_id, job_dir, rollouts)
    finally:
        if node is not None:
            fault(root, "heal", node)
        subprocess.run(["scancel", job_id], capture_output=True)
        # The old run's router and trainer on the healed node: SLURM ends them only once that node
        # registers again (slurmctld pings a down node every couple of minutes).
        left = stop_left_over_steps(isolated_devcluster)
    print(f"requeued {requeued_s:.1f} s after the cut; old run alive then: {alive}; the old supervisor stopped "
          f"{fenced_s:.1f} s later; processes left at the end: {left}")
    assert all(alive.values()), f"the cut node's processes should have lived on: {alive}"
    assert state["requeues"] == 1 and old["nodes"][0] not in state["steps"]["trainer"]["nodes"], state
    # SLURM requeued the trainer's component only: the old engines, still running in the rollout
    # component, were stopped before the new run launched its own (else those would wait behind them).
    left_over = {e["step"]: e["slurm_step"] for e in events(job_dir, "step_left_over")}
    assert left_over == {e: old_steps[e] for e in ("engine-0", "engine-1")}, (left_over, old_steps)
    stopped = max(e["time"] for e in events(job_dir, "step_left_over"))
    relaunched = [e for name in left_over for e in events(job_dir, "step_launched", name) if e["time"] > stopped]
    # (the new steps may get the old ids again: SLURM numbers a requeued job's steps from 0)
    assert len(relaunched) == 2 and all(state["steps"][e]["slurm_step"] for e in left_over), state["steps"]
    # Cut before the first save (--save-interval 5), the new run starts at rollout 0 and replays from the
    # journal every rollout the old one did; cut after it, it resumes from the checkpoint and replays the rest.
    resumes = resumed_at(job_dir)
    resumed = resumes[0] if resumes else 0
    replayed = replayed_after(job_dir, resume=0) if resumes else replayed_after(job_dir, resume=-1)
    assert replayed == list(range(resumed, resumed + len(replayed))) and resumed + len(replayed) >= done_before, \
        (resumed, replayed, done_before)
    new_run = events(job_dir, "supervisor_started")[1]["time"]
    late = [e for e in events(job_dir, "engine_failed") + events(job_dir, "step_ended_unseen") if e["time"] > new_run]
    assert not late, f"a step of the new run failed (an old supervisor's scancel?): {late}"
    supervisor_log = "".join(p.read_text() for p in (job_dir / "submitit").glob("*_log.err"))
    assert "this supervisor of run 0 stops without touching its state or steps" in supervisor_log
    old_acts = ("slurm_unanswered", "slurm_answers", "engine_restart_failed", "engine_given_up", "job_failed")
    late = [e for kind in old_acts for e in events(job_dir, kind) if e["time"] > new_run]
    assert not late, f"the old supervisor wrote events after the new run started: {late}"
