"""Parallel probing, the failure threshold with first-wait, and the blast-radius cap."""

from __future__ import annotations

import socket
import time

import pytest

from supervisor.probe import HealthTracker, KillBudget, Prober, ProbeResult
from tests.supervisor.fake_engines import fake_engines

OK = ProbeResult(True, 0.01)
BAD = ProbeResult(False, 1.0, "HTTP 503")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_cycle_over_many_engines_takes_about_one_timeout_not_the_sum() -> None:
    timeout_s = 1.0
    with (fake_engines(ok=60, fail=10, hang=10, delay_ms=50, api_key="k") as ports,
          Prober(timeout_s, api_key="k") as prober):
        targets = {f"{b}-{i}": f"http://127.0.0.1:{p}" for b, ps in ports.items() for i, p in enumerate(ps)}
        targets["refused-0"] = f"http://127.0.0.1:{closed_port()}"
        prober.probe_all(targets)  # warm the process up (imports, first connections)
        start = time.monotonic()
        results = prober.probe_all(targets)
        elapsed = time.monotonic() - start
        with Prober(timeout_s, api_key="wrong") as wrong_key:
            assert wrong_key.probe_all({"ok-0": targets["ok-0"]})["ok-0"].error == "HTTP 401"
    # One at a time this would be 10 hangs x 1 s + 70 x 50 ms = 13.5 s.
    assert elapsed < timeout_s + 1.0, f"cycle took {elapsed:.2f} s"
    assert {n for n, r in results.items() if r.ok} == {n for n in targets if n.startswith("ok-")}
    assert all(r.error == "HTTP 503" for n, r in results.items() if n.startswith("fail-"))
    assert all(r.error.startswith("timeout") and r.latency_s >= timeout_s
               for n, r in results.items() if n.startswith("hang-"))
    assert results["refused-0"].error.startswith("ClientConnectorError")
    assert all(0.05 <= r.latency_s < timeout_s for n, r in results.items() if n.startswith("ok-"))


def test_verdict_only_after_threshold_consecutive_failures() -> None:
    tracker = HealthTracker(failure_threshold=3, first_wait_s=0)
    tracker.started("e", now=0)
    assert tracker.record({"e": BAD}, now=1) == []
    assert tracker.record({"e": BAD}, now=2) == []
    assert tracker.record({"e": OK}, now=3) == []  # a success clears the count
    assert tracker.record({"e": BAD}, now=4) == []
    assert tracker.record({"e": BAD}, now=5) == []
    assert tracker.record({"e": BAD}, now=6) == ["e"]
    assert tracker.failures("e") == 3


def test_first_wait_gives_no_verdict_until_it_ends_or_the_engine_answers() -> None:
    tracker = HealthTracker(failure_threshold=1, first_wait_s=30)
    tracker.started("slow", now=100)
    tracker.started("up", now=100)
    for t in (101, 110, 129):
        assert tracker.record({"slow": BAD, "up": BAD if t > 101 else OK}, now=t) == ["up"] * (t > 101)
    assert tracker.in_first_wait("slow", now=129)
    assert tracker.record({"slow": BAD}, now=130) == ["slow"]
    tracker.started("slow", now=200)  # a restart grants a new first-wait and clears the count
    assert tracker.failures("slow") == 0
    assert tracker.record({"slow": BAD}, now=201) == []


def test_kill_budget_caps_kills_per_interval_and_ignores_dead_engines() -> None:
    budget = KillBudget(max_fraction=0.1, interval_s=60)
    failed = [f"e{i}" for i in range(30)]
    # 100 engines: at most 10 in a window; e0 and e1 died (replaced regardless, not counted).
    first = budget.allow(failed, dead={"e0", "e1"}, total_engines=100, now=0)
    assert first == [f"e{i}" for i in range(2, 12)]
    assert budget.allow(failed[12:], dead=set(), total_engines=100, now=30) == []
    assert budget.allow(failed[12:], dead=set(), total_engines=100, now=60) == [f"e{i}" for i in range(12, 22)]


def test_kill_budget_always_allows_one() -> None:
    budget = KillBudget(max_fraction=0.1, interval_s=60)
    assert budget.cap(3) == 1
    assert budget.allow(["a", "b"], dead=set(), total_engines=3, now=0) == ["a"]
    assert budget.allow(["b"], dead=set(), total_engines=3, now=1) == []


@pytest.mark.parametrize("fraction", [0, 1.5])
def test_kill_budget_rejects_a_bad_fraction(fraction: float) -> None:
    with pytest.raises(ValueError, match="fraction"):
        KillBudget(fraction, 60)
