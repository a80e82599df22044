"""A recovery's tries, against the local step backend (the stand-in engines of
tests/supervisor/local_engine.py as plain processes; the setup of test_recovery_local.py):

- One recovery per engine at a time: a failure seen while a recovery waits for the engine's
  admission (the trainer's publish dropped it) is that recovery's next try, never a second recovery;
  the tries are bounded and the engine is given up with the last failure's reason, its step stopped.
- An engine that comes back at an old weight version (it loads a published folder and reports
  another version) is given up after two tries, with that reason.
- A start that fails twice with the same error line in the engine's log is given up, naming it.
- The last engine given up ends the job with a reason, even with min_engines 0 (no hang with no
  worker).
- An engine loading the current version from disk gets no publish meanwhile, and takes a newer one
  after its load."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from contract.spec import JobSpec
from slurm.devcluster.daemons import wait_for
from supervisor import launcher
from supervisor.context import JobContext
from supervisor.engine_states import FAILED, HEALTHY
from supervisor.layout import EnginePlace
from tests.supervisor.recovery_wiring import Wiring
from tests.supervisor.test_recovery_local import VERSION, WAIT_S, _kinds, _start, _wire, local_job

__all__ = ["local_job"]  # the fixture, shared with test_recovery_local

DROPPED = "/model_info says weight_version None, expected 3"  # the trainer's reason for a publish that missed it
FAILS_WITH = "local_engine: error: /models/qwen is not a Hugging Face model folder (no config.json)"
FAILING = ["--say", FAILS_WITH, "--exit-code", "2"]  # a start that fails, its log naming why
flags: dict[str, list[str]] = {}  # engine -> extra flags of its next launches


def _engine_command(spec: JobSpec, place: EnginePlace, python: str) -> list[str]:
    return [sys.executable, "-m", "tests.supervisor.local_engine", "--port", str(place.port),
            *flags.get(place.name, [])]


@pytest.fixture
def job(local_job, monkeypatch: pytest.MonkeyPatch):
    """test_recovery_local's two engines, engine-0's later launches as `flags` says, up to 5 restarts."""
    monkeypatch.setattr(launcher, "engine_command", _engine_command)
    flags.clear()
    job, router = local_job
    spec = dataclasses.replace(job.spec, fault_tolerance=dataclasses.replace(job.ft, max_engine_restarts=5))
    return dataclasses.replace(job, spec=spec), router


@pytest.fixture
def wired(job, tmp_path: Path) -> Iterator[tuple[JobContext, Wiring, Counter]]:
    """The job's engines started through the recovery, as the daemon wires it; the most recoveries
    of each engine that ran at once. Every step is stopped after the test."""
    job, router = job
    wiring = _wire(job, router, tmp_path / "steps")
    most = _counting_recoveries(wiring)
    try:
        _start(job, wiring)
        yield job, wiring, most
    finally:
        wiring.stop()


def _counting_recoveries(wiring: Wiring) -> Counter:
    """The most recoveries of each engine that ran at once (each is one _restart call in the pool)."""
    lock, running, most = threading.Lock(), Counter(), Counter()
    restart = wiring.recovery._restart

    def counted(engine, detected: float) -> None:
        with lock:
            running[engine.name] += 1
            most[engine.name] = max(most[engine.name], running[engine.name])
        try:
            restart(engine, detected)
        finally:
            with lock:
                running[engine.name] -= 1
    wiring.recovery._restart = counted  # type: ignore[method-assign]
    return most


def _events(job: JobContext, kind: str, step: str = "engine-0") -> list[dict]:
    rows = [json.loads(line) for line in job.dir.events.read_text().splitlines()]
    return [e for e in rows if e["kind"] == kind and e.get("step") == step]


def _kill(wiring: Wiring, job: JobContext, name: str = "engine-0") -> None:
    """SIGKILL its step; its exit is recovered as the daemon's monitor does (older exits are passed over)."""
    step = wiring.launcher.current(name)
    os.killpg(step.proc.pid, signal.SIGKILL)
    while (exited := job.inbox.get(timeout=WAIT_S)) is not step:
        assert exited.spec_name != name or wiring.launcher.current(name) is not exited
    wiring.recovery.recover(job.engines[name], f"process exited with code {step.returncode}")


def _given_up(job: JobContext, wiring: Wiring) -> dict:
    wait_for(lambda: _events(job, "engine_given_up") and not wiring.recovery.is_recovering("engine-0"), WAIT_S,
             "engine-0 given up")
    engine = job.engines["engine-0"]
    assert engine.state == FAILED and not engine.in_router
    assert wiring.launcher.current("engine-0").returncode is not None, "the step of a given-up engine runs on"
    assert job.engines["engine-1"].state == HEALTHY and wiring.ending.failure is None
    [given_up] = _events(job, "engine_given_up")
    return given_up


def _when(predicate: Callable[[], bool], what: str, then: Callable[[], None]) -> None:
    wait_for(predicate, WAIT_S, what)
    then()


