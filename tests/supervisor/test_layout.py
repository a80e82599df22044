"""Where engines go (supervisor/layout.py), without SLURM: the layout takes SLURM's environment and
the node addresses as given. Engines over several nodes take whole nodes of their own, node 0 first,
with a rendezvous port of their own; a lost node of one is swapped for a spare, node 0 staying first;
each task of its step finds its own node rank (supervisor/node_rank.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from contract.job_dir import JobDir
from contract.spec import JobSpec, RolloutSpec
from jobs.hetjob import het_groups
from slurm.client import SlurmClient
from supervisor import layout, node_rank
from supervisor.engines import Engines
from supervisor.launcher import engine_command
from supervisor.node_failures import NodeFailures
from supervisor.nodes import NodeTracker
from supervisor.state import StateStore


def place(rollout: RolloutSpec, nodes: int, monkeypatch: pytest.MonkeyPatch) -> layout.Layout:
    """The layout of a job with trainer node t0 and rollout nodes r1..r{nodes} (address 10.0.0.K)."""
    monkeypatch.setattr(SlurmClient, "hostnames", lambda self, nodelist: nodelist.split(","))
    monkeypatch.setattr(layout, "node_addresses",
                        lambda names, timeout_s: {n: f"10.0.0.{n[1:]}" for n in names})
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST_HET_GROUP_0": "t0",
           "SLURM_JOB_NODELIST_HET_GROUP_1": ",".join(f"r{k}" for k in range(1, nodes + 1))}
    spec = JobSpec(rollout=rollout)
    spec.trainer.train_args = ["--hf-checkpoint", "/m"]
    return layout.from_environment(spec, 1.0, env)


def sglang(gpus: int, per_engine: int, per_node: int, spares: int = 0) -> RolloutSpec:
    return RolloutSpec(engine="sglang", rollout_num_gpus=gpus, rollout_num_gpus_per_engine=per_engine,
                       rollout_num_gpus_per_node=per_node, spare_nodes=spares)


def test_engines_of_two_nodes_take_whole_nodes_of_their_own_and_spares_stay_free(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rollout = sglang(32, 16, 8, spares=1)
    assert (rollout.engine_count, rollout.nodes_per_engine, rollout.num_nodes) == (2, 2, 4)
    lay = place(rollout, 5, monkeypatch)
    assert [p.nodes for p in lay.engines] == [("r1", "r2"), ("r3", "r4")] and lay.spare_nodes == ("r5",)
    assert [p.url for p in lay.engines] == ["http://10.0.0.1:20710", "http://10.0.0.3:20711"]
    assert [p.dist_init_addr for p in lay.engines] == ["10.0.0.1:20712", "10.0.0.3:20713"]
    assert all(p.gpus_per_node == 8 for p in lay.engines)  # srun --gpus-per-node on each node
    ports = [lay.router_port, lay.router_metrics_port, lay.trainer_master_port,
             *(p.port for p in lay.engines), *(p.dist_init_port for p in lay.engines)]
    assert len(set(ports)) == len(ports), ports  # distinct even where nodes share an address


def test_one_node_engines_are_placed_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    lay = place(sglang(16, 4, 8), 2, monkeypatch)
    assert [p.nodes for p in lay.engines] == [("r1",), ("r1",), ("r2",), ("r2",)]
    assert all(p.dist_init_addr is None and p.gpus_per_node == 4 for p in lay.engines)
    argv = engine_command(JobSpec(rollout=sglang(16, 4, 8)), lay.engines[0], "python")
    assert "--nnodes" not in argv and argv[argv.index("--tp-size") + 1] == "4"


def test_the_cpu_engine_takes_its_topology_from_the_gpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    rollout = RolloutSpec(engine="cpu", num_engines=1, rollout_num_gpus_per_engine=8, rollout_num_gpus_per_node=4,
                          spare_nodes=1)
    assert (rollout.nodes_per_engine, rollout.num_nodes, rollout.engines_on_each_node) == (2, 2, 1)
    spec = JobSpec(rollout=rollout)
    assert het_groups(spec)[1].nodes == 3 and het_groups(spec)[1].gpus_per_node == 0
    lay = place(rollout, 3, monkeypatch)
    (engine,) = lay.engines
    assert engine.nodes == ("r1", "r2") and engine.gpus_per_node == 0 and lay.spare_nodes == ("r3",)
    spec.trainer.train_args = ["--hf-checkpoint", "/m"]
    argv = engine_command(spec, engine, "python")
    assert argv[:3] == ["python", "-m", "rollout.cpu_engine"]
    flags = {argv[i]: argv[i + 1] for i in range(3, len(argv) - 1) if argv[i].startswith("--")}
    assert (flags["--tp-size"], flags["--nnodes"], flags["--node-rank"]) == ("2", "2", "0")
    assert flags["--dist-init-addr"] == engine.dist_init_addr and flags["--host"] == "10.0.0.1"


def test_an_allocation_too_small_for_the_engines_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="2 engines of 2 nodes need 4 rollout nodes besides the 1 spare ones; "
                                         "the allocation has 4"):
        place(sglang(32, 16, 8, spares=1), 4, monkeypatch)


def test_a_lost_node_is_swapped_for_a_spare_and_node_0_stays_first(monkeypatch: pytest.MonkeyPatch) -> None:
    lay = place(sglang(16, 16, 8, spares=2), 4, monkeypatch)
    engine = lay.engines[0]
    moved = lay.moved(engine, {"r1": "r4"})  # node 0 lost: the spare is the new node 0
    assert moved.nodes == ("r4", "r2") and moved.url == "http://10.0.0.4:20710"
    assert moved.dist_init_addr == "10.0.0.4:20711"
    assert lay.moved(engine, {"r2": "r3"}).nodes == ("r1", "r3")


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


def test_an_engine_with_a_lost_node_moves_only_when_a_spare_is_left_for_each(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    lay = place(sglang(16, 16, 8, spares=1), 3, monkeypatch)
    lost = {"r2": "DOWN"}
    monkeypatch.setattr(NodeTracker, "check", lambda self, nodes: {n: lost[n] for n in nodes if n in lost})
    monkeypatch.setattr(NodeTracker, "release", lambda self, node: "released")
    events, store = _Recorder(), StateStore(JobDir(tmp_path))
    engines = Engines(lay.engines, _Recorder(), _Recorder(), "key", listed_timeout_s=1.0, store=store)
    job = SimpleNamespace(layout=lay, ft=SimpleNamespace(slurm_command_timeout=1.0, node_poll_interval=1.0),
                          events=events, store=store, engines=engines)
    engine = engines["engine-0"]
    engine.recent_restarts = 2  # the test's start: a crash loop under way
    failures = NodeFailures(job)
    assert failures.place_on_live_node(engine) is None
    assert engine.place.nodes == ("r1", "r3") and engine.recent_restarts == 0
    assert store.snapshot().steps["engine-0"].nodes == ["r1", "r3"]  # recorded by the engines' owner
    moved = [call for call in events.calls if call[1] == ("engine_moved", "engine-0")]
    assert moved and moved[0][2]["to_nodes"] == ["r1", "r3"] and moved[0][2]["from_nodes"] == ["r1", "r2"]
    lost.update({"r1": "DOWN", "r3": "DOWN"})  # two lost, no spare left: given back to the caller
    assert failures.place_on_live_node(engine) in ("r1", "r3") and engine.place.nodes == ("r1", "r3")


def test_take_spares_takes_all_it_needs_or_none() -> None:
    tracker = NodeTracker("1", ["a", "b", "c"], keep=(), timeout_s=1.0)
    assert tracker.take_spares(2) == ["a", "b"] and tracker.take_spares(2) is None and tracker.spares == ("c",)


def test_each_task_of_the_step_runs_as_its_own_node_rank() -> None:
    env = node_rank.step_env(("r4", "r2"), ("10.0.0.4", "10.0.0.2"))
    assert node_rank.this_node({**env, node_rank.NODE_NAME_ENV: "r2"}) == (1, "10.0.0.2")
    assert node_rank.this_node({**env, node_rank.NODE_NAME_ENV: "r4"}) == (0, "10.0.0.4")
    with pytest.raises(node_rank.NodeRankError, match="node 'r9' .* is not one of the engine's nodes"):
        node_rank.this_node({**env, node_rank.NODE_NAME_ENV: "r9"})
    flags = ["--host", "10.0.0.4", "--port", "1", "--nnodes", "2", "--node-rank", "0", "--x=1"]
    assert node_rank.node_argv(flags, 1, "10.0.0.2") == ["--host", "10.0.0.2", "--port", "1", "--nnodes", "2",
                                                         "--node-rank", "1", "--x=1"]
    assert node_rank.node_argv(["--node-rank=0"], 1, "h") == ["--node-rank=1", "--host", "h"]
    assert node_rank.wrapped(["py", "-m", "rollout.cpu_engine", "--a"]) == [
        "py", "-m", "supervisor.node_rank", "rollout.cpu_engine", "--a"]


def test_prefill_and_decode_engines_take_their_roles_and_ports_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """--prefill-num-servers 1 over two engines of two nodes: engine-0 prefill (its bootstrap server
    on its node 0, a port no other of the job's), engine-1 decode; their command lines say so."""
    rollout = sglang(32, 16, 8)
    rollout.prefill_num_servers = 1
    lay = place(rollout, 4, monkeypatch)
    assert [(p.role, p.nodes) for p in lay.engines] == [("prefill", ("r1", "r2")), ("decode", ("r3", "r4"))]
    assert lay.engines[0].bootstrap_port is not None and lay.engines[1].bootstrap_port is None
    ports = [lay.router_port, lay.router_metrics_port, lay.trainer_master_port, lay.engines[0].bootstrap_port,
             *(p.port for p in lay.engines), *(p.dist_init_port for p in lay.engines)]
    assert len(set(ports)) == len(ports), ports
    spec = JobSpec(rollout=rollout)
    prefill, decode = (engine_command(spec, p, "python") for p in lay.engines)
    assert prefill[prefill.index("--disaggregation-bootstrap-port") + 1] == str(lay.engines[0].bootstrap_port)
    assert decode[decode.index("--disaggregation-mode") + 1] == "decode" and "--nnodes" in decode
    moved = lay.moved(lay.engines[0], {"r2": "r9"})  # a lost node swapped: the role and ports stay
    assert (moved.role, moved.bootstrap_port) == ("prefill", lay.engines[0].bootstrap_port)
