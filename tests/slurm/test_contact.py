"""Which SLURM client failures mean that slurmctld did not answer (transient: wait for it) and which
are answers (an unknown job id); the waits between asks, bounded by SLURM_OUTAGE_LIMIT_S."""

from __future__ import annotations

import time

from slurm.contact import (
    SLURM_OUTAGE_LIMIT_S,
    SLURM_RETRY_FIRST_S,
    SLURM_RETRY_MAX_S,
    SlurmContact,
    retry_delays,
    slurm_answered,
)


def test_silence_is_told_from_an_answer() -> None:
    assert slurm_answered(0, "")
    assert slurm_answered(1, "scancel: error: Kill job error on job id 12.3: Invalid job id specified")
    assert not slurm_answered(1, "scancel: error: Kill job error on job id 12.3: Socket timed out on send/recv operation")
    assert not slurm_answered(1, b"squeue: error: Unable to contact slurm controller (connect failure)")


def test_a_failure_is_remembered_from_when_it_happened() -> None:
    contact = SlurmContact()
    before = time.monotonic()
    assert not contact.failed_since(before)
    contact.record(answered=True)
    assert not contact.failed_since(before)
    contact.record(answered=False)
    assert contact.failed_since(before) and not contact.failed_since(time.monotonic() + 1)


def test_the_backoff_doubles_to_its_cap_and_covers_the_outage_limit() -> None:
    delays = retry_delays()
    assert delays[:3] == [SLURM_RETRY_FIRST_S, 2 * SLURM_RETRY_FIRST_S, 4 * SLURM_RETRY_FIRST_S]
    assert max(delays) == SLURM_RETRY_MAX_S
    assert SLURM_OUTAGE_LIMIT_S <= sum(delays) < SLURM_OUTAGE_LIMIT_S + SLURM_RETRY_MAX_S
