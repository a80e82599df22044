"""The supervisor's recovery, crash-loop breaker, adoption and lost-node logic against the local
step backend (supervisor/local_steps.py): engine steps are plain processes here (a stand-in engine,
tests/supervisor/local_engine.py), the router an in-process stand-in; no SLURM, seconds a test.
The same paths run against SLURM in tests/integration (test_node_failure, test_supervisor_restart)."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from contract.spec import FaultToleranceSpec, JobSpec, RolloutSpec
from rollout.router_client import RouterClient
from slurm.devcluster.daemons import wait_for
from slurm.step_spec import StepSpec
from supervisor import adoption, launcher, nodes, recovery, status_view
from supervisor.context import JobContext
from supervisor.engine_states import FAILED, HEALTHY
from supervisor.engines import Engines
from supervisor.launcher import RouterPlace
from supervisor.layout import EnginePlace
from supervisor.local_steps import LocalSteps
from supervisor.node_agents import AgentShape, NodeAgentSteps
from supervisor.step_control import Step, StepControl, StepCount
from supervisor.steps import StepController
from tests.supervisor.job_context import two_engine_job
from tests.supervisor.recovery_wiring import Wiring, wire_recovery

VERSION = 3  # the weights the engines serve (published to disk, so a relaunched engine loads them)
WAIT_S = 30.0  # for a recovery to end: each takes well under a second here
crashing: set[str] = set()  # engines whose next launches exit at once (a crash loop)
refused: dict[str, int] = {}  # engine -> its next launches that SLURM refuses for its rate limit
# srun's last words when slurmctld (rl_enable) refuses a step beyond the user's RPC bucket: the
# message of SLURMCTLD_COMMUNICATIONS_HARD_DROP (src/common/slurm_errno.c).
RATE_LIMIT_REFUSAL = "srun: error: Unable to create step for job 999999: Rate limit exceeded, please retry later"


class _Router(BaseHTTPRequestHandler):
    """sglang-router's worker API (rollout/router_client.py), in memory."""

    workers: dict[str, str] = {}

    def _answer(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer({"workers": [{"url": url, "id": wid} for url, wid in _Router.workers.items()]})

    def do_POST(self) -> None:
        url = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["url"]
        _Router.workers[url] = f"w{len(_Router.workers)}"
        self._answer({"worker_id": _Router.workers[url]})

    def do_DELETE(self) -> None:
        _Router.workers = {u: w for u, w in _Router.workers.items() if w != self.path.rsplit("/", 1)[1]}
        self._answer({})

    def log_message(self, *args: object) -> None:
        pass


def _engine_command(spec: JobSpec, place: EnginePlace, python: str) -> list[str]:
    crash = ["--exit-code", "3"] if place.name in crashing else []
    if refused.get(place.name):
        refused[place.name] -= 1
        crash = ["--exit-code", "1", "--say", RATE_LIMIT_REFUSAL]
    return [sys.executable, "-m", "tests.supervisor.local_engine", "--port", str(place.port), *crash]


@pytest.fixture
def local_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[JobContext, RouterPlace]]:
    """Two engines on node n1 (spare node n2), the router stand-in listening, VERSION on disk."""
    monkeypatch.setattr(launcher, "engine_command", _engine_command)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(sys.path))  # the engine steps import tests.*
    crashing.clear()
    refused.clear()
    _Router.workers = {}
    ft = FaultToleranceSpec(use_fault_tolerance=True, max_engine_restarts=2, min_engines=0, restart_backoff=0.1,
                            engine_start_timeout=20.0, step_stop_timeout=5.0, step_term_grace=2.0,
                            slurm_command_timeout=5.0, rollout_health_check_timeout=2.0, engine_admit_timeout=5.0)
    spec = JobSpec(job_dir=str(tmp_path / "job"), rollout=RolloutSpec(engine="cpu", num_engines=2), fault_tolerance=ft)
    job, router = two_engine_job(spec, head="n0", node="n1", het_group=1)
    job = dataclasses.replace(job, layout=dataclasses.replace(job.layout, spare_nodes=("n2",),
                                                              addresses={"n0": "127.0.0.1", "n1": "127.0.0.1",
                                                                         "n2": "127.0.0.1"}))
    server = ThreadingHTTPServer(("127.0.0.1", int(router.url.rsplit(":", 1)[1])), _Router)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    job.dir.weights_of(VERSION).mkdir(parents=True)
    job.engines.published(VERSION, set())  # the trainer's current version: no engine serves it yet
    try:
        yield job, router
    finally:
        server.shutdown()
        server.server_close()
        job.events.close()
        job.client.close()


