"""The trainer's link to the supervisor rides out a supervisor gap (a crashed supervisor that its
watchdog restarts): against a real ControlServer that appears late, the calls the trainer needs
wait for it; past the gap, or for a call the supervisor refuses, they fail at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from contract.job_dir import JobDir
from contract.control_protocol import Call, ControlError, SupervisorUnreachable
from supervisor.control import ControlServer
from tests.control_helpers import handler_table
from trainer.supervisor_link import SupervisorLink

CALL_S = 10.0  # one control call's bound in these tests


class LateSupervisor:
    """A ControlServer that starts `delay_s` after the test begins, recording the calls it gets."""

    def __init__(self, job_dir: JobDir, delay_s: float) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        answers = {Call.READY_ENGINES: {"engines": ["http://e0"]}, Call.TRAINER_POLL: {"stop": True},
                   Call.PUBLISHED: {}, Call.ENGINE_FAILED: {}}
        self.server = ControlServer(job_dir, handler_table(
            {call: self._handler(call.value, answer) for call, answer in answers.items()}))
        self.timer = threading.Timer(delay_s, self.server.start)

    def _handler(self, name: str, answer: dict[str, Any]) -> Any:
        def handle(**args: Any) -> dict[str, Any]:
            self.calls.append((name, args))
            return answer
        return handle


@pytest.fixture
def late(tmp_path: Path) -> Iterator[LateSupervisor]:
    supervisor = LateSupervisor(JobDir(tmp_path), delay_s=1.5)
    supervisor.timer.start()
    yield supervisor
    supervisor.timer.cancel()
    supervisor.server.close()


def test_calls_wait_for_a_supervisor_that_appears_late(late: LateSupervisor, tmp_path: Path) -> None:
    link = SupervisorLink(JobDir(tmp_path), CALL_S, gap_s=30, retry_s=0.1)
    began = time.monotonic()
    assert link.ready_engines() == ["http://e0"]
    assert time.monotonic() - began >= 1.4
    assert link.stop_requested(7) is True
    assert late.calls == [("ready_engines", {}), ("trainer_poll", {"rollout_id": 7})]


def test_a_published_version_reaches_a_late_supervisor(late: LateSupervisor, tmp_path: Path) -> None:
    SupervisorLink(JobDir(tmp_path), CALL_S, gap_s=30, retry_s=0.1).published(3, ["http://e0"], {})
    assert late.calls == [("published", {"version": 3, "updated": ["http://e0"], "dropped": {}})]


def test_past_the_gap_the_call_fails_and_a_failure_report_does_not_wait(tmp_path: Path) -> None:
    link = SupervisorLink(JobDir(tmp_path), CALL_S, gap_s=0.5, retry_s=0.1)
    began = time.monotonic()
    with pytest.raises(SupervisorUnreachable, match="no supervisor is running"):
        link.ready_engines()
    assert 0.3 < time.monotonic() - began < 5
    began = time.monotonic()
    link.engine_failed("http://e0", "timeout")  # logged, not waited for: the rollout goes on
    assert time.monotonic() - began < 0.5


def test_a_refused_call_is_not_asked_again(tmp_path: Path) -> None:
    calls = []
    table = handler_table({Call.READY_ENGINES: lambda: calls.append(1) or 1 / 0})
    with ControlServer(JobDir(tmp_path), table):
        with pytest.raises(ControlError, match="ZeroDivisionError") as err:
            SupervisorLink(JobDir(tmp_path), CALL_S, gap_s=30, retry_s=0.1).ready_engines()
    assert not isinstance(err.value, SupervisorUnreachable) and calls == [1]


def test_the_first_publish_waits_while_the_engines_start(tmp_path: Path) -> None:
    """The trainer is launched beside its engines: while the supervisor answers `starting`, it asks
    again, and returns the engines once one is ready; past engine_start_s it goes on without."""
    ready = threading.Event()
    asks = []

    def ready_engines() -> dict[str, Any]:
        asks.append(1)
        return {"engines": ["http://e0"], "launches": {"http://e0": 1}, "starting": False} if ready.is_set() \
            else {"engines": [], "launches": {}, "starting": True}

    with ControlServer(JobDir(tmp_path), handler_table({Call.READY_ENGINES: ready_engines})):
        timer = threading.Timer(1.0, ready.set)
        timer.start()
        began = time.monotonic()
        link = SupervisorLink(JobDir(tmp_path), CALL_S, gap_s=30, retry_s=0.1)
        assert link.ready_engines() == ["http://e0"]
        assert time.monotonic() - began >= 0.9 and len(asks) > 2
        assert link.launches == {"http://e0": 1}  # how often each was launched again, for the publisher
        ready.clear()
        began = time.monotonic()
        link = SupervisorLink(JobDir(tmp_path), CALL_S, gap_s=30, retry_s=0.1, engine_start_s=0.5)
        assert link.ready_engines() == []
        assert 0.4 < time.monotonic() - began < 5
