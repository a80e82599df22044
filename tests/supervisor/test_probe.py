"""The failure threshold with first-wait, and the blast-radius cap (the probes themselves:
tests/rollout/test_engine_client.py)."""

from __future__ import annotations

import pytest

from rollout.engine_client import ProbeResult
from supervisor.probe import HealthTracker, KillBudget

OK = ProbeResult(True, 0.01)
BAD = ProbeResult(False, 1.0, "HTTP 503")


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


def test_a_suspect_engine_is_probed_again_one_timeout_after_its_last_probe_began() -> None:
    tracker = HealthTracker(failure_threshold=3, first_wait_s=0)
    tracker.started("e", now=0)
    tracker.started("f", now=0)
    assert tracker.record({"e": OK, "f": OK}, now=1) == []
    assert tracker.next_cycle(began=10, ended=10.1, interval_s=30, timeout_s=5) == 40.1  # all well: the interval
    tracker.record({"e": BAD, "f": OK}, now=2)
    # e is suspect: the next cycle starts when this one's probe timed out (a hang: at once), not 30 s later
    assert tracker.next_cycle(began=10, ended=15, interval_s=30, timeout_s=5) == 15
    assert tracker.next_cycle(began=10, ended=10.1, interval_s=30, timeout_s=5) == 15  # a failure that came at once
    tracker.record({"e": BAD, "f": OK}, now=3)
    assert tracker.record({"e": BAD, "f": OK}, now=4) == ["e"]  # the verdict: no longer suspect, its recovery's
    assert tracker.next_cycle(began=10, ended=10.1, interval_s=30, timeout_s=5) == 40.1
    tracker.started("e", now=5)  # relaunched: clean again
    tracker.record({"e": BAD, "f": OK}, now=6)
    assert tracker.next_cycle(began=10, ended=10.1, interval_s=30, timeout_s=5) == 15
    tracker.record({"e": OK, "f": OK}, now=7)  # answered: cleared
    assert tracker.next_cycle(began=10, ended=10.1, interval_s=30, timeout_s=5) == 40.1


def test_failures_in_the_first_wait_make_no_suspect() -> None:
    tracker = HealthTracker(failure_threshold=3, first_wait_s=60)
    tracker.started("slow", now=0)
    tracker.record({"slow": BAD}, now=1)
    assert tracker.next_cycle(began=10, ended=10.1, interval_s=30, timeout_s=5) == 40.1
