"""The CPU engine's background bucket loads (rollout/cpu_engine/weight_routes.py BucketLoads): a
bucket is answered once received and checked, and loaded behind the ones before it, in order,
while the next is received; the first failure stops the later loads and is what settle() reports
(to the versioned last bucket, or /end_weight_update)."""

from __future__ import annotations

import asyncio

from rollout.cpu_engine.weight_routes import BucketLoads
from rollout.cpu_engine.weights import WeightError

# Seconds any step of these tests may take before it counts as stuck.
STEP_S = 10.0


def test_loads_run_in_order_behind_the_caller_and_settle_waits_for_them() -> None:
    async def scenario() -> list[str]:
        loads, done, first_may_finish = BucketLoads(), [], asyncio.Event()

        async def load(tag: str, gate: asyncio.Event | None = None) -> None:
            if gate is not None:
                await asyncio.wait_for(gate.wait(), STEP_S)
            done.append(tag)

        loads.add(lambda: load("bucket 0", first_may_finish))
        loads.add(lambda: load("bucket 1"))  # added while bucket 0 still loads: the caller goes on
        await asyncio.sleep(0)  # let the loads start: bucket 1 must still wait for bucket 0
        assert done == []
        first_may_finish.set()
        assert await asyncio.wait_for(loads.settle(), STEP_S) is None
        return done

    assert asyncio.run(scenario()) == ["bucket 0", "bucket 1"]


def test_the_first_failure_stops_later_loads_and_is_reported_once() -> None:
    async def scenario() -> tuple[str | None, str | None, list[str]]:
        loads, done = BucketLoads(), []

        async def fail() -> None:
            raise WeightError("tensor x has shape [2], the model needs [3]")

        async def load(tag: str) -> None:
            done.append(tag)

        loads.add(lambda: load("bucket 0"))
        loads.add(fail)
        loads.add(lambda: load("bucket 2"))
        first = await asyncio.wait_for(loads.settle(), STEP_S)
        return first, await loads.settle(), done  # settled: the next update starts afresh

    first, again, done = asyncio.run(scenario())
    assert first is not None and "needs [3]" in first and again is None and done == ["bucket 0"]
