"""Weight updates of the CPU engine: from disk (with refusal and rollback of broken folders), over
a gloo group from this test process acting as trainer rank 0, and the version tag."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rollout.weight_group import create_group, flat_order, flatten
from tests.rollout.cpu_engine_helpers import (
    EngineProcess,
    free_port,
    make_tiny_model,
    served_lines,
    wait_until,
)

PROMPT = [1, 5, 104, 7, 85, 102, 15, 2]
PROBE = {"input_ids": PROMPT, "return_logprob": True,
         "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}}
GROUP_TIMEOUT_S = 5.0  # the engine's --weight-update-group-timeout in these tests


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("models")
    return {seed: make_tiny_model(root / f"seed{seed}", seed=seed) for seed in (0, 1, 2)}


@pytest.fixture(scope="module")
def engine(models: dict[int, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    proc = EngineProcess(models[0], tmp_path_factory.mktemp("log") / "engine.log",
                         extra=["--skip-server-warmup", "--weight-update-group-timeout", str(GROUP_TIMEOUT_S)])
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def restored(engine: EngineProcess, models: dict[int, Path]) -> Iterator[None]:
    """Tests that change weights give the engine its seed-0 weights and version back."""
    yield
    engine.post("/continue_generation", {})
    response = engine.post("/update_weights_from_disk", {"model_path": str(models[0]), "weight_version": "default"})
    assert response.json()["success"], response.text


def probe(engine: EngineProcess) -> dict[str, Any]:
    return engine.generate(PROBE)


def expected_logprobs(model_dir: Path, output: list[int]) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + output])).logits[0, len(PROMPT) - 1:-1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0].tolist()


def in_thread(fn, *args) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(result=fn(*args)), daemon=True)
    thread.start()
    return thread, box


# ---- from disk ----

def test_update_from_disk_changes_outputs_and_version(engine: EngineProcess, models: dict[int, Path],
                                                      restored: None) -> None:
    before = probe(engine)
    response = engine.post("/update_weights_from_disk", {"model_path": str(models[1]), "weight_version": "v1"})
    assert response.status_code == 200
    assert response.json() == {"success": True, "message": "Succeeded to update model weights."}
    info = engine.get("/model_info").json()
    assert info["weight_version"] == "v1" and info["model_path"] == str(models[1])
    after = engine.generate({**PROBE, "rid": "after-disk-update"})
    assert after["meta_info"]["weight_version"] == "v1"
    assert after["output_ids"] != before["output_ids"]
    logprobs = [p[0] for p in after["meta_info"]["output_token_logprobs"]]
    assert logprobs == pytest.approx(expected_logprobs(models[1], after["output_ids"]), abs=1e-4)
    lines = wait_until(lambda: served_lines(engine, "after-disk-update"), 10, "the served line")
    assert "weight_version=v1" in lines[0]


def _broken_copies(models: dict[int, Path], root: Path) -> dict[str, Path]:
    good = models[1]
    truncated = Path(shutil.copytree(good, root / "truncated"))
    data = (good / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    missing = Path(shutil.copytree(good, root / "missing"))
    tensors = load_file(good / "model.safetensors")
    tensors.pop("model.layers.1.mlp.down_proj.weight")
    save_file(tensors, missing / "model.safetensors")
    wrong_shape = Path(shutil.copytree(good, root / "wrong_shape"))
    tensors = load_file(good / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, wrong_shape / "model.safetensors")
    extra = Path(shutil.copytree(good, root / "extra"))
    tensors = load_file(good / "model.safetensors")
    tensors["model.layers.9.mlp.up_proj.weight"] = torch.ones(2, 2)
    save_file(tensors, extra / "model.safetensors")
    empty = root / "empty"
    empty.mkdir()
    return {"truncated": truncated, "missing tensor model.layers.1.mlp.down_proj.weight": missing,
            "model.norm.weight has shape [65]": wrong_shape, "unexpected tensor model.layers.9": extra,
            "no *.safetensors": empty, "not a folder": root / "does-not-exist"}


def test_broken_folders_are_refused_and_old_weights_keep_serving(engine: EngineProcess, models: dict[int, Path],
                                                                 tmp_path: Path) -> None:
    before = probe(engine)
    version = before["meta_info"]["weight_version"]
    for expected, folder in _broken_copies(models, tmp_path).items():
        response = engine.post("/update_weights_from_disk", {"model_path": str(folder), "weight_version": "bad"})
        assert response.status_code == 400, expected
        body = response.json()
        assert body["success"] is False and set(body) == {"success", "message"}
        if expected != "truncated":
            assert expected in body["message"]
        again = probe(engine)
        assert again["output_ids"] == before["output_ids"], expected
        assert again["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
        assert again["meta_info"]["weight_version"] == version
    assert engine.get("/model_info").json()["weight_version"] == version
    missing_path = engine.post("/update_weights_from_disk", {})
    assert missing_path.status_code == 400 and missing_path.json()["success"] is False


def test_update_from_disk_waits_for_in_flight_requests(engine: EngineProcess, models: dict[int, Path],
                                                       restored: None) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 300, "temperature": 0.0, "ignore_eos": True}}
    expected = engine.generate(body)["output_ids"]
    thread, box = in_thread(engine.generate, body)
    start = engine.stats()["generated_tokens"]
    wait_until(lambda: engine.stats()["generated_tokens"] > start + 10, 30, "the request to decode")
    response = engine.post("/update_weights_from_disk", {"model_path": str(models[1]), "weight_version": "v2"})
    assert response.json()["success"] is True
    thread.join(30)
    # The running request finished on the old weights, untouched, before the update applied.
    assert box["result"]["output_ids"] == expected
    assert box["result"]["meta_info"]["weight_version"] == "default"
    assert probe(engine)["meta_info"]["weight_version"] == "v2"


def test_update_from_disk_can_abort_in_flight_requests(engine: EngineProcess, models: dict[int, Path],
                                                       restored: None) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 900, "temperature": 0.0, "ignore_eos": True}}
    thread, box = in_thread(engine.generate, body)
    wait_until(lambda: engine.stats()["running_requests"] == 1, 30, "the request to run")
    response = engine.post("/update_weights_from_disk", {"model_path": str(models[1]), "abort_all_requests": True})
    assert response.json()["success"] is True
    thread.join(30)
    assert box["result"]["meta_info"]["finish_reason"]["type"] == "abort"


def test_paused_engine_updates_without_waiting(engine: EngineProcess, models: dict[int, Path],
                                               restored: None) -> None:
    engine.post("/pause_generation", {"mode": "in_place"})
    thread, box = in_thread(engine.generate, {**PROBE, "rid": "held"})
    wait_until(lambda: engine.stats()["waiting_requests"] == 1, 30, "the request to wait")
    response = engine.post("/update_weights_from_disk", {"model_path": str(models[1]), "weight_version": "v3"})
    assert response.json()["success"] is True
    engine.post("/continue_generation", {})
    thread.join(30)
    assert box["result"]["meta_info"]["weight_version"] == "v3"


# ---- over a gloo group ----

def _trainer_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


def test_a_group_whose_trainer_never_comes_fails_after_the_engines_timeout(engine: EngineProcess) -> None:
    """--weight-update-group-timeout bounds the rendezvous: the call fails within the test client's
    120 s (the 300 s default would outlast it), and the failed group is not kept."""
    init = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
            "group_name": "nobody-comes"}
    for _ in range(2):  # the second try is not refused as "already exists"
        answer = engine.post("/init_weights_update_group", init)
        assert answer.status_code == 400 and answer.json()["success"] is False
        assert "already exists" not in answer.json()["message"]


def test_distributed_update_loads_exactly_the_broadcast_tensors(engine: EngineProcess, models: dict[int, Path],
                                                                restored: None) -> None:
    port = free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "wg", "backend": "nccl"}
    thread, box = in_thread(engine.post, "/init_weights_update_group", init)
    group = create_group("127.0.0.1", port, rank=0, world_size=2, group_name="wg", timeout_s=60)
    try:
        thread.join(60)
        assert box["result"].status_code == 200 and box["result"].json()["success"] is True
        # asked for nccl, a CPU engine joins over gloo (a cuda one over nccl: tests/gpu/test_gpu_engine.py)
        assert "cpu_engine joined weight update group wg backend=gloo rank=1 world_size=2" in engine.log_text()
        tensors = _trainer_tensors(models[2])
        names = list(tensors)
        update = {"names": names, "dtypes": [str(tensors[n].dtype) for n in names],
                  "shapes": [list(tensors[n].shape) for n in names], "group_name": "wg", "weight_version": "v-dist"}

        outside = engine.post("/update_weights_from_distributed", update)
        assert outside.status_code == 400 and "begin_weight_update" in outside.json()["message"]

        assert engine.post("/begin_weight_update", {"selector": "all"}).json()["success"] is True
        thread, box = in_thread(engine.post, "/update_weights_from_distributed", update)
        for name in names:  # the trainer broadcasts each tensor in the order of names
            group.broadcast(tensors[name].clone(), src=0)
        thread.join(60)
        assert box["result"].status_code == 200 and box["result"].json()["success"] is True

        # A wrong name is refused after the broadcast is consumed, and changes nothing.
        bad = {"names": ["model.nope.weight"], "dtypes": ["float32"], "shapes": [[3]], "group_name": "wg"}
        thread, box = in_thread(engine.post, "/update_weights_from_distributed", bad)
        group.broadcast(torch.zeros(3), src=0)
        thread.join(60)
        assert box["result"].status_code == 400 and "unexpected tensor" in box["result"].json()["message"]
        assert engine.post("/end_weight_update", {}).json()["success"] is True

        for name in names:
            got = engine.post("/get_weights_by_name", {"name": name, "truncate_size": 1000}).json()
            assert torch.equal(torch.tensor(got, dtype=tensors[name].dtype), tensors[name]), name
        out = probe(engine)
        assert out["meta_info"]["weight_version"] == "v-dist"
        logprobs = [p[0] for p in out["meta_info"]["output_token_logprobs"]]
        assert logprobs == pytest.approx(expected_logprobs(models[2], out["output_ids"]), abs=1e-4)

        assert engine.post("/destroy_weights_update_group", {"group_name": "wg"}).json()["success"] is True
        assert engine.post("/destroy_weights_update_group", {"group_name": "wg"}).status_code == 400
    finally:
        group.close()


def test_flattened_bucket_is_one_broadcast_of_mixed_dtypes(engine: EngineProcess, models: dict[int, Path],
                                                         restored: None) -> None:
    """load_format "flattened_bucket" (SGLang's FlattenedTensorBucket): the engine receives the whole
    bucket, fp32 and bf16 tensors together, in ONE broadcast of their bytes, and serves them bit for
    bit; an unknown load_format is refused before anything is received."""
    port = free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "flat"}
    thread, box = in_thread(engine.post, "/init_weights_update_group", init)
    group = create_group("127.0.0.1", port, rank=0, world_size=2, group_name="flat", timeout_s=60)
    try:
        thread.join(60)
        assert box["result"].json()["success"] is True
        tensors = _trainer_tensors(models[2])
        mixed = {name: t.bfloat16() if i % 2 else t for i, (name, t) in enumerate(sorted(tensors.items()))}
        names = list(mixed)
        names = [names[i] for i in flat_order([mixed[n].dtype for n in names])]
        update = {"names": names, "dtypes": [str(mixed[n].dtype) for n in names],
                  "shapes": [list(mixed[n].shape) for n in names], "group_name": "flat",
                  "weight_version": "v-flat", "load_format": "flattened_bucket"}
        assert engine.post("/begin_weight_update", {}).json()["success"] is True
        refused = engine.post("/update_weights_from_distributed", {**update, "load_format": "flattened"})
        assert refused.status_code == 400 and "load_format 'flattened' is not supported" in refused.json()["message"]

        thread, box = in_thread(engine.post, "/update_weights_from_distributed", update)
        group.broadcast(flatten([mixed[n] for n in names], torch.device("cpu")), src=0)  # the only broadcast
        thread.join(60)
        answer = box["result"].json()
        assert answer["success"] is True and f"{len(names)} parameters in one broadcast" in answer["message"]
        assert engine.post("/end_weight_update", {}).json()["success"] is True
        for name in names:
            got = engine.post("/get_weights_by_name", {"name": name, "truncate_size": 1000}).json()
            assert torch.equal(torch.tensor(got, dtype=torch.float32), mixed[name].float()), name
        assert probe(engine)["meta_info"]["weight_version"] == "v-flat"
    finally:
        engine.post("/destroy_weights_update_group", {"group_name": "flat"})
        group.close()


def test_weight_update_window_holds_new_requests(engine: EngineProcess) -> None:
    assert engine.post("/begin_weight_update", {}).json()["success"] is True
    again = engine.post("/begin_weight_update", {})
    assert again.status_code == 400 and again.json()["success"] is False
    thread, box = in_thread(engine.generate, {**PROBE, "rid": "held-by-update"})
    wait_until(lambda: engine.stats()["waiting_requests"] == 1, 30, "the request to wait")
    assert engine.get("/health").status_code == 200  # the engine's own probe is not held back
    assert "result" not in box
    assert engine.post("/end_weight_update", {}).json()["success"] is True
    thread.join(30)
    assert box["result"]["meta_info"]["finish_reason"]["type"] == "length"
    assert engine.post("/end_weight_update", {}).status_code == 400


@pytest.mark.parametrize(("route", "body", "message"), [
    ("/init_weights_update_group", {"master_address": "127.0.0.1"}, "master_port"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": [], "shapes": []}, "begin_weight_update"),
    ("/destroy_weights_update_group", {"group_name": "never"}, "no group"),
    ("/update_weight_version", {}, "new_version"),
    ("/begin_weight_update", {"selector": "some"}, "selector"),
])
def test_weight_route_errors(engine: EngineProcess, route: str, body: dict, message: str) -> None:
    response = engine.post(route, body)
    assert response.status_code == 400
    assert response.json()["success"] is False and message in response.json()["message"]


# ---- version tag ----

def test_update_weight_version(engine: EngineProcess, restored: None) -> None:
    before = probe(engine)
    response = engine.post("/update_weight_version", {"new_version": "v7"})
    assert response.status_code == 200
    assert response.json() == {"success": True, "message": "Weight version updated to v7", "new_version": "v7"}
    assert engine.get("/model_info").json()["weight_version"] == "v7"
    after = probe(engine)
    assert after["meta_info"]["weight_version"] == "v7" and after["output_ids"] == before["output_ids"]


def test_update_weight_version_aborts_in_flight_requests_by_default(engine: EngineProcess, restored: None) -> None:
    thread, box = in_thread(engine.generate, {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 900, "ignore_eos": True}})
    wait_until(lambda: engine.stats()["running_requests"] == 1, 30, "the request to run")
    assert engine.post("/update_weight_version", {"new_version": "v8"}).json()["success"] is True
    thread.join(30)
    assert box["result"]["meta_info"]["finish_reason"]["type"] == "abort"


def test_get_weights_by_name_rejects_unknown_names(engine: EngineProcess) -> None:
    response = engine.post("/get_weights_by_name", {"name": "model.nope"})
    assert response.status_code == 400 and "model.nope" in response.json()["error"]["message"]
