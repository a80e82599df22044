"""The CPU engine's profiler routes, as SGLang's /start_profile and /stop_profile: a Chrome trace
of exactly num_steps forward steps lands in output_dir by itself; without num_steps /stop_profile
writes it; start_step delays the start; a second start, a stop with none running and fields the
CPU engine cannot honour are refused with a 400 naming them."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout.cpu_engine.scheduler import FORWARD_STEP
from tests.rollout.cpu_engine_helpers import EngineProcess, make_tiny_model, wait_until

PROBE = {"input_ids": [1, 5, 104, 7, 85],
         "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    model = make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    proc = EngineProcess(model, tmp_path_factory.mktemp("log") / "engine.log", extra=["--skip-server-warmup"])
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def trace_events(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def forward_steps(path: Path) -> int:
    return sum(1 for e in trace_events(path) if e.get("name") == FORWARD_STEP and e.get("ph") == "X")


def test_num_steps_writes_a_trace_of_that_many_forward_steps(engine: EngineProcess, tmp_path: Path) -> None:
    out = tmp_path / "profiles" / "engine-0"
    answer = engine.post("/start_profile", {"output_dir": str(out), "num_steps": 3, "activities": ["CPU", "GPU"],
                                            "profile_prefix": "rollout"})
    assert answer.status_code == 200 and answer.text == "Start profiling.\n"
    assert not out.exists() or not list(out.iterdir())  # nothing until the steps ran
    engine.generate(PROBE)  # 12 forward steps, of which the first 3 are profiled
    [trace] = wait_until(lambda: list(out.glob("rollout-*-TP-0.trace.json.gz")), 30, "the trace file")
    assert forward_steps(trace) == 3
    assert any(str(e.get("name", "")).startswith("aten::") for e in trace_events(trace))  # the model's ops
    assert f"profile trace written to {trace}" in engine.log_text()
    # num_steps stopped it: stopping again is an error, and a new start is allowed
    assert engine.post("/stop_profile").status_code == 400


def test_stop_profile_writes_the_trace_without_num_steps(engine: EngineProcess, tmp_path: Path) -> None:
    assert engine.get("/start_profile", json={"output_dir": str(tmp_path)}).status_code == 200
    second = engine.post("/start_profile", {"output_dir": str(tmp_path)})
    assert second.status_code == 400 and "already in progress" in second.json()["error"]["message"]
    engine.generate(PROBE)
    answer = engine.post("/stop_profile")
    assert answer.status_code == 200 and answer.text.startswith("Stop profiling.")
    [trace] = list(tmp_path.glob("*-TP-0.trace.json.gz"))
    assert forward_steps(trace) >= PROBE["sampling_params"]["max_new_tokens"]


def test_start_step_waits_for_that_forward_step(engine: EngineProcess, tmp_path: Path) -> None:
    steps_before = engine.stats()["forward_passes"]
    start = steps_before + 100  # far ahead: the request never reaches it
    assert engine.post("/start_profile", {"output_dir": str(tmp_path), "start_step": start,
                                          "num_steps": 2}).status_code == 200
    engine.generate(PROBE)
    assert engine.post("/stop_profile").status_code == 200  # cancels the waiting start
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("body, message", [
    ({"profile_by_stage": True}, "profile_by_stage is not supported"),
    ({"merge_profiles": True}, "merge_profiles is not supported"),
    ({"activities": ["RPD"]}, "RPD"),
    ({"activities": ["TPU"]}, "activities must be a list"),
    ({"num_steps": 0}, "num_steps must be a positive integer"),
    ({"output_dir_typo": "/tmp"}, "unknown profile field(s) ['output_dir_typo']"),
])
def test_bad_requests_are_refused_by_name(engine: EngineProcess, body: dict[str, Any], message: str) -> None:
    answer = engine.post("/start_profile", body)
    assert answer.status_code == 400 and message in answer.json()["error"]["message"]
    assert engine.post("/stop_profile").status_code == 400  # nothing was started


def test_stop_without_start_is_refused(engine: EngineProcess) -> None:
    answer = engine.post("/stop_profile")
    assert answer.status_code == 400 and "not in progress" in answer.json()["error"]["message"]