def _wire(job: JobContext, router: RouterPlace, registry: Path) -> Wiring:
    return wire_recovery(job, router, LocalSteps(job.layout.job_id, registry, on_exit=job.inbox.put))


def _start(job: JobContext, wiring: Wiring) -> None:
    wiring.recovery.start_all(adopted=set())
    assert all(e.state == HEALTHY and e.in_router for e in job.engines.values())
    assert set(_Router.workers) == {e.url for e in job.engines.values()}


def _on_exits(job: JobContext, wiring: Wiring) -> None:
    """What the daemon's monitor does with an engine step's exit: recover the engine."""
    step: Step = job.inbox.get(timeout=WAIT_S)
    engine = job.engines[step.spec_name]
    if wiring.launcher.current(step.spec_name) is step:
        wiring.recovery.recover(engine, f"process exited with code {step.returncode}")


def _kinds(job: JobContext) -> list[tuple[str, str]]:
    return [(e["kind"], e.get("step") or "") for e in map(json.loads, job.dir.events.read_text().splitlines())]


def test_both_backends_offer_the_whole_step_control_interface(tmp_path: Path) -> None:
    local, slurm = LocalSteps("1", tmp_path / "steps"), StepController("1", 5.0, 5.0)
    assert isinstance(local, StepControl) and isinstance(slurm, StepControl)
    assert local.query() == {} and local.exit_codes(["1.0"]) == {}


def test_a_local_step_is_listed_cancelled_and_its_end_recorded(tmp_path: Path) -> None:
    steps = LocalSteps("5", tmp_path / "steps")
    step = steps.launch(StepSpec("engine-0", ("sleep", "60"), ("n1",), tmp_path / "engine-0.log"))
    assert step.slurm_step == "5.0" and steps.query() == {"5.0": ("engine-0", "RUNNING")}
    steps.cancel(step, timeout_s=5, term_grace_s=2)
    assert step.returncode == -signal.SIGTERM and steps.query() == {}
    assert steps.exit_codes(["5.0"]) == {"5.0": 128 + signal.SIGTERM}
    # A successor's view of it (the step ended while no supervisor watched): its exit code.
    assert LocalSteps("5", tmp_path / "steps").ended("engine-0", "5.0").proc.wait(5) == 128 + signal.SIGTERM


def test_an_engine_that_exits_is_relaunched_and_back_in_the_router(local_job, tmp_path: Path) -> None:
    job, router = local_job
    wiring = _wire(job, router, tmp_path / "steps")
    try:
        _start(job, wiring)
        engine = job.engines["engine-0"]
        first = wiring.launcher.current("engine-0")
        os.killpg(first.proc.pid, signal.SIGKILL)
        _on_exits(job, wiring)
        wait_for(lambda: ("engine_recovered", "engine-0") in _kinds(job), WAIT_S, "engine-0 recovered")
        again = wiring.launcher.current("engine-0")
        assert again is not first and again.returncode is None and again.slurm_step == "999999.2"
        assert engine.state == HEALTHY and engine.in_router and engine.version == VERSION and engine.restarts == 1
        assert engine.url in _Router.workers
        assert job.engines["engine-1"].restarts == 0  # the other engine was not touched
    finally:
        wiring.stop()


