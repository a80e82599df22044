"""Engines that pass their health probe yet fail the trainer, behind the real sglang-router (the
`cluster` fixture of tests/rollout/conftest.py): one CPU engine of two made to wedge (/generate
never answers) or to answer malformed JSON, through the CPU engine's test-only fault route. The
round completes within a bound, every sample exactly once, the requests that engine held went to
the other one, and the engine was reported by name."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import requests

from rollout.buffer import DataBuffer
from rollout.cpu_engine.faults import MALFORMED, ROUTE, WEDGE
from rollout.data import JsonlDataSource
from rollout.generate import RolloutArgs, generate_rollout
from rollout.request_deadline import ABORT_GRACE_S, DecodeSpeed
from rollout.router_client import RouterClient
from rollout.sample import Status
from tests.rollout.servers import API_KEY, Server

PROMPTS, N, MAX_TOKENS = 8, 2, 8
FLOOR_S, UNOBSERVED_S, CHECK_S = 2.0, 10.0, 3.0  # short bounds, so that the test is fast
# The round's bound: the unobserved deadline, the abort's grace and the check, with room for a
# slow CI machine; today's code waits without end on a wedged engine.
ROUND_BOUND_S = UNOBSERVED_S + ABORT_GRACE_S + CHECK_S + 40


def _set_fault(engine: Server, fault: str | None) -> None:
    response = requests.post(engine.url + ROUTE, json={"generate": fault},
                             headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert response.status_code == 200, response.text


def _buffer(tmp_path: Path) -> DataBuffer:
    data = tmp_path / "toy.jsonl"
    data.write_text("".join(json.dumps({"input": f"repeat: {i}", "label": str(i)}) + "\n" for i in range(PROMPTS)))
    return DataBuffer(JsonlDataSource(data, label_key="label", n_samples_per_prompt=N, seed=3))


def _round_with_a_faulty_engine(model: Path, tmp_path: Path, router: RouterClient, faulty: Server, fault: str,
                                ) -> tuple[list, list[tuple[str, str]], float]:
    reported: list[tuple[str, str]] = []

    def on_unresponsive(url: str, reason: str) -> None:  # as the trainer's: the engine leaves the router
        reported.append((url, reason))
        router.remove_worker(url)

    args = RolloutArgs(hf_checkpoint=str(model), router_url=router.url, api_key=API_KEY, rollout_batch_size=PROMPTS,
                       n_samples_per_prompt=N, rollout_max_response_len=MAX_TOKENS, rm_type="toy",
                       engine_unresponsive_handler=on_unresponsive, engine_check_timeout_s=CHECK_S,
                       decode_speed=DecodeSpeed(floor_s=FLOOR_S, unobserved_s=UNOBSERVED_S))
    _set_fault(faulty, fault)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(groups=generate_rollout(args, 0, _buffer(tmp_path))),
                              daemon=True)
    began = time.monotonic()
    try:
        worker.start()
        worker.join(ROUND_BOUND_S)
        took = time.monotonic() - began
        assert not worker.is_alive(), f"the round did not complete within {ROUND_BOUND_S:.0f} s"
    finally:
        _set_fault(faulty, None)  # a round still waiting on the wedged engine ends now
        worker.join(60)
    assert "groups" in result, "the round failed (its error is in the thread's traceback above)"
    return result["groups"], reported, took


def _check_round(groups: list, healthy: Server) -> None:
    samples = [s for g in groups for s in g]
    assert sorted(s.index for s in samples) == list(range(PROMPTS * N))  # each exactly once
    for s in samples:
        assert s.status in (Status.COMPLETED, Status.TRUNCATED)
        assert 0 < s.response_length == len(s.loss_mask) == len(s.rollout_log_probs) <= MAX_TOKENS
    # The samples the faulty engine held were sent again (attempt 2: rid ...-a2) and served here.
    resent = [line for line in healthy.log.read_text().splitlines()
              if line.startswith("cpu_engine served ") and "-a2 " in line]
    assert resent, "no sample was sent again to the healthy engine"


@pytest.mark.parametrize(("fault", "words"), [(WEDGE, ("deadline", "no answer within")),
                                             (MALFORMED, ("does not parse", "unparseable"))])
def test_a_faulty_engine_is_left_behind_and_reported(cluster, model: Path, tmp_path: Path, fault: str,
                                                     words: tuple[str, str]) -> None:
    router, (faulty, healthy) = cluster
    groups, reported, took = _round_with_a_faulty_engine(model, tmp_path, router, faulty, fault)
    _check_round(groups, healthy)
    assert [url for url, _ in reported] == [faulty.url]
    assert all(word in reported[0][1] for word in words), reported
    assert faulty.served() == 0  # it held requests (or answered them unparseably) and served none
    assert faulty.url not in router.workers()
    print(f"{fault} engine: round of {PROMPTS * N} samples in {took:.1f} s")
