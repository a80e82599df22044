"""Tensors by reference (rollout/tensor_handles.py), on the CPU: another process, not forked from
the sender, maps the sender's shared memory (what it writes, the sender sees), and a payload that
names anything but tensors runs nothing; a flattened bucket (SGLang's form: one tensor, each name's
place in it) gives back its tensors exactly. The stand-in engine's /update_weights_from_tensor
takes both forms and keeps SGLang's rules: only inside /begin_weight_update ... /end_weight_update, and a bad payload
changes no weight. The publish over it: tests/trainer/test_publish.py; on a GPU (CUDA IPC):
tests/gpu/test_gpu_tensor_publish.py."""

from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from rollout.tensor_handles import (
    TensorHandleError,
    _map_cpu,
    deserialize,
    flattened_bucket,
    reconstruct,
    serialize,
    shared_buffer,
)
from rollout.tiny_model import vocabulary
from rollout.weight_group import unflatten
from tests.rollout.cpu_engine_helpers import REPO, EngineProcess, make_tiny_model

CHILD_S = 60


def test_another_process_maps_the_senders_memory() -> None:
    """...with no daemon and nothing in /dev/shm."""
    before = set(os.listdir("/dev/shm"))
    with shared_buffer(4 * 6 + 2 * 3, torch.device("cpu")) as flat:
        weight, bias = unflatten(flat, [torch.float32, torch.bfloat16], [[2, 3], [3]])
        weight.copy_(torch.arange(6, dtype=torch.float32).reshape(2, 3))
        bias.copy_(torch.tensor([0.5, 1.5, 2.5]))
        code = ("import sys; from rollout.tensor_handles import deserialize\n"
                "named = dict(deserialize(sys.stdin.read()))\n"
                "print(named['w'].tolist(), named['b'].float().tolist())\n"
                "named['w'].add_(100)  # the sender's memory\n")
        done = subprocess.run([sys.executable, "-c", code], input=serialize([("w", weight), ("b", bias)]), text=True,
                              capture_output=True, timeout=CHILD_S, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, done.stderr
        assert done.stdout.split("\n")[0] == "[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] [0.5, 1.5, 2.5]"
        assert torch.equal(weight, torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100)
    assert set(os.listdir("/dev/shm")) <= before


def test_a_cpu_tensor_outside_a_shared_buffer_is_refused() -> None:
    with pytest.raises(TensorHandleError, match="only as a view of a shared_buffer"):
        serialize([("w", torch.zeros(3))])


def test_a_flattened_bucket_gives_back_its_tensors() -> None:
    """As SGLang's FlattenedTensorBucket: the views of one shared buffer, through the payload, equal the
    tensors, and name their place by SGLang's field names."""
    bf16 = torch.bfloat16
    named = [("a", torch.arange(6, dtype=bf16).reshape(2, 3)), ("empty", torch.empty(0, 2, dtype=bf16)),
             ("b", torch.full((4,), 7.0, dtype=bf16))]
    with shared_buffer(2 * 10, torch.device("cpu")) as flat:
        typed = flat.view(torch.bfloat16)
        torch.cat([t.reshape(-1) for _, t in named], out=typed)
        back = reconstruct(deserialize(serialize(flattened_bucket(named, typed))))
    assert [name for name, _ in back] == ["a", "empty", "b"]
    for (_, want), (_, got) in zip(named, back):
        assert got.dtype == want.dtype and torch.equal(got, want)
    meta = flattened_bucket(named, typed)["metadata"][2]
    assert (meta.start_idx, meta.end_idx, meta.numel, list(meta.shape)) == (6, 10, 4, [4])
    with pytest.raises(TensorHandleError, match="one 1-D tensor of its tensors' one dtype"):
        flattened_bucket(named, torch.zeros(10))


@pytest.mark.parametrize("bucket, message", [
    ({"flattened_tensor": torch.zeros(4)}, "a dict of flattened_tensor and metadata"),
    ({"flattened_tensor": torch.zeros(2, 2), "metadata": []}, "one 1-D tensor"),
    ({"flattened_tensor": torch.zeros(4), "metadata": [SimpleNamespace(name="w", shape=[3])]}, "lacks a field"),
    ({"flattened_tensor": torch.zeros(4), "metadata": [SimpleNamespace(
        name="w", shape=[3], dtype=torch.float32, start_idx=2, end_idx=5, numel=3)]}, "elements 2..5 of 4"),
])
def test_a_flattened_bucket_that_does_not_add_up_is_refused(bucket: dict, message: str) -> None:
    with pytest.raises(TensorHandleError, match=message):
        reconstruct(bucket)


class _RunsCode:
    def __reduce__(self):  # what a hostile payload would carry
        return (os.system, ("echo ran",))


class _MapsAnotherFile:
    def __reduce__(self):  # the CPU form's own rebuild, pointed at a file that is no shared buffer
        return (_map_cpu, ("/etc/hostname", 4, 0, torch.uint8, [4], [1]))


class _LoadsAFile:
    def __reduce__(self):  # torch's own functions can run code too (a pickle loaded by torch.load)
        return (torch.load, ("/no/such/file",))


@pytest.mark.parametrize("payload, message", [
    (base64.b64encode(pickle.dumps(_RunsCode())).decode(), "tensors only, not posix.system"),
    (base64.b64encode(pickle.dumps(_LoadsAFile())).decode(), "tensors only, not torch.serialization.load"),
    (base64.b64encode(pickle.dumps(_MapsAnotherFile())).decode(), "/etc/hostname is not a sender's shared buffer"),
    ("not base64 !", "not tensors by reference"),
    (base64.b64encode(b"no pickle").decode(), "not tensors by reference"),
])
def test_a_payload_of_anything_else_is_refused(payload: str, message: str) -> None:
    with pytest.raises(TensorHandleError, match=message):
        deserialize(payload)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    root = tmp_path_factory.mktemp("tensor_route")
    process = EngineProcess(make_tiny_model(root / "model"), root / "engine.log")
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def _embedding(engine: EngineProcess) -> list:
    return engine.post("/get_weights_by_name", {"name": "model.embed_tokens.weight", "truncate_size": 2}).json()


def test_the_engines_route_keeps_sglangs_rules(engine: EngineProcess) -> None:
    rows = _embedding(engine)
    shape = [len(vocabulary()), len(rows[0])]  # the tiny model's embedding: vocabulary x hidden
    with shared_buffer(4 * shape[0] * shape[1], torch.device("cpu")) as flat:
        _test_the_route(engine, rows, flat.view(torch.float32).view(shape).fill_(0.25))
    assert _embedding(engine) == [[0.25] * len(rows[0])] * 2
    assert engine.get("/model_info").json()["weight_version"] == "7"


def _test_the_route(engine: EngineProcess, rows: list, new: torch.Tensor) -> None:
    body = {"serialized_named_tensors": [serialize([("model.embed_tokens.weight", new)])]}
    outside = engine.post("/update_weights_from_tensor", body)
    assert outside.status_code == 400 and "between /begin_weight_update" in outside.json()["message"]
    assert engine.post("/begin_weight_update", {}).status_code == 200
    try:
        hostile = engine.post("/update_weights_from_tensor", {
            "serialized_named_tensors": [base64.b64encode(pickle.dumps(_RunsCode())).decode()]})
        assert hostile.status_code == 400 and "tensors only" in hostile.json()["message"]
        wrong = engine.post("/update_weights_from_tensor", {
            "serialized_named_tensors": [serialize([("model.no_such.weight", new)])]})
        assert wrong.status_code == 400 and "unexpected tensor model.no_such.weight" in wrong.json()["message"]
        assert _embedding(engine) == rows  # nothing loaded
        flat = new.reshape(-1)  # the same tensor as SGLang's flattened bucket
        bucket = {"serialized_named_tensors": [serialize(flattened_bucket([("model.embed_tokens.weight", new)], flat))],
                  "load_format": "flattened_bucket"}
        short = flattened_bucket([("model.embed_tokens.weight", new)], flat)
        short["metadata"][0].end_idx -= 1
        bad = engine.post("/update_weights_from_tensor", {**bucket, "serialized_named_tensors": [serialize(short)]})
        assert bad.status_code == 400 and "do not hold shape" in bad.json()["message"]
        assert _embedding(engine) == rows  # nothing loaded
        taken = engine.post("/update_weights_from_tensor", {**bucket, "weight_version": "7"})
        assert taken.status_code == 200, taken.text
    finally:
        assert engine.post("/end_weight_update", {}).status_code == 200