def test_an_engine_taken_for_failed_while_slurm_ends_the_job_is_not_relaunched(
        local_job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CI: after a scancel an engine's step was launched again. An engine that dies with the job can
    be taken for failed (its probes, the trainer's report) before its step's exit is seen: the
    relaunch asks SLURM first, and launches nothing once the job is ending."""
    job, router = local_job
    wiring = _wire(job, router, tmp_path / "steps")
    try:
        _start(job, wiring)
        # squeue during a hetjob's scancel: the components are COMPLETING (the accounting: CANCELLED)
        slurm_job = wiring.recovery.requeue.slurm_job
        monkeypatch.setattr(slurm_job, "_squeue", lambda field: ["COMPLETING", "COMPLETING", "COMPLETING"])
        monkeypatch.setattr(slurm_job, "_sacct_states", lambda: ["CANCELLED", "CANCELLED", "CANCELLED"])
        first = wiring.launcher.current("engine-0")
        os.killpg(first.proc.pid, signal.SIGKILL)
        assert not wiring.recovery.recover(job.engines["engine-0"], "reported by the trainer: connection refused")
        assert wiring.launcher.current("engine-0") is first
        assert ("step_launched", "engine-0") not in _kinds(job)[2:]  # only the first start's launches
        assert ("job_ending", "engine-0") in _kinds(job) and wiring.ending.by_slurm == "cancelled"
    finally:
        wiring.stop()


def test_an_engine_that_keeps_crashing_is_given_up(local_job, tmp_path: Path) -> None:
    job, router = local_job
    wiring = _wire(job, router, tmp_path / "steps")
    try:
        _start(job, wiring)
        crashing.add("engine-0")
        os.killpg(wiring.launcher.current("engine-0").proc.pid, signal.SIGKILL)
        _on_exits(job, wiring)
        wait_for(lambda: ("engine_given_up", "engine-0") in _kinds(job), WAIT_S, "engine-0 given up")
        engine = job.engines["engine-0"]
        assert engine.state == FAILED and not engine.in_router and engine.url not in _Router.workers
        assert _kinds(job).count(("engine_restart_failed", "engine-0")) == job.ft.max_engine_restarts
        assert job.engines["engine-1"].state == HEALTHY and ("engine_degraded", "engine-0") in _kinds(job)
    finally:
        wiring.stop()


def test_a_restarted_supervisor_adopts_the_live_engines_and_relaunches_none(local_job, tmp_path: Path) -> None:
    job, router = local_job
    first = _wire(job, router, tmp_path / "steps")
    _start(job, first)
    with job.store.update() as state:  # as the daemon's monitor records them each cycle
        for name, step in first.launcher.all().items():
            state.steps[name].slurm_step = step.slurm_step
        state.weight_version = VERSION
    pids = {name: step.proc.pid for name, step in first.launcher.all().items()}
    first.steps.close()  # the supervisor dies; its steps run on
    first.pool.shutdown(wait=True)

    places = [e.place for e in job.engines.values()]
    engines = Engines(places, RouterClient(router.url, "key", 5.0), job.client, "key", listed_timeout_s=5.0,
                      store=job.store)
    successor = dataclasses.replace(job, engines=engines,
                                    inbox=queue.Queue(), finished=threading.Event())
    wiring = _wire(successor, router, tmp_path / "steps")
    try:
        adopted = adoption.adopt(successor, job.store.snapshot(), wiring.steps, wiring.launcher, wiring.trainer)
        assert adopted == {"engine-0", "engine-1"}
        wiring.recovery.start_all(adopted)
        assert all(e.state == HEALTHY and e.in_router for e in successor.engines.values())
        assert len(list((tmp_path / "steps").glob("*.json"))) == 2  # nothing launched twice
        # An adopted engine that dies is seen (its stand-in exits) and relaunched.
        os.kill(pids["engine-1"], signal.SIGKILL)
        wait_for(lambda: wiring.steps.refresh(wiring.launcher.all().values())["engine-1"] == "exited", WAIT_S,
                 "the monitor's look to see engine-1 gone")
        _on_exits(successor, wiring)
        wait_for(lambda: ("engine_recovered", "engine-1") in _kinds(job), WAIT_S, "engine-1 recovered")
        assert wiring.launcher.current("engine-1").slurm_step == "999999.2"
        assert successor.engines["engine-1"].in_router
    finally:
        wiring.stop()
        for step in first.launcher.all().values():  # the first supervisor's children: reaped here
            step.proc.kill()
            step.proc.wait(5)


def test_the_engines_of_a_lost_node_move_to_the_spare_node(local_job, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    job, router = local_job
    wiring = _wire(job, router, tmp_path / "steps")
    lost = {"n1": "DOWN+NOT_RESPONDING (Not responding)"}
    try:
        _start(job, wiring)
        monkeypatch.setattr(nodes, "unusable", lambda names, slurm: {n: why for n, why in lost.items() if n in names})
        for engine, why in wiring.recovery.nodes.check_due():
            wiring.recovery.recover(engine, why)
        wait_for(lambda: sum(k == ("engine_recovered", e) for k in _kinds(job) for e in ("engine-0", "engine-1")) == 1
                 and all(not wiring.recovery.is_recovering(e) for e in job.engines), WAIT_S, "the recoveries end")
        events = [json.loads(line) for line in job.dir.events.read_text().splitlines()]
        assert [e["node"] for e in events if e["kind"] == "node_failed"] == ["n1"]
        moved = [e for e in job.engines.values() if e.place.nodes == ("n2",)]
        given_up = [e for e in job.engines.values() if e.state == FAILED]
        # One spare node: one engine moves there and serves, the other is given up (no spare left).
        assert len(moved) == 1 and moved[0].state == HEALTHY and moved[0].in_router
        assert len(given_up) == 1 and given_up[0].url not in _Router.workers
    finally:
        wiring.stop()



def test_launches_slurm_refuses_for_its_rate_limit_are_retried_not_counted_as_crashes(
        local_job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """rl_enable: a burst of sruns beyond the user's bucket is refused. A refused launch is not the
    engine's failure: it is launched again after a wait, at the first start and in a recovery, more
    times than max_engine_restarts (2 here), and the job is told (slurm_rate_limited)."""
    job, router = local_job
    monkeypatch.setattr(recovery, "retry_delays", lambda: [0.05] * 8)
    wiring = _wire(job, router, tmp_path / "steps")
    try:
        refused["engine-1"] = 3  # its first start
        _start(job, wiring)
        refused["engine-0"] = 3  # its relaunch after a crash
        os.killpg(wiring.launcher.current("engine-0").proc.pid, signal.SIGKILL)
        while not wiring.recovery.is_recovering("engine-0"):  # engine-1's refused steps exited first
            _on_exits(job, wiring)
        wait_for(lambda: ("engine_recovered", "engine-0") in _kinds(job), WAIT_S, "engine-0 recovered")
        assert all(e.state == HEALTHY and e.in_router for e in job.engines.values())
        assert ("engine_given_up", "engine-0") not in _kinds(job)
        assert job.engines["engine-0"].recent_restarts == 1  # the crash, not the refusals
        said = [e for e in map(json.loads, job.dir.events.read_text().splitlines()) if e["kind"] == "slurm_rate_limited"]
        assert sorted(e["step"] for e in said) == ["engine-0"] * 3 + ["engine-1"] * 3
        assert all(e["said"] == RATE_LIMIT_REFUSAL for e in said)
    finally:
        wiring.stop()


class _StepsOfALimitedJob(LocalSteps):
    """Local steps counted against a MaxStepCount of 4."""

    def count(self) -> StepCount:
        launched = super().count().launched
        return StepCount(launched, 4, launched >= 0.9 * 4)


def test_the_job_is_told_once_when_its_steps_near_max_step_count(local_job, tmp_path: Path) -> None:
    job, router = local_job
    wiring = wire_recovery(job, router, _StepsOfALimitedJob(job.layout.job_id, tmp_path / "steps",
                                                            on_exit=job.inbox.put))
    try:
        _start(job, wiring)  # 2 steps of 4
        assert ("step_budget_low", "engine-1") not in _kinds(job)
        assert (job.store.snapshot().steps_launched, job.store.snapshot().max_step_count) == (2, 4)
        for _ in range(2):  # two relaunches: 4 of 4, told at the first past 9/10 of it
            before = wiring.launcher.current("engine-0")
            os.killpg(before.proc.pid, signal.SIGKILL)
            while not wiring.recovery.is_recovering("engine-0"):
                _on_exits(job, wiring)
            wait_for(lambda: wiring.launcher.current("engine-0") is not before
                     and not wiring.recovery.is_recovering("engine-0"), WAIT_S, "engine-0 relaunched")
        told = [e for e in map(json.loads, job.dir.events.read_text().splitlines()) if e["kind"] == "step_budget_low"]
        assert [(e["steps_launched"], e["max_step_count"]) for e in told] == [(4, 4)]
        assert status_view.header(dataclasses.asdict(job.store.snapshot())).endswith("steps 4/4")
    finally:
        wiring.stop()


def test_engines_in_a_node_agent_are_recovered_alone_without_new_steps(local_job, tmp_path: Path) -> None:
    """steps.engine_launch: node_agent. The supervisor's own recovery (crash seen, relaunched,
    synced, admitted) through the agent: one step for the node, and none more for the restart."""
    job, router = local_job
    local = LocalSteps(job.layout.job_id, tmp_path / "steps", on_exit=job.inbox.put)
    shape = AgentShape(sys.executable, tmp_path / "agents", cpus_per_node=None, gpus_per_node=0)
    wiring = wire_recovery(job, router, NodeAgentSteps(local, shape, job.engines, on_exit=job.inbox.put))
    try:
        _start(job, wiring)
        assert [name for name, _ in (local.query() or {}).values()] == ["agent-n1"]
        victim = wiring.launcher.current("engine-0")
        other = wiring.launcher.current("engine-1")
        os.kill(victim.proc.remote_pid, signal.SIGKILL)
        _on_exits(job, wiring)
        wait_for(lambda: ("engine_recovered", "engine-0") in _kinds(job), WAIT_S, "engine-0 recovered")
        assert job.engines["engine-0"].in_router and job.engines["engine-0"].restarts == 1
        assert wiring.launcher.current("engine-1") is other and other.returncode is None
        assert job.engines["engine-1"].restarts == 0 and local.count().launched == 1  # no step for the restart
    finally:
        wiring.stop()  # the engines, then the agent (NodeAgentSteps.close)
