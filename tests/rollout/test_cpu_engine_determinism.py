"""--enable-deterministic-inference makes the CPU engine batch-invariant, as SGLang's flag does: a
request gets the same tokens and log-probs to the bit whatever else runs beside it. Without the
flag, one batched forward pass pads every sequence to the batch's shape, which moves its logits
in the last bits (the control below), so a sampled token could flip between two runs of a job."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from tests.rollout.cpu_engine_helpers import EngineProcess, make_tiny_model, wait_until

PROMPT = "repeat: 3 and 9"
OTHERS = ["x", "a much longer prompt than the one we measure, to pad it", "repeat: 1", "7 7 7 7 7 7 7 7 7 7 7"]


def request(text: str) -> dict[str, Any]:
    return {"text": text, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 11, "ignore_eos": True}}


def alone_and_in_company(engine: EngineProcess) -> tuple[list, list]:
    """The measured request's (log-prob, token) pairs alone, then started in one batch with OTHERS."""
    alone = engine.generate(request(PROMPT))["meta_info"]["output_token_logprobs"]
    assert engine.post("/pause_generation", {"mode": "in_place"}).status_code == 200
    results: dict[str, Any] = {}
    threads = [threading.Thread(target=lambda t=text: results.__setitem__(t, engine.generate(request(t))))
               for text in [PROMPT, *OTHERS]]
    for thread in threads:
        thread.start()
    wait_until(lambda: engine.stats()["waiting_requests"] == len(threads), 30, "every request waiting")
    engine.post("/continue_generation", {})
    for thread in threads:
        thread.join(60)
    return alone, results[PROMPT]["meta_info"]["output_token_logprobs"]


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_request_is_the_same_in_any_company_only_when_deterministic(tmp_path: Path, deterministic: bool) -> None:
    model = make_tiny_model(tmp_path / "model")
    flags = ["--enable-deterministic-inference"] if deterministic else []
    engine = EngineProcess(model, tmp_path / "engine.log", extra=flags)
    try:
        engine.wait_ready()
        assert engine.get("/server_info").json()["enable_deterministic_inference"] is deterministic
        alone, in_company = alone_and_in_company(engine)
    finally:
        engine.stop()
    if deterministic:
        assert alone == in_company
    else:  # the control: batching alone moves the log-probs (and, rarely, a sampled token)
        assert alone != in_company
