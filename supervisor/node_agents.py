"""Engines run by node agents (`steps.engine_launch: node_agent`): a backend of step control
(supervisor/step_control.py) over SLURM's (StepController). Each node that runs engines gets one
step, its agent (supervisor/node_agent.py), holding the node's share of the job's CPUs and GPUs for
its engines; an engine's launch, stop and exit are messages on the agent step's own stdin and
stdout, which its srun carries. So the head node keeps one srun client per node, not per engine,
and a restart uses no new step (SLURM's MaxStepCount, its RPC rate limit). Each engine still has
its own Step, started, stopped and restarted alone, and its exit reaches on_exit at once, as a
step's does; everything else the supervisor launches (the router, the trainer, an engine over
several nodes or beside the trainer's tasks) goes to SLURM as its own step, as before.

An agent is launched on a node at the first engine start there (a spare node's too, when an
engine moves to it). Its srun ending (node lost, agent killed) ends every engine of the node, each
reported with the srun's exit code. A supervisor that crashes takes its agents' channels with it:
the agents then stop their engines and end; its successor (or the next run after a requeue)
cancels whatever is left of them and launches its own (it adopts no agent-run engine).

Thread model: one reader thread per agent (its srun's stdout); writes to an agent's stdin under the
agent's lock; the table of agents under the backend's lock.
"""

from __future__ import annotations

import json
import logging
import subprocess
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from slurm.contact import SlurmContact
from slurm.step_spec import StepSpec
from supervisor.step_control import (
    UNKNOWN_EXIT,
    Step,
    StepControl,
    StepCount,
    StepStatus,
    kill_process_group,
    log_offset,
    stop_process_group,
)

log = logging.getLogger(__name__)

AGENT_PREFIX = "agent-"  # an agent step's name: agent-NODE
AGENT_END_S = 30.0  # for an agent told to end (its input closed) to stop its engines and exit


@dataclass(frozen=True)
class AgentShape:
    """What every agent step holds and how it is run: the most engines a node runs, times each
    engine's CPUs and GPUs (an engine that moves to a spare node finds room there)."""

    python: str
    log_dir: Path
    cpus_per_node: int | None
    gpus_per_node: int
    het_group: int | None = None
    options: tuple[str, ...] = ()  # the engine role's srun options (a container, the site's own)
    env: Mapping[str, str] | None = None
    workdir: str | None = None

    def spec(self, node: str) -> StepSpec:
        return StepSpec(f"{AGENT_PREFIX}{node}", (self.python, "-m", "supervisor.node_agent"), (node,),
                        self.log_dir / f"agent-{node}.log", het_group=self.het_group, gpus_per_node=self.gpus_per_node,
                        cpus_per_task=self.cpus_per_node, options=self.options, env=self.env, workdir=self.workdir,
                        piped=True)


class AgentRun:
    """One engine as an agent runs it: the supervisor's StepProcess for it. `pid` is the agent's
    srun (a signal to it ends the node's agent and engines); the engine's own is `remote_pid`."""

    def __init__(self, agent: _Agent) -> None:
        self.agent = agent
        self.remote_pid: int | None = None
        self.returncode: int | None = None
        self._ended = threading.Event()

    @property
    def pid(self) -> int:
        return self.agent.step.proc.pid if self.agent.step.proc is not None else 0

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"engine in agent-{self.agent.node}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def end(self, code: int) -> bool:
        """Record its exit; False if it had ended already."""
        if self._ended.is_set():
            return False
        self.returncode = code
        self._ended.set()
        return True


@dataclass
class _Agent:
    node: str
    step: Step  # the agent's own srun step
    stdin: IO[bytes]
    runs: dict[str, Step] = field(default_factory=dict)  # engine name -> its current Step here
    gone: bool = False  # its srun ended: every run here ended with gone_code
    gone_code: int = UNKNOWN_EXIT
    lock: threading.Lock = field(default_factory=threading.Lock)  # stdin, runs and gone

    def send(self, message: Mapping[str, Any]) -> None:
        with self.lock:
            self.stdin.write((json.dumps(message) + "\n").encode())
            self.stdin.flush()


