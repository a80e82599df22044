"""The CPU engine's prefill and decode roles behind the real sglang-router in PD mode: a request
runs on one prefill and one decode engine, the decode engine continues from the prefill engine's
first token, and a dead prefill engine fails the request on both sides (so it is retried whole)."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from rollout.request_transport import engine_named_in
from rollout.router_client import RouterClient
from rollout.tiny_model import write_tiny_model
from tests.rollout.cpu_engine_helpers import wait_until
from tests.rollout.servers import API_KEY, Server, engine, pd_engines_behind_router

AUTH = {"Authorization": f"Bearer {API_KEY}"}
SERVED = re.compile(r"cpu_engine served rid=(\S+) weight_version=\S+ prompt_tokens=(\d+) completion_tokens=(\d+)")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def pd(model: Path, tmp_path_factory) -> Iterator[tuple[RouterClient, list[Server], list[Server]]]:
    """One set for the module (three engines start in ~20 s): the last two tests change it."""
    with pd_engines_behind_router(model, tmp_path_factory.mktemp("pd"), prefill=1, decode=2) as trio:
        yield trio


def _generate(url: str, rid: str, max_new_tokens: int = 6, **extra) -> requests.Response:
    body = {"rid": rid, "input_ids": [3, 5, 7, 9], "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True,
                                "sampling_seed": 11}, **extra}
    return requests.post(url + "/generate", json=body, headers=AUTH, timeout=60)


def _served(server: Server) -> dict[str, tuple[int, int]]:
    return {rid: (int(p), int(c)) for rid, p, c in SERVED.findall(server.log.read_text())}


def test_router_lists_each_kind(pd) -> None:
    router, prefills, decodes = pd
    listed = router.session.get(router.url + "/workers", timeout=10).json()
    kinds = {w["url"]: (w["worker_type"], w.get("bootstrap_port")) for w in listed["workers"]}
    info = requests.get(prefills[0].url + "/server_info", headers=AUTH, timeout=10).json()
    assert kinds[prefills[0].url] == ("prefill", info["disaggregation_bootstrap_port"])
    assert {kinds[d.url][0] for d in decodes} == {"decode"}
    assert listed["stats"]["prefill_count"] == 1 and listed["stats"]["decode_count"] == 2


def test_a_request_runs_prefill_then_decode(pd) -> None:
    router, prefills, decodes = pd
    answers = [_generate(router.url, f"pd-{k}") for k in range(4)]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    for k, answer in enumerate(answers):
        body = answer.json()
        assert len(body["output_ids"]) == 6 and body["meta_info"]["finish_reason"]["type"] == "length"
        assert [t for _, t, _ in body["meta_info"]["output_token_logprobs"]] == body["output_ids"]
        # the prefill engine ran the prompt for the first token only; a decode engine did the rest
        # (an engine logs a request just after answering it: wait for the lines)
        wait_until(lambda: f"pd-{k}" in _served(prefills[0]) and any(f"pd-{k}" in _served(d) for d in decodes),
                   timeout=10, what=f"pd-{k} in the engines' logs")
        assert _served(prefills[0])[f"pd-{k}"] == (4, 1)
        decoded = [_served(d).get(f"pd-{k}") for d in decodes]
        assert sorted(decoded, key=str) == sorted([(4, 6), None], key=str)
    assert all(_served(d) for d in decodes), "round robin over both decode engines"


def test_the_first_token_is_the_prefill_engines(pd, model: Path, tmp_path: Path) -> None:
    """Same seed: the prefill engine's one-token answer is the start of the decoded output, and the
    whole output is what one regular engine samples."""
    router, prefills, _ = pd
    full = _generate(router.url, "whole").json()
    regular = engine(model, tmp_path / "regular.log")
    try:
        alone_regular = _generate(regular.url, "regular").json()
    finally:
        regular.stop()
    assert alone_regular["output_ids"] == full["output_ids"]
    assert [lp for lp, _, _ in alone_regular["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [lp for lp, _, _ in full["meta_info"]["output_token_logprobs"]], abs=1e-5)
    # Straight to the prefill engine with a room nobody fetches: its own one-token answer.
    alone = _generate(prefills[0].url, "alone", bootstrap_host="127.0.0.1", bootstrap_port=1,
                      bootstrap_room=424242).json()
    assert alone["output_ids"] == full["output_ids"][:1]
    assert alone["meta_info"]["output_token_logprobs"][0] == full["meta_info"]["output_token_logprobs"][0]


def test_a_decode_engine_without_its_prefill_fails_the_request(pd) -> None:
    _, _, decodes = pd
    missing = _generate(decodes[0].url, "nobody")  # no bootstrap fields: not a PD request
    assert missing.status_code == 400 and "bootstrap_room" in missing.text
    gone = _generate(decodes[0].url, "gone", bootstrap_host="127.0.0.1", bootstrap_port=1, bootstrap_room=7)
    assert gone.status_code == 500 and "bootstrap server 127.0.0.1:1 is gone" in gone.text


def test_a_weight_version_apart_fails_at_the_decode_side(pd) -> None:
    router, prefills, decodes = pd
    for d in decodes:
        moved = requests.post(d.url + "/update_weight_version", json={"new_version": "2"}, headers=AUTH, timeout=10)
        assert moved.ok, moved.text
    answer = _generate(router.url, "apart")
    assert answer.status_code == 500 and "weight version 1, this decode engine is at 2" in answer.text


def test_a_dead_prefill_engine_fails_the_request_for_a_whole_retry(pd) -> None:
    router, prefills, _ = pd
    os.kill(prefills[0].proc.pid, signal.SIGKILL)
    prefills[0].proc.wait(timeout=30)
    info_port = prefills[0].bootstrap_port
    answer = _generate(router.url, "orphan")
    # Whichever side fails first answers: the router's 502 for the prefill engine (the rollout
    # side reads the dead engine from it and reports it), or the decode engine's 500 when it
    # finds the bootstrap server gone. Both are 5xx: rollout/request_transport.py retries the request whole.
    if answer.status_code == 502:
        assert "prefill_server_error" in answer.text
        assert engine_named_in(answer.text) == prefills[0].url
    else:
        assert answer.status_code == 500 and f"bootstrap server 127.0.0.1:{info_port} is gone" in answer.text


def test_the_rollout_side_reads_the_engine_from_pd_router_errors() -> None:
    """sglang-router 0.3.2's PD errors, as measured (rollout/router_client.py): each names the engine."""
    prefill = ('{"error":{"type":"Bad Gateway","code":"prefill_server_error","message":"Prefill server error: error '
               'sending request for url (http://10.0.0.5:20310/generate). This will cause decode timeout."}}')
    decode = ('{"error":{"type":"Bad Gateway","code":"decode_server_error","message":"Decode server error: error '
              'sending request for url (http://10.0.0.6:20311/generate)"}}')
    assert engine_named_in(prefill) == "http://10.0.0.5:20310"
    assert engine_named_in(decode) == "http://10.0.0.6:20311"
