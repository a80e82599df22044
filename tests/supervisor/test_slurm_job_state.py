"""SlurmJob.ending_state, fed squeue's and sacct's answers as the devcluster gave them during a
heterogeneous job's scancel (every component COMPLETING at once, then leaving squeue one by one
while the accounting may still say RUNNING of one), and mixed ones: any component in an ending
state means the job ends; a job squeue answers for but no longer lists has ended; only a squeue
that does not answer, or components that all run, say nothing."""

from __future__ import annotations

import pytest

from supervisor.preemption import SlurmJob


def _job(monkeypatch: pytest.MonkeyPatch, squeue: list[str] | None, sacct: list[str] | None = None) -> SlurmJob:
    job = SlurmJob("7", timeout_s=1)
    monkeypatch.setattr(job, "_squeue", lambda field: squeue)
    monkeypatch.setattr(job, "_sacct_states", lambda: list(sacct or []))
    return job


@pytest.mark.parametrize(("squeue", "sacct", "expected"), [
    (["RUNNING", "RUNNING", "RUNNING"], None, None),
    (None, None, None),  # squeue did not answer: nothing is known
    (["RUNNING", "COMPLETING", "COMPLETING"], None, "completing"),
    (["COMPLETING", "RUNNING"], ["CANCELLED", "RUNNING"], "completing"),
    (["RUNNING", "CANCELLED"], None, "cancelled"),
    (["RUNNING", "TIMEOUT", "NODE_FAIL"], None, "node_fail/timeout"),
    (["PREEMPTED", "RUNNING"], None, "preempted"),
    (["RUNNING", "FAILED"], None, "failed"),
    (["COMPLETING"], ["CANCELLED", "RUNNING"], "cancelled"),  # the accounting lags a component behind
    (["COMPLETING", "COMPLETING"], [], "completing"),  # sacct silent (or no accounting)
    ([], ["CANCELLED", "CANCELLED"], "cancelled"),  # every component left squeue's listing
    ([], [], "ended"),
    (["RUNNING", "SUSPENDED"], None, None),  # suspended, not ending
])
def test_any_component_ending_means_the_job_ends(monkeypatch: pytest.MonkeyPatch, squeue: list[str] | None,
                                                  sacct: list[str] | None, expected: str | None) -> None:
    job = _job(monkeypatch, squeue, sacct)
    assert job.ending_state() == expected
    assert job.ending() is (expected is not None)
