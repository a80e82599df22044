"""The SLURM client (slurm/client.py) without a cluster: fake SLURM programs on PATH. Every call is
bounded and heard by the outage record; launches are paced by a token bucket and counted against
MaxStepCount (read once from `scontrol show config`); the environment table reads each fact one way."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from slurm import env as slurm_env
from slurm.client import SlurmClient, SlurmUnavailable
from slurm.contact import SlurmContact
from slurm.pacing import (
    LAUNCH_BURST,
    LAUNCH_RATE_PER_S,
    MIN_LAUNCH_RATE_PER_S,
    RATE_RECOVERY_S,
    LaunchPacer,
    StepBudget,
    StepLimitReached,
    rate_limited,
)


def fake(folder: Path, program: str, script: str) -> None:
    path = folder / program
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)


@pytest.fixture
def bin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PATH", str(tmp_path))  # only the fakes: the real SLURM programs are not found
    return tmp_path


def test_every_call_is_bounded_and_heard(bin_dir: Path) -> None:
    fake(bin_dir, "squeue", "exec /bin/sleep 5")
    fake(bin_dir, "scancel", "echo 'scancel: error: Invalid job id specified' >&2; exit 1")
    fake(bin_dir, "sacct", "echo 'sacct: error: Unable to contact slurm controller' >&2; exit 1")
    client = SlurmClient(timeout_s=0.5, contact=SlurmContact())
    began = time.monotonic()
    slow = client.call("squeue", "-h")
    assert slow.timed_out and not slow.answered and time.monotonic() - began < 4
    assert client.contact.failed_since(began)
    after = time.monotonic()
    refused = client.call("scancel", "1.2")
    assert refused.answered and not refused.ok and not client.contact.failed_since(after)  # an answer, not silence
    assert not client.call("sacct", "-j", "1").answered and client.contact.failed_since(after)
    missing = client.call("sinfo")
    assert not missing.answered and "no sinfo here" in missing.why
    with pytest.raises(SlurmUnavailable, match="did not answer within"):
        client.require("squeue", "-h")
    assert client.require("scancel", "1.2", unknown_job_ok=True) == ""
    with pytest.raises(ValueError, match="use launch"):
        client.call("srun", "true")


def test_hostnames_asks_scontrol_only_for_a_list(bin_dir: Path) -> None:
    fake(bin_dir, "scontrol", 'test "$1 $2" = "show hostnames" && printf "n1\\nn2\\nx\\n"')
    client = SlurmClient(contact=SlurmContact())
    assert client.hostnames("n[1-2],x") == ["n1", "n2", "x"]
    assert client.hostnames("gpu7") == ["gpu7"]


def test_launches_count_against_max_step_count_read_once(bin_dir: Path) -> None:
    calls = bin_dir / "calls"
    config = "MaxJobCount             = 10000\\nMaxStepCount            = 3\\n"
    fake(bin_dir, "scontrol", f'echo "$@" >> {calls}; printf "{config}"')
    fake(bin_dir, "srun", "exit 0")
    client = SlurmClient(contact=SlurmContact())
    client.steps.seen(0)  # step 0 is listed already (a predecessor's)
    with open(bin_dir / "log", "ab") as log:
        for _ in range(2):
            assert client.launch(["srun", "--jobid=1", "true"], log).wait(10) == 0
        assert client.steps.launched == 3 and client.steps.limit == 3 and client.steps.nearing_limit
        with pytest.raises(StepLimitReached, match="MaxStepCount \\(3\\)"):
            client.launch(["srun", "--jobid=1", "true"], log)
        assert client.steps.launched == 3
        assert calls.read_text().splitlines() == ["show config"]  # read once
        with pytest.raises(ValueError, match="not an srun"):
            client.launch(["squeue"], log)


def test_max_step_count_defaults_when_slurm_does_not_say() -> None:
    budget = StepBudget(lambda: None)
    assert budget.take() == 1 and budget.limit == 40000


def test_the_pacer_lets_a_burst_through_then_paces_to_its_rate() -> None:
    now = [0.0]
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        now[0] += seconds

    pacer = LaunchPacer(burst=4, rate_per_s=2.0, clock=lambda: now[0], sleep=sleep)
    assert [pacer.acquire() for _ in range(4)] == [0.0] * 4  # the burst
    assert pacer.acquire() == pytest.approx(0.5)  # then one every 1/rate seconds
    assert pacer.acquire() == pytest.approx(0.5)
    now[0] += 10.0  # idle: the bucket refills up to the burst, no more
    assert [pacer.acquire() for _ in range(4)] == [0.0] * 4 and pacer.acquire() == pytest.approx(0.5)
    assert (LAUNCH_BURST, LAUNCH_RATE_PER_S) == (16, 8.0)
    with pytest.raises(ValueError):
        LaunchPacer(burst=0)


def test_the_environment_table_reads_each_fact_one_way() -> None:
    assert slurm_env.restart_count({}) == 0 and slurm_env.restart_count({"SLURM_RESTART_COUNT": "2"}) == 2
    assert slurm_env.job_id({"SLURM_JOBID": "7"}) == "7" and slurm_env.job_id({}) is None
    het = {"SLURM_JOB_NODELIST": "n[0-1]", "SLURM_JOB_NODELIST_HET_GROUP_1": "n2"}
    assert slurm_env.job_nodelist(1, het) == "n2" and slurm_env.job_nodelist(0, het) == "n[0-1]"


def test_max_step_count_is_near_from_nine_tenths_on() -> None:
    budget = StepBudget(lambda: 20)
    for _ in range(17):
        budget.take()
    assert not budget.nearing_limit
    budget.take()
    assert budget.nearing_limit and budget.launched == 18


def test_a_rate_limit_refusal_halves_the_pace_which_comes_back_after_quiet_periods() -> None:
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    pacer = LaunchPacer(burst=4, rate_per_s=2.0, clock=lambda: now[0], sleep=sleep)
    assert pacer.acquire() == 0.0
    assert pacer.refused() == 1.0  # half the pace, and no burst left
    assert pacer.acquire() == pytest.approx(1.0)
    for _ in range(8):
        pacer.refused()
    assert pacer.rate == MIN_LAUNCH_RATE_PER_S  # a floor: launches go on
    now[0] += RATE_RECOVERY_S
    assert pacer.rate == 2 * MIN_LAUNCH_RATE_PER_S
    now[0] += 10 * RATE_RECOVERY_S
    assert pacer.rate == 2.0  # its own again, no more


def test_slurms_rate_limit_answers_are_told_from_others() -> None:
    # src/common/slurm_errno.c: SLURMCTLD_COMMUNICATIONS_BACKOFF (1804) and _HARD_DROP (1805); a
    # client older than 23.02 names neither code.
    for said in ("srun: error: Unable to create step for job 7: Rate limit exceeded, please retry momentarily",
                 "srun: error: Unable to confirm allocation for job 7: Rate limit exceeded, please retry later",
                 "srun: error: Unable to create step for job 7: Unknown error 1804"):
        assert rate_limited(said)
    for said in ("srun: error: Unable to create step for job 7: Requested node configuration is not available",
                 "srun: Job 7 step creation temporarily disabled, retrying (Requested nodes are busy)",
                 "srun: error: Unable to create step for job 7: Unknown error 18040"):
        assert not rate_limited(said)
