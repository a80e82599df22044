"""Faults under the fully asynchronous rollout with the loop's parts (real data buffer, journal and
checkpoints, a fake backend) against three real CPU engines behind the real router, their decode
steps held so groups are mid-generation: an engine killed with groups in flight, then a weight
update that fails on another engine (dropped and killed, as the supervisor does). The groups they
held are generated again on the engine left; every sample id is trained once, none is lost. (The
trainer killed mid-step and a save-now mid-overlap: tests/trainer/test_async_resume.py; all of it in
a real job: tests/integration/test_async_faults.py.)"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from rollout.router_client import RouterClient
from slurm.devcluster.daemons import wait_for
from tests.rollout.servers import API_KEY, Server, engines_behind_router
from tests.trainer.held_engine import HOLD_MS, TOKENS_SEEN_S, model, more_tokens
from tests.trainer.test_async_resume import (
    BATCH,
    ROLLOUTS,
    Backend,
    N,
    final_ledger_ids,
    fully_async,
    handed_out,
    loop,
    run,
)

__all__ = ["model"]  # the module's fixture, shared


@pytest.fixture
def engines(model: Path, tmp_path: Path) -> Iterator[tuple[RouterClient, list[Server]]]:
    (tmp_path / "engines").mkdir()
    with engines_behind_router(model, tmp_path / "engines", count=3,
                               flags=("--decode-step-hold-ms", str(HOLD_MS))) as pair:
        yield pair


def kill(server: Server) -> None:
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait()


def test_an_engine_killed_mid_flight_and_a_failed_weight_update_lose_no_sample(engines, model: Path,
                                                                               tmp_path: Path) -> None:
    router, (victim, failing, survivor) = engines
    dropped: list[str] = []

    def kill_mid_flight() -> None:
        wait_for(more_tokens(victim), TOKENS_SEEN_S, "the victim generating")
        kill(victim)

    def fail_next_update() -> None:
        requests.post(failing.url + "/slurmrl_fault", json={"update": "fail"},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).raise_for_status()

    def drop(url: str) -> None:  # the supervisor: out of the router, its step ended
        dropped.append(url)
        router.remove_worker(url)
        kill(failing)

    backend = Backend(at={1: kill_mid_flight, 2: fail_next_update})
    job_loop = loop(tmp_path, backend, fully_async, model, router, save_interval=100, drop=drop)
    run(job_loop)
    assert dropped == [failing.url], "the engine that failed its update was dropped"
    assert sorted(router.workers()) == [survivor.url]
    trained = [i for ids in backend.ids().values() for i in ids]
    assert sorted(backend.trained) == list(range(ROLLOUTS))
    assert len(trained) == len(set(trained)) == ROLLOUTS * BATCH * N, "none trained twice"
    assert set(trained) | final_ledger_ids(job_loop) == set(range(handed_out(job_loop))), "none lost"
