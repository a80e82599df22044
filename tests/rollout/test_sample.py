"""slime's Sample spellings: Sample.Status, and the truncated/aborted flags that older plug-ins set."""

from __future__ import annotations

import pytest

from rollout.sample import Sample, Status


@pytest.mark.parametrize(("truncated", "aborted", "status"), [
    (False, False, Status.COMPLETED), (True, False, Status.TRUNCATED), (False, True, Status.ABORTED),
])
def test_flags_set_in_the_seed_docs_order_give_the_status(truncated: bool, aborted: bool, status: Status) -> None:
    sample = Sample(index=0, group_index=0, prompt="p")
    sample.truncated = truncated
    sample.aborted = aborted
    assert sample.status is status and Sample.Status.TRUNCATED is Status.TRUNCATED
    assert (sample.truncated, sample.aborted) == (truncated, aborted)


def test_the_flags_are_not_fields() -> None:
    sample = Sample(index=0, group_index=0, prompt="p", status=Status.TRUNCATED)
    assert "truncated" not in sample.to_dict() and Sample.from_dict(sample.to_dict()).truncated