class PipedSteps(StepControl, Protocol):
    """A step control that also launches a step with a channel to it (StepController, LocalSteps)."""

    def launch_piped(self, spec: StepSpec) -> Step:
        """The step, its stdin and stdout pipes to us; not watched for its exit."""


class NodeAgentSteps:
    """Step control where the engines named in `engines` run in node agents, and every other step
    (and an engine over several nodes, or overlapping other steps) is SLURM's own (`steps`)."""

    def __init__(self, steps: PipedSteps, shape: AgentShape, engines: Collection[str],
                 on_exit: Callable[[Step], None]) -> None:
        self.steps = steps
        self.shape = shape
        self.engines = frozenset(engines)
        self._on_exit = on_exit
        self._lock = threading.Lock()
        self._agents: dict[str, _Agent] = {}

    @property
    def contact(self) -> SlurmContact:
        return self.steps.contact

    def launch(self, spec: StepSpec) -> Step:
        if not self._in_agent(spec):
            return self.steps.launch(spec)
        agent = self._agent(spec.nodes[0])
        step = Step(spec.name, AgentRun(agent), agent.step.slurm_step, log=spec.log, log_offset=log_offset(spec.log))
        with agent.lock:
            gone = agent.gone
            if not gone:
                agent.runs[spec.name] = step
        if gone:  # its srun ended meanwhile: so did this start
            self._end(step, agent.gone_code)
            return step
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        try:  # srun holds what comes before the agent reads (a pipe's worth): no wait for it here
            agent.send({"start": spec.name, "argv": list(spec.argv), "env": self._own_env(spec),
                        "log": str(spec.log), "cwd": spec.workdir, "gpus": spec.gpus_per_node})
        except (BrokenPipeError, ValueError):  # its srun is gone: the reader ends this run
            pass
        return step

    def query(self) -> dict[str, tuple[str, str]] | None:
        return self.steps.query()

    def refresh(self, steps: Iterable[Step]) -> dict[str, StepStatus]:
        steps = list(steps)
        runs = [s for s in steps if isinstance(s.proc, AgentRun)]
        with self._lock:
            agents = [a.step for a in self._agents.values()]
        status = self.steps.refresh([s for s in steps if s not in runs] + agents)
        for agent_step in agents:
            status.pop(agent_step.spec_name, None)
        for step in runs:
            assert isinstance(step.proc, AgentRun)
            agent = step.proc.agent
            step.slurm_step = agent.step.slurm_step  # the agent's step: where the engine runs
            status[step.spec_name] = ("exited" if step.returncode is not None
                                      else "running" if step.proc.remote_pid is not None else "pending")
        return status

    def adopt(self, recorded: Mapping[str, str | None]) -> list[Step] | None:
        """SLURM's steps only: an agent-run engine ends with its predecessor's channel. The agents
        the recorded engines ran in (a crashed supervisor's, or a requeued run's left in the rollout
        allocation) are cancelled first: their engines hold the ports and resources ours need."""
        rows = self.steps.query()
        if rows is None:
            return None
        old_agents = {rows[sid][0]: sid for name, sid in recorded.items()
                      if name in self.engines and sid in rows and rows[sid][0].startswith(AGENT_PREFIX)}
        for stale in self.steps.adopt(old_agents) or []:
            self.steps.cancel(stale, AGENT_END_S, AGENT_END_S)
        return self.steps.adopt({name: step_id for name, step_id in recorded.items() if name not in self.engines})

    def ended(self, name: str, step_id: str, code: int | None = None) -> Step:
        return self.steps.ended(name, step_id, code)

    def exit_codes(self, step_ids: Collection[str]) -> dict[str, int]:
        return self.steps.exit_codes(step_ids)

    def cancel(self, step: Step, timeout_s: float, term_grace_s: float) -> None:
        if not isinstance(step.proc, AgentRun):
            self.steps.cancel(step, timeout_s, term_grace_s)
            return
        run = step.proc
        if run.returncode is None and run.agent.step.returncode is None:
            try:
                run.agent.send({"stop": step.spec_name, "grace_s": term_grace_s})
            except (BrokenPipeError, ValueError):  # the agent's srun is gone: so is the engine
                pass
        try:
            run.wait(timeout_s + term_grace_s)
        except subprocess.TimeoutExpired as err:
            raise TimeoutError(f"{step.spec_name} still runs in agent-{run.agent.node} "
                               f"{timeout_s + term_grace_s:.0f} s after it was told to stop") from err

    def abandon(self, step: Step, wait_s: float) -> None:
        """A fenced supervisor's: its agent's srun is killed (the node's engines with it)."""
        if isinstance(step.proc, AgentRun):
            kill_process_group(step.proc.agent.step, wait_s)
        else:
            self.steps.abandon(step, wait_s)

    def rate_limited(self, step: Step) -> str | None:
        if isinstance(step.proc, AgentRun):  # its launch was a message; its agent's may have been refused
            agent = step.proc.agent.step
            return self.steps.rate_limited(agent) if agent.returncode is not None else None
        return self.steps.rate_limited(step)

    def count(self) -> StepCount:
        return self.steps.count()

    def close(self) -> None:
        """End every agent (its input closed: it stops its engines), then SLURM's watcher."""
        with self._lock:
            agents = list(self._agents.values())
        for agent in agents:
            with agent.lock:
                agent.stdin.close()
        for agent in agents:
            proc = agent.step.proc
            assert proc is not None
            try:
                proc.wait(AGENT_END_S)
            except subprocess.TimeoutExpired:
                stop_process_group(proc, AGENT_END_S)
        self.steps.close()

    # ------------------------------------------------------------------ agents
    def _own_env(self, spec: StepSpec) -> dict[str, str]:
        """What the engine's environment adds to its agent's (which srun built from shape.env, with
        the step's own SLURM variables): the engine's own variables only."""
        base = self.shape.env or {}
        return {k: v for k, v in (spec.env or {}).items() if base.get(k) != v}

    def _in_agent(self, spec: StepSpec) -> bool:
        return spec.name in self.engines and len(spec.nodes) == 1 and spec.ntasks == 1 and not spec.overlap

    def _agent(self, node: str) -> _Agent:
        """The node's agent, launched if it has none (or its srun ended)."""
        with self._lock:
            agent = self._agents.get(node)
            if agent is None or agent.gone:
                agent = self._launch_agent(node)
                self._agents[node] = agent
            return agent

    def _launch_agent(self, node: str) -> _Agent:
        step = self.steps.launch_piped(self.shape.spec(node))
        proc = step.proc
        assert isinstance(proc, subprocess.Popen) and proc.stdin is not None and proc.stdout is not None
        agent = _Agent(node, step, proc.stdin)
        threading.Thread(target=self._read, args=(agent, proc.stdout), name=f"agent-{node}", daemon=True).start()
        return agent

    def _read(self, agent: _Agent, out: IO[bytes]) -> None:
        """The agent's reports, until its srun ends; then every engine still there ended with it."""
        for raw in out:
            try:
                message = json.loads(raw)
            except ValueError:
                log.warning("agent-%s said %r", agent.node, raw[:200])
                continue
            if "ready" in message:
                log.info("agent-%s runs (GPUs %s)", agent.node, message.get("gpus"))
            elif "started" in message:
                with agent.lock:
                    step = agent.runs.get(message["started"])
                if step is not None and isinstance(step.proc, AgentRun):
                    step.proc.remote_pid = int(message["pid"])
            elif "exited" in message:
                self._ended(agent, message["exited"], int(message["code"]))
            elif "refused" in message:
                log.warning("agent-%s refused %s: %s", agent.node, message["refused"], message.get("why"))
                self._ended(agent, message["refused"], UNKNOWN_EXIT)
        proc = agent.step.proc
        assert proc is not None
        code = proc.wait()
        with agent.lock:
            agent.gone, agent.gone_code = True, code if code > 0 else UNKNOWN_EXIT
            left = list(agent.runs.values())
            agent.runs.clear()
        for step in left:
            self._end(step, agent.gone_code)

    def _ended(self, agent: _Agent, name: str, code: int) -> None:
        with agent.lock:
            step = agent.runs.pop(name, None)
        if step is not None:
            self._end(step, code)

    def _end(self, step: Step, code: int) -> None:
        if isinstance(step.proc, AgentRun) and step.proc.end(code):
            self._on_exit(step)
