"""Engines in node agents (supervisor/node_agents.py over supervisor/node_agent.py), on the local
step backend: one agent step per node starts, stops and restarts that node's engines on messages,
each engine alone, with no new step; the agent's end ends its engines, and the next launch there
starts a new agent. (The same backend runs over SLURM in bench/bench_slurm_scale.py.)"""

from __future__ import annotations

import os
import queue
import signal
import sys
from pathlib import Path

import pytest
import requests

from slurm.devcluster.daemons import wait_for
from slurm.step_spec import StepSpec
from supervisor.local_steps import LocalSteps
from supervisor.node_agents import AgentRun, AgentShape, NodeAgentSteps
from supervisor.step_control import Step
from tests.ports import free_port

WAIT_S = 30.0  # for an engine to answer, or an exit to be reported
ENGINES = ("engine-0", "engine-1")


def _answers(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/health_generate", timeout=2).ok
    except requests.RequestException:
        return False


@pytest.fixture
def agents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(sys.path))  # the agent and engines import tests.*
    exits: queue.Queue[Step] = queue.Queue()
    local = LocalSteps("7", tmp_path / "steps")
    steps = NodeAgentSteps(local, AgentShape(sys.executable, tmp_path / "logs", cpus_per_node=None, gpus_per_node=0),
                           ENGINES, on_exit=exits.put)
    ports = {name: free_port() for name in ENGINES}
    specs = {name: StepSpec(name, (sys.executable, "-m", "tests.supervisor.local_engine", "--port", str(port)),
                            ("n1",), tmp_path / "logs" / f"{name}.log", env={**os.environ, "ENGINE_OWN": name})
             for name, port in ports.items()}
    yield steps, specs, ports, exits, local
    steps.close()
    local.close()


def _exit_of(exits: queue.Queue[Step], step: Step) -> None:
    while exits.get(timeout=WAIT_S) is not step:
        pass


def test_one_agent_step_runs_a_nodes_engines_and_restarts_each_alone_without_a_new_step(agents) -> None:
    steps, specs, ports, exits, local = agents
    running = {name: steps.launch(spec) for name, spec in specs.items()}
    for name, port in ports.items():
        wait_for(lambda port=port: _answers(port), WAIT_S, f"{name} answers")
    assert [entry[0] for entry in (local.query() or {}).values()] == ["agent-n1"]  # one step for both
    runs = {name: step.proc for name, step in running.items()}
    assert all(isinstance(run, AgentRun) and run.remote_pid for run in runs.values())
    assert steps.refresh(running.values()) == {n: "running" for n in ENGINES}

    os.kill(runs["engine-0"].remote_pid, signal.SIGKILL)  # a crash: reported at once, with its code
    _exit_of(exits, running["engine-0"])
    assert running["engine-0"].returncode == 128 + signal.SIGKILL
    running["engine-0"] = steps.launch(specs["engine-0"])
    wait_for(lambda: _answers(ports["engine-0"]), WAIT_S, "engine-0 answers again")
    assert len(local.query() or {}) == 1 and steps.count().launched == 1  # no new step
    assert running["engine-1"].returncode is None and runs["engine-1"].remote_pid == running["engine-1"].proc.remote_pid

    steps.cancel(running["engine-1"], timeout_s=5, term_grace_s=2)  # stopped alone
    assert running["engine-1"].returncode == 128 + signal.SIGTERM and not _answers(ports["engine-1"])
    assert _answers(ports["engine-0"])


def test_an_agent_that_dies_ends_its_engines_and_the_next_launch_starts_another(agents) -> None:
    steps, specs, ports, exits, local = agents
    running = {name: steps.launch(spec) for name, spec in specs.items()}
    for name, port in ports.items():
        wait_for(lambda port=port: _answers(port), WAIT_S, f"{name} answers")
    agent_pid = running["engine-0"].proc.pid
    os.killpg(agent_pid, signal.SIGKILL)  # as a lost node ends the agent's srun
    for step in running.values():
        _exit_of(exits, step)
    for name, port in ports.items():  # its engines died with it: none outlives it on its port
        wait_for(lambda port=port: not _answers(port), WAIT_S, f"{name} gone with its agent")
    again = steps.launch(specs["engine-1"])
    wait_for(lambda: _answers(ports["engine-1"]), WAIT_S, "engine-1 answers in a new agent")
    assert again.proc.pid != agent_pid and len(local.query() or {}) == 1 and local.count().launched == 2


def test_a_successor_cancels_the_agents_its_predecessors_engines_ran_in_and_adopts_none(agents, tmp_path) -> None:
    steps, specs, ports, exits, local = agents
    running = {name: steps.launch(spec) for name, spec in specs.items()}
    for name, port in ports.items():
        wait_for(lambda port=port: _answers(port), WAIT_S, f"{name} answers")
    recorded = {name: step.slurm_step for name, step in running.items()}  # the state store's
    assert set(recorded.values()) == {running["engine-0"].proc.agent.step.slurm_step}
    successor = NodeAgentSteps(LocalSteps("7", tmp_path / "steps"),
                               AgentShape(sys.executable, tmp_path / "logs", cpus_per_node=None, gpus_per_node=0),
                               ENGINES, on_exit=lambda step: None)
    try:
        assert successor.adopt(recorded) == []
        assert local.query() == {} and not any(_answers(port) for port in ports.values())
    finally:
        successor.close()
