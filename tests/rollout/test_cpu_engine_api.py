"""Contract tests of the CPU engine (shared/reference/sglang-http.md): health, generate, info,
pause/continue, abort, cache, auth, error shapes and batching. One engine serves the module."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.rollout.cpu_engine_helpers import (
    EngineProcess,
    make_tiny_model,
    served_lines,
    wait_until,
)

API_KEY = "test-key-3f9a"
# Every route but /health and /health_generate, which SGLang (and so the router's probe) leave open.
ROUTES = [("GET", "/ping"), ("GET", "/ready"), ("POST", "/generate"), ("GET", "/model_info"), ("GET", "/get_model_info"), ("GET", "/server_info"),
          ("GET", "/get_server_info"), ("GET", "/flush_cache"), ("POST", "/flush_cache"),
          ("POST", "/update_weights_from_disk"), ("POST", "/init_weights_update_group"),
          ("POST", "/begin_weight_update"), ("POST", "/update_weights_from_distributed"),
          ("POST", "/end_weight_update"), ("POST", "/destroy_weights_update_group"),
          ("POST", "/update_weight_version"), ("POST", "/pause_generation"), ("POST", "/continue_generation"),
          ("POST", "/abort_request"), ("POST", "/get_weights_by_name")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    # A short health timeout so that the paused-engine probe answers 503 quickly.
    proc = EngineProcess(model_dir, tmp_path_factory.mktemp("log") / "engine.log", api_key=API_KEY,
                         extra=["--tp-size", "1", "--mem-fraction-static", "0.8"],
                         env={"SGLANG_HEALTH_CHECK_TIMEOUT": "2"})
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[Any, Any]:
    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(autouse=True)
def unpaused(engine: EngineProcess) -> Iterator[None]:
    """Every test starts and ends with generation running, whatever it asserted."""
    yield
    engine.post("/continue_generation", {})


def in_thread(fn, *args) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        box["result"] = fn(*args)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def greedy(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, **extra}


# ---- auth, health, info ----

@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_every_route_needs_the_api_key(engine: EngineProcess, method: str, path: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = requests.request(method, engine.url + path, json={}, headers=headers, timeout=30)
        assert response.status_code == 401
        assert response.json() == {"error": "Unauthorized"}


def test_health_answers_without_the_key(engine: EngineProcess) -> None:
    for path in ("/health", "/health_generate"):
        assert requests.get(engine.url + path, timeout=30).status_code == 200


def test_health_ping_ready_when_up(engine: EngineProcess) -> None:
    for path in ("/health", "/health_generate", "/ping", "/ready"):
        response = engine.get(path)
        assert response.status_code == 200, path
        assert response.content == b""


def test_model_info_and_old_name(engine: EngineProcess, model_dir: Path) -> None:
    info = engine.get("/model_info").json()
    assert info == {"model_path": str(model_dir), "served_model_name": str(model_dir),
                    "tokenizer_path": str(model_dir), "is_generation": True,
                    "weight_version": "default", "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    assert engine.get("/get_model_info").json() == info


def test_server_info_is_flat_args_plus_version_without_the_key(engine: EngineProcess) -> None:
    response = engine.get("/server_info")
    info = response.json()
    assert info["port"] == engine.port and info["host"] == "127.0.0.1"
    assert info["tp_size"] == 1 and info["mem_fraction_static"] == 0.8  # accepted, no effect on CPU
    assert isinstance(info["version"], str) and info["version"]
    assert "api_key" not in info and API_KEY not in response.text
    assert set(engine.get("/get_server_info").json()) == set(info)


# ---- generate ----

def test_generate_single_text(engine: EngineProcess, reference: tuple[Any, Any]) -> None:
    _, tokenizer = reference
    out = engine.generate({"text": "repeat: 7", "rid": "single-1", "sampling_params": greedy(6)})
    assert isinstance(out, dict) and set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["id"] == "single-1"
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(tokenizer.encode("repeat: 7"))
    assert meta["completion_tokens"] == len(out["output_ids"]) == 6
    assert meta["cached_tokens"] == 0 and meta["weight_version"] == "default" and meta["e2e_latency"] > 0
    assert "output_token_logprobs" not in meta
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)


def test_generate_input_ids_batch_with_n(engine: EngineProcess) -> None:
    body = {"input_ids": [[5, 20, 30], [7, 8]], "rid": "grp",
            "sampling_params": {"max_new_tokens": 8, "n": 3, "sampling_seed": 11, "ignore_eos": True}}
    outs = engine.generate(body)
    assert isinstance(outs, list) and len(outs) == 6
    assert [o["meta_info"]["id"] for o in outs] == [f"grp_{k}" for k in range(6)]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [3, 3, 3, 2, 2, 2]  # prompt-major order
    assert len({tuple(o["output_ids"]) for o in outs[:3]}) == 3  # the n samples differ
    # Copy j of n samples with sampling_seed + j, so any one of them can be reproduced alone.
    alone = engine.generate({"input_ids": [5, 20, 30],
                             "sampling_params": {"max_new_tokens": 8, "sampling_seed": 12, "ignore_eos": True}})
    assert alone["output_ids"] == outs[1]["output_ids"]


def test_generate_text_batch_is_a_list_and_keeps_order(engine: EngineProcess) -> None:
    prompts = ["repeat: 1", "user", "abc def"]
    outs = engine.generate({"text": prompts, "sampling_params": greedy(5)})
    singles = [engine.generate({"text": p, "sampling_params": greedy(5)}) for p in prompts]
    assert [o["output_ids"] for o in outs] == [s["output_ids"] for s in singles]
    per_item = engine.generate({"text": prompts[:2], "sampling_params": [greedy(2), greedy(4)]})
    assert [o["meta_info"]["completion_tokens"] for o in per_item] == [2, 4]


def test_sampling_seed_reproduces(engine: EngineProcess) -> None:
    def sample(seed: int) -> list[int]:
        return engine.generate({"text": "repeat: 42", "sampling_params": {
            "max_new_tokens": 16, "temperature": 1.0, "sampling_seed": seed, "ignore_eos": True}})["output_ids"]

    first = sample(123)
    assert sample(123) == first
    assert sample(124) != first


def _reference_logprobs(model: Any, prompt: list[int], output: list[int], temperature: float) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return [float(logprobs[i, t]) for i, t in enumerate(output)]


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_logprobs_match_a_direct_forward(engine: EngineProcess, reference: tuple[Any, Any],
                                         temperature: float) -> None:
    model, tokenizer = reference
    prompt = tokenizer.encode("repeat: 3 and 9")
    out = engine.generate({"input_ids": prompt, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 24, "temperature": temperature, "sampling_seed": 5, "ignore_eos": True}})
    pairs = out["meta_info"]["output_token_logprobs"]
    assert [p[1] for p in pairs] == out["output_ids"] and all(p[2] is None for p in pairs)
    expected = _reference_logprobs(model, prompt, out["output_ids"], temperature or 1.0)
    assert [p[0] for p in pairs] == pytest.approx(expected, abs=1e-4)
    if temperature == 0.0:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out["output_ids"]])).logits[0, len(prompt) - 1:-1]
        assert logits.argmax(-1).tolist() == out["output_ids"]


def test_top_logprobs(engine: EngineProcess) -> None:
    out = engine.generate({"text": "abc", "return_logprob": True, "top_logprobs_num": 3,
                           "sampling_params": greedy(4)})
    tops = out["meta_info"]["output_top_logprobs"]
    assert len(tops) == 4 and all(len(step) == 3 for step in tops)
    for step, (logprob, token, _) in zip(tops, out["meta_info"]["output_token_logprobs"]):
        assert step[0][1] == token and step[0][0] == pytest.approx(logprob)  # greedy takes the top one


def test_stop_token_ids_and_trimming(engine: EngineProcess, reference: tuple[Any, Any]) -> None:
    _, tokenizer = reference
    base = engine.generate({"text": "hello", "sampling_params": greedy(12, ignore_eos=True)})["output_ids"]
    eos = {tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
    # A token that is not eos and comes (first) before any eos, so only stop_token_ids stops there.
    k = next(i for i in range(1, len(base)) if base.index(base[i]) == i and not eos & set(base[:i + 1]))
    stop_id = base[k]
    out = engine.generate({"text": "hello", "sampling_params": greedy(12, stop_token_ids=[stop_id])})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["output_ids"] == base[:k + 1]  # the matched token is counted, as in SGLang
    assert out["text"] == tokenizer.decode(base[:k], skip_special_tokens=True)
    kept = engine.generate({"text": "hello", "sampling_params": greedy(12, stop_token_ids=[stop_id],
                                                                     no_stop_trim=True)})
    assert kept["text"] == tokenizer.decode(base[:k + 1], skip_special_tokens=True)
    # ignore_eos disables stop tokens too (SGLang checks both together).
    ignored = engine.generate({"text": "hello", "sampling_params": greedy(12, stop_token_ids=[stop_id],
                                                                        ignore_eos=True)})
    assert ignored["output_ids"] == base


def test_stop_strings(engine: EngineProcess) -> None:
    base = engine.generate({"text": "hello", "sampling_params": greedy(16, ignore_eos=True)})
    stop = base["text"][5:7]
    out = engine.generate({"text": "hello", "sampling_params": greedy(16, ignore_eos=True, stop=[stop, "@@@@"])})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == base["text"][:base["text"].index(stop)]
    assert out["output_ids"] == base["output_ids"][:len(out["output_ids"])]
    kept = engine.generate({"text": "hello", "sampling_params": greedy(16, ignore_eos=True, stop=stop,
                                                                     no_stop_trim=True)})
    assert kept["output_ids"] == out["output_ids"] and stop in kept["text"]


def test_min_new_tokens_holds_back_stop_tokens(engine: EngineProcess) -> None:
    base = engine.generate({"text": "hello", "sampling_params": greedy(8, ignore_eos=True)})["output_ids"]
    first = base[0]
    out = engine.generate({"text": "hello", "sampling_params": greedy(8, stop_token_ids=[first], min_new_tokens=3)})
    assert first not in out["output_ids"][:3]
    assert out["meta_info"]["completion_tokens"] >= 3


def test_max_new_tokens_zero(engine: EngineProcess) -> None:
    out = engine.generate({"text": "x", "sampling_params": {"max_new_tokens": 0}})
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


@pytest.mark.parametrize(("body", "message"), [
    ({"sampling_params": {"max_new_tokens": 4}}, "Either text, input_ids"),
    ({"text": "a", "input_ids": [1]}, "not both"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "a", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": "a", "sampling_params": {"top_k": 0}}, "top_k"),
    ({"text": "a", "sampling_params": {"max_new_tokens": "many"}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"frequency_penalty": 0.5}}, "not supported"),
    ({"input_ids": [1, 100000]}, "token id"),
    ({"input_ids": []}, "empty"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 5000}}, "maximum context length"),
    ({"text": "a", "stream": True}, "stream"),
    ({"text": ["a", "b"], "sampling_params": [{}, {}, {}]}, "sampling_params"),
])
def test_generate_rejects_bad_requests(engine: EngineProcess, body: dict, message: str) -> None:
    response = engine.post("/generate", body)
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def test_unknown_sampling_field_error_shape(engine: EngineProcess) -> None:
    response = engine.post("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2, "bogus": 1}})
    assert response.status_code == 400
    assert response.json()["error"].startswith("unknown field `bogus`")
    ok = engine.post("/generate", {"text": "a", "unknown_top_level": 1, "sampling_params": {"max_new_tokens": 1}})
    assert ok.status_code == 200  # unknown top-level keys are ignored


@pytest.mark.parametrize("route", ["/generate", "/abort_request", "/pause_generation"])
def test_not_json_is_a_400(engine: EngineProcess, route: str) -> None:
    response = requests.post(engine.url + route, data=b"{nope", headers=engine.headers, timeout=30)
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]


def test_not_json_to_a_weight_route_is_a_failed_update(engine: EngineProcess) -> None:
    response = requests.post(engine.url + "/update_weights_from_disk", data=b"[1", headers=engine.headers, timeout=30)
    body = response.json()
    assert response.status_code == 400 and body["success"] is False and "JSON" in body["message"]


def test_every_served_request_is_logged_with_its_weight_version(engine: EngineProcess) -> None:
    engine.generate({"text": "log me", "rid": "logged-1", "sampling_params": {"max_new_tokens": 2}})
    lines = wait_until(lambda: served_lines(engine, "logged-1"), 10, "the served line")
    assert len(lines) == 1 and "weight_version=default" in lines[0] and "completion_tokens=2" in lines[0]


# ---- batching ----

def test_concurrent_requests_share_forward_passes(engine: EngineProcess) -> None:
    body = {"text": "repeat: 5", "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}
    # Deterministic: hold 8 requests back, then let them go together.
    assert engine.post("/pause_generation", {"mode": "in_place"}).status_code == 200
    before = engine.stats()
    threads = [in_thread(engine.generate, body) for _ in range(8)]
    wait_until(lambda: engine.stats()["waiting_requests"] == 8, 30, "8 waiting requests")
    engine.post("/continue_generation", {})
    for thread, _ in threads:
        thread.join(60)
    assert all(box["result"]["meta_info"]["completion_tokens"] == 16 for _, box in threads)
    after = engine.stats()
    assert after["forward_passes"] - before["forward_passes"] == 16  # not 8 * 16
    assert after["max_batch_size"] >= 8
    # Free-running: requests arriving while others decode join between passes.
    before = engine.stats()
    threads = [in_thread(engine.generate, body) for _ in range(8)]
    for thread, _ in threads:
        thread.join(60)
    assert all(box["result"]["meta_info"]["completion_tokens"] == 16 for _, box in threads)
    assert engine.stats()["forward_passes"] - before["forward_passes"] < 8 * 16 // 2


def test_a_request_joins_a_running_batch(engine: EngineProcess) -> None:
    long_body = {"text": "long", "sampling_params": greedy(400, ignore_eos=True)}
    long_thread, long_box = in_thread(engine.generate, long_body)
    wait_until(lambda: engine.stats()["running_requests"] == 1, 30, "the long request to run")
    short = engine.generate({"text": "short", "sampling_params": greedy(4)})
    long_thread.join(60)
    assert long_box["result"]["meta_info"]["finish_reason"]["type"] == "length"
    # The short one started and finished while the long one was still decoding.
    assert short["meta_info"]["e2e_latency"] < long_box["result"]["meta_info"]["e2e_latency"]


# ---- pause, continue, abort, cache ----

def test_pause_in_place_holds_requests_and_fails_health(engine: EngineProcess) -> None:
    assert engine.post("/pause_generation", {"mode": "in_place"}).json() == {
        "message": "Generation paused successfully.", "status": "ok"}
    thread, box = in_thread(engine.generate, {"text": "wait", "sampling_params": {"max_new_tokens": 3}})
    wait_until(lambda: engine.stats()["waiting_requests"] == 1, 30, "the request to wait")
    assert engine.get("/ready").status_code == 503
    assert engine.get("/health").status_code == 503  # after SGLANG_HEALTH_CHECK_TIMEOUT (2 s here)
    assert engine.get("/ping").status_code == 503  # a failed probe marks the server UnHealthy
    assert "result" not in box
    assert engine.post("/continue_generation", {}).json() == {
        "message": "Generation continued successfully.", "status": "ok"}
    thread.join(30)
    assert box["result"]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert engine.get("/health").status_code == 200
    assert engine.get("/ping").status_code == 200 and engine.get("/ready").status_code == 200


def test_pause_abort_ends_running_requests(engine: EngineProcess) -> None:
    thread, box = in_thread(engine.generate, {"text": "go", "sampling_params": greedy(900, ignore_eos=True)})
    start = engine.stats()["generated_tokens"]
    wait_until(lambda: engine.stats()["generated_tokens"] > start + 5, 30, "the request to decode")
    assert engine.post("/pause_generation", {"mode": "abort"}).status_code == 200
    thread.join(30)
    meta = box["result"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and "message" in meta["finish_reason"]
    assert 0 < meta["completion_tokens"] < 900
    later, later_box = in_thread(engine.generate, {"text": "later", "sampling_params": {"max_new_tokens": 2}})
    wait_until(lambda: engine.stats()["waiting_requests"] == 1, 30, "the new request to wait")
    engine.post("/continue_generation", {})
    later.join(30)
    assert later_box["result"]["meta_info"]["finish_reason"]["type"] == "length"


def test_pause_retract_requeues_and_resumes_the_same_sequence(engine: EngineProcess) -> None:
    body = {"text": "retract me", "sampling_params": greedy(300, ignore_eos=True)}
    expected = engine.generate(body)["output_ids"]
    thread, box = in_thread(engine.generate, body)
    start = engine.stats()["generated_tokens"]
    wait_until(lambda: engine.stats()["generated_tokens"] > start + 20, 30, "the request to decode")
    engine.post("/pause_generation", {"mode": "retract"})
    stats = engine.stats()
    assert stats["running_requests"] == 0 and stats["waiting_requests"] == 1
    engine.post("/continue_generation", {})
    thread.join(60)
    # Re-prefilled from prompt + output so far, it continues exactly where it stopped.
    assert box["result"]["output_ids"] == expected


def test_abort_request_by_rid_and_all(engine: EngineProcess) -> None:
    engine.post("/pause_generation", {"mode": "in_place"})
    four = {"max_new_tokens": 4}
    one, one_box = in_thread(engine.generate, {"text": "a", "rid": "abort-me", "sampling_params": four})
    group, group_box = in_thread(engine.generate, {"text": "b", "rid": "grp-x", "sampling_params": {**four, "n": 3}})
    keep, keep_box = in_thread(engine.generate, {"text": "c", "rid": "keep-me", "sampling_params": four})
    wait_until(lambda: engine.stats()["waiting_requests"] == 5, 30, "5 waiting sequences")
    response = engine.post("/abort_request", {"rid": "abort-me"})
    assert response.status_code == 200 and response.content == b""
    one.join(30)
    assert one_box["result"]["meta_info"]["finish_reason"]["type"] == "abort"
    engine.post("/abort_request", {"rid": "grp-x"})  # reaches grp-x_0..2
    group.join(30)
    assert [o["meta_info"]["finish_reason"]["type"] for o in group_box["result"]] == ["abort"] * 3
    assert engine.stats()["waiting_requests"] == 1 and keep.is_alive()
    engine.post("/abort_request", {"abort_all": True})
    keep.join(30)
    assert keep_box["result"]["meta_info"]["finish_reason"]["type"] == "abort"
    bad = engine.post("/abort_request", {})
    assert bad.status_code == 400 and "rid" in bad.json()["error"]["message"]


def test_abort_a_decoding_request_returns_its_partial_output(engine: EngineProcess) -> None:
    thread, box = in_thread(engine.generate, {"text": "go", "rid": "partial", "return_logprob": True,
                                              "sampling_params": greedy(900, ignore_eos=True)})
    start = engine.stats()["generated_tokens"]
    wait_until(lambda: engine.stats()["generated_tokens"] > start + 5, 30, "the request to decode")
    engine.post("/abort_request", {"rid": "partial"})
    thread.join(30)
    out = box["result"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < 900
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])


def test_pause_rejects_an_unknown_mode(engine: EngineProcess) -> None:
    response = engine.post("/pause_generation", {"mode": "sideways"})
    assert response.status_code == 400 and "mode" in response.json()["error"]["message"]
    assert engine.get("/ready").status_code == 200


def test_flush_cache(engine: EngineProcess) -> None:
    assert engine.get("/flush_cache").status_code == 200
    assert engine.post("/flush_cache").status_code == 200
    engine.post("/pause_generation", {"mode": "in_place"})
    thread, _ = in_thread(engine.generate, {"text": "a", "sampling_params": {"max_new_tokens": 1}})
    wait_until(lambda: engine.stats()["waiting_requests"] == 1, 30, "the request to wait")
    busy = engine.post("/flush_cache")
    assert busy.status_code == 400 and busy.headers["content-type"].startswith("text/plain")
    engine.post("/continue_generation", {})
    thread.join(30)