def test_a_drop_while_its_recovery_awaits_admission_is_that_recoverys_next_try(wired) -> None:
    job, wiring, most = wired
    engine = job.engines["engine-0"]
    shutil.rmtree(job.dir.weights_of(VERSION))  # an update group's version: only the next publish brings it
    _kill(wiring, job)
    for restarts in range(1, job.ft.max_engine_restarts + 1):
        # Up again, out of the router, among the engines the trainer publishes to: the trainer's
        # publish drops it (it does not take the version), as it would drop a stale engine.
        _when(lambda n=restarts: engine.restarts == n and engine.name in wiring.recovery.serving(),
              f"engine-0 up after restart {restarts}",
              lambda: wiring.handlers.published(VERSION, [job.engines["engine-1"].url], {engine.url: DROPPED}))
    given_up = _given_up(job, wiring)
    assert most["engine-0"] == 1, f"{most['engine-0']} recoveries of engine-0 ran at once"
    assert engine.restarts == job.ft.max_engine_restarts
    assert DROPPED in given_up["reason"] and "restarts in a row" in given_up["reason"], given_up
    failed = _events(job, "engine_failed")
    assert len(failed) == 1 + job.ft.max_engine_restarts and all("during" in e for e in failed[1:]), failed
    assert not _events(job, "engine_recovered")
    launches = [k for k in _kinds(job) if k == ("step_launched", "engine-0")]
    assert len(launches) == 1 + job.ft.max_engine_restarts, "a launch after the engine was given up"


def test_an_engine_back_at_an_old_weight_version_is_given_up_after_two_tries(wired) -> None:
    job, wiring, most = wired
    flags["engine-0"] = ["--stuck-version"]
    _kill(wiring, job)
    given_up = _given_up(job, wiring)
    assert most["engine-0"] == 1 and job.engines["engine-0"].restarts == 2
    assert "reports weight_version None after a load from disk" in given_up["reason"], given_up
    assert "a restart does not fix it" in given_up["reason"], given_up
    assert [e["cause"] for e in _events(job, "engine_restart_failed")] == [
        "it reports weight_version None after a load from disk"] * 2


def test_a_start_that_fails_twice_the_same_way_is_given_up_naming_the_error(wired) -> None:
    job, wiring, _ = wired
    flags["engine-0"] = FAILING
    _kill(wiring, job)
    given_up = _given_up(job, wiring)
    failures = _events(job, "engine_restart_failed")
    assert [e["cause"] for e in failures] == [FAILS_WITH, FAILS_WITH], failures
    assert all(e["reason"].endswith(f"its log says: {FAILS_WITH}") for e in failures), failures
    assert FAILS_WITH in given_up["reason"] and job.engines["engine-0"].restarts == 2, given_up


def test_the_last_engine_given_up_fails_the_job_even_with_min_engines_0(wired) -> None:
    job, wiring, _ = wired
    assert job.ft.min_engines == 0
    flags.update({"engine-0": FAILING, "engine-1": FAILING})
    _kill(wiring, job, "engine-0")
    wait_for(lambda: _events(job, "engine_given_up"), WAIT_S, "engine-0 given up")
    assert _events(job, "engine_degraded") and wiring.ending.failure is None  # one engine left: it goes on
    _kill(wiring, job, "engine-1")
    wait_for(lambda: wiring.ending.failure, WAIT_S, "the job's failure")
    assert wiring.ending.failure.startswith("no engine left: engine-1 was given up"), wiring.ending.failure
    assert not _events(job, "engine_degraded", "engine-1")
    assert _events(job, "no_engine_serving", "engine-1"), "the router's last engine left without a word"


def test_an_engine_loading_the_current_version_gets_no_publish_meanwhile(job, tmp_path: Path) -> None:
    """An engine a publish left behind is brought to the current version from disk by the supervisor;
    that load and the trainer's next publish to the same engine raced: the publish's update landed
    first, the load undid it, the trainer saw the older version and the engine was restarted (CI:
    test_short_grace_saves_at_once). While the load runs the engine is not among the engines the
    trainer publishes to; a publish meanwhile leaves it behind again, and the same sync then loads
    that newer version and admits the engine."""
    job, router = job
    gate, waiting = tmp_path / "gate", tmp_path / "gate.waiting"
    gate.touch()  # the loads at start-up go through
    flags["engine-0"] = ["--load-gate", str(gate)]
    wiring = _wire(job, router, tmp_path / "steps")
    engine, other = job.engines["engine-0"], job.engines["engine-1"]

    def publish(version: int) -> None:
        """The trainer's publish of `version` to the engines it was given (engine-1 only, here)."""
        job.dir.weights_of(version).mkdir()
        job.client.load_from_disk(other.url, job.dir.weights_of(version), version, timeout_s=WAIT_S)
        wiring.handlers.published(version, [other.url], {})

    try:
        _start(job, wiring)
        gate.unlink()
        waiting.unlink()
        publish(VERSION + 1)  # engine-0 left behind: the supervisor loads the new version into it
        wait_for(waiting.exists, WAIT_S, "engine-0's load of the current version to begin")
        assert engine.url not in wiring.handlers.ready_engines()["engines"], "a publish now would race its load"
        publish(VERSION + 2)
        gate.touch()
        wait_for(lambda: engine.state == HEALTHY and engine.in_router, WAIT_S, "engine-0 back in the router")
        assert engine.version == VERSION + 2 and job.client.weight_version(engine.url) == VERSION + 2
        assert not _events(job, "engine_failed") and engine.restarts == 0
    finally:
        wiring.stop()
