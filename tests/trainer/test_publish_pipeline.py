"""The nccl transport's pipelining, seen from the trainer: every broadcast of a bucket queued before
any is waited on, the next bucket queued before the previous one is waited on (two in flight at
most), buckets taking turns on two lanes (update groups), and each engine holding the next bucket's
request while it takes one, one per lane at a time, the last (versioned) one only once every other
was answered. A recording group and engine stand in for the wire; tests/trainer/test_publish.py
checks the same transport against real engines over gloo."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout.weight_group import WeightSyncError, create_group, flatten, parse_dtype, unflatten
from tests.ports import free_port
from trainer.publish import LANES, WeightPublisher, _Group

# Seconds an engine's first answer may wait for the trainer to ask for the second bucket.
QUEUE_WAIT_S = 10.0
ENGINES = ("http://127.0.0.1:1", "http://127.0.0.1:2")


class RecordingGroup:
    """Records ('start', bucket, tensors queued, lane) and ('wait', bucket) in order, in `events` (shared by
    the lanes)."""

    backend = "gloo"

    def __init__(self, name: str = "recorded", events: list[tuple[Any, ...]] | None = None) -> None:
        self.name = name
        self.events = [] if events is None else events
        self.second_bucket_queued = threading.Event()

    def start_all(self, tensors: list[torch.Tensor]) -> list[int]:
        bucket = sum(event[0] == "start" for event in self.events)
        self.events.append(("start", bucket, len(tensors), self.name))
        if bucket == 1:
            self.second_bucket_queued.set()
        return [bucket] * len(tensors)

    def wait(self, works: list[int], abandon=None, grace_s: float = 0.0) -> None:
        self.events.append(("wait", works[0]))

    def close(self) -> None:
        pass


FORMATS = [
    ("0.5.15.post1", 1, "flattened_bucket"),  # one broadcast per bucket (the tensors packed into one)
    (None, 1, "flattened_bucket"),  # the stand-in engines give no SGLang version
    ("0.5.5", 2, None),  # an SGLang older than flattened buckets: one broadcast per tensor
]


@pytest.mark.parametrize(("sglang_version", "per_bucket", "load_format"), FORMATS)
def test_buckets_are_queued_ahead_and_each_engine_of_a_group_of_several_gets_them_in_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sglang_version: str | None, per_bucket: int,
        load_format: str | None) -> None:
    """Several engines share one lane (trainer/publish.py: LANES): each gets a bucket's request once it answered
    the one before, while the trainer queues the next bucket without waiting for the answers."""
    publisher = WeightPublisher("nccl", tmp_path, tmp_path, None, bucket_bytes=64, backend="gloo")
    group = RecordingGroup()
    calls: dict[str, list[tuple[str, str]]] = {url: [] for url in ENGINES}
    formats: list[str | None] = []
    lock = threading.Lock()

    def call(url: str, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        if route == "/server_info":
            return {"tp_size": 1, "version": sglang_version}
        assert body is not None
        with lock:
            calls[url].append(("enter", body["names"][0]))
            formats.append(body.get("load_format"))
        if len(calls[url]) == 1:  # the first bucket is answered only once the second is on its way
            assert group.second_bucket_queued.wait(QUEUE_WAIT_S), "the trainer waited for an answer"
        with lock:
            calls[url].append(("leave", body["names"][0]))
        return {"success": True}

    monkeypatch.setattr(publisher._engines, "call", call)
    for url in ENGINES:
        assert publisher._ask_server_info(url) == 1
    weights = [(f"w{i}", torch.full((8,), float(i))) for i in range(6)]  # 32 bytes each: 3 buckets of 2
    layout = tuple((url, 1) for url in ENGINES)
    taken, nbytes = publisher._send_buckets(3, _Group(layout, (group,)), iter(weights), {})  # type: ignore[arg-type]

    assert taken == list(ENGINES) and nbytes == 6 * 32
    assert group.events == [("start", 0, per_bucket, "recorded"), ("start", 1, per_bucket, "recorded"), ("wait", 0),
                            ("start", 2, per_bucket, "recorded"), ("wait", 1), ("wait", 2)]
    assert formats == [load_format] * 6
    for url in ENGINES:  # one request at a time, in bucket order
        assert calls[url] == [(step, first) for first in ("w0", "w2", "w4") for step in ("enter", "leave")]


@pytest.mark.parametrize(("sglang_version", "per_bucket", "load_format"), FORMATS)
def test_buckets_are_queued_ahead_and_a_single_engine_holds_the_next_request_while_taking_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sglang_version: str | None, per_bucket: int,
        load_format: str | None) -> None:
    publisher = WeightPublisher("nccl", tmp_path, tmp_path, None, bucket_bytes=64, backend="gloo")
    events: list[tuple[Any, ...]] = []
    lanes = tuple(RecordingGroup(f"lane{i}", events) for i in range(LANES))
    engines = ENGINES[:1]  # lanes are for a group of one engine (trainer/publish.py: LANES)
    calls: dict[str, list[tuple[str, str, str]]] = {url: [] for url in engines}
    second_asked = {url: threading.Event() for url in engines}
    formats: list[str | None] = []
    lock = threading.Lock()

    def call(url: str, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        if route == "/server_info":
            return {"tp_size": 1, "version": sglang_version}
        assert body is not None
        first = body["names"][0]
        with lock:
            calls[url].append(("enter", first, body["group_name"]))
            formats.append(body.get("load_format"))
        if first == "w2":
            second_asked[url].set()
        if first == "w0":  # the first bucket is answered only once the engine holds the second's request
            assert second_asked[url].wait(QUEUE_WAIT_S), "the engine was asked for a bucket only after its answer"
        with lock:
            calls[url].append(("leave", first, body["group_name"]))
        return {"success": True}

    monkeypatch.setattr(publisher._engines, "call", call)
    for url in engines:
        assert publisher._ask_server_info(url) == 1
    weights = [(f"w{i}", torch.full((8,), float(i))) for i in range(8)]  # 32 bytes each: 4 buckets of 2
    layout = tuple((url, 1) for url in engines)
    taken, nbytes = publisher._send_buckets(3, _Group(layout, lanes), iter(weights), {})  # type: ignore[arg-type]

    assert taken == list(engines) and nbytes == 8 * 32
    assert events == [("start", 0, per_bucket, "lane0"), ("start", 1, per_bucket, "lane1"), ("wait", 0),
                      ("start", 2, per_bucket, "lane0"), ("wait", 1),
                      ("wait", 2), ("start", 3, per_bucket, "lane1"), ("wait", 3)]  # the last: after every other
    assert formats == [load_format] * 4
    for url in engines:
        seen = calls[url]
        # bucket k's request on lane k % 2; a lane's next one only after the engine answered its previous one
        assert sorted(seen) == sorted((step, f"w{2 * k}", f"lane{k % 2}") for k in range(4) for step in ("enter", "leave"))
        for lane in ("lane0", "lane1"):
            on_lane = [step for step, _, name in seen if name == lane]
            assert on_lane == ["enter", "leave"] * 2, (lane, seen)
        assert seen.index(("enter", "w2", "lane1")) < seen.index(("leave", "w0", "lane0"))
        last = seen.index(("enter", "w6", "lane1"))  # asked for once every other bucket was answered
        assert all(seen.index(("leave", f"w{2 * k}", f"lane{k % 2}")) < last for k in range(3))


def test_a_flattened_bucket_is_packed_with_every_tensor_aligned_for_its_view(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixed dtypes in one bucket (SGLang's uint8 FlattenedTensorBucket takes them): the bucket goes in
    falling element size, so each tensor starts at a multiple of its element size, and the one
    buffer sent holds exactly the bytes the engine views back (bit for bit)."""
    publisher = WeightPublisher("nccl", tmp_path, tmp_path, None, bucket_bytes=1024, backend="gloo")
    group = RecordingGroup()
    sent: list[torch.Tensor] = []
    bodies: list[dict[str, Any]] = []
    monkeypatch.setattr(group, "start_all", lambda tensors: sent.extend(tensors) or [0])
    monkeypatch.setattr(publisher._engines, "call", lambda url, route, body=None: bodies.append(body) or {})
    weights = [("odd_bf16", torch.randn(3).bfloat16()), ("f32", torch.randn(2, 3)),
               ("f64", torch.tensor(2.5, dtype=torch.float64)), ("f16", torch.randn(5).half()),
               ("empty", torch.empty(0, 4))]
    publisher._send_buckets(1, _Group(((ENGINES[0], 1),), (group,)), iter(weights), {})  # type: ignore[arg-type]

    assert len(sent) == 1 and sent[0].dtype == torch.uint8
    body = bodies[0]
    assert body["load_format"] == "flattened_bucket" and body["names"] == ["f64", "f32", "empty", "odd_bf16", "f16"]
    views = unflatten(sent[0], [parse_dtype(d) for d in body["dtypes"]], body["shapes"])
    by_name = dict(weights)
    for name, view in zip(body["names"], views):
        assert view.dtype == by_name[name].dtype and torch.equal(view, by_name[name]), name
    with pytest.raises(WeightSyncError, match="starts at byte 6"):  # SGLang's views need the order above
        unflatten(flatten([by_name["odd_bf16"], by_name["f32"]], torch.device("cpu")), [torch.bfloat16, torch.float32],
                  [[3], [2, 3]])


def test_a_kept_group_asks_no_sizes_and_the_version_is_asked_beside_the_end(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Each engine call of a publish is a round trip the update waits for: a publish to the engines of the group
    already formed asks no /server_info again, and each engine's /model_info (the version rode on the last
    bucket) is asked while its /end_weight_update is still unanswered."""
    publisher = WeightPublisher("nccl", tmp_path, tmp_path, None, bucket_bytes=64, backend="gloo")
    monkeypatch.setattr(publisher, "_build_group", lambda layout, dropped, launches: _Group(layout, (RecordingGroup(),)))
    routes: list[tuple[str, str]] = []
    served: dict[str, str | None] = {url: None for url in ENGINES}
    version_asked = {url: threading.Event() for url in ENGINES}
    lock = threading.Lock()

    def call(url: str, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        with lock:
            routes.append((url, route))
        if route == "/server_info":
            return {"tp_size": 1}
        if route == "/model_info":
            version_asked[url].set()
            return {"weight_version": served[url]}
        if route == "/end_weight_update":
            assert version_asked[url].wait(QUEUE_WAIT_S), "the version was asked only after the end"
        if route == "/update_weights_from_distributed" and body and body["weight_version"] is not None:
            served[url] = body["weight_version"]
        return {"success": True}

    monkeypatch.setattr(publisher._engines, "call", call)
    weights = [(f"w{i}", torch.full((8,), float(i))) for i in range(4)]
    for version in (1, 2):
        for event in version_asked.values():
            event.clear()
        routes.clear()
        result = publisher.publish(version, list(ENGINES), iter(weights))
        assert result.updated == list(ENGINES) and not result.dropped, result
        asked = sorted(route for _, route in routes)
        assert asked.count("/model_info") == 2 and asked.count("/end_weight_update") == 2
        assert asked.count("/server_info") == (2 if version == 1 else 0), f"publish {version}: {asked}"


ABANDON_GRACE_S = 0.2  # how long the wait below goes on once told a member will not take part
GROUP_TIMEOUT_S = 30.0


def test_a_broadcast_wait_is_abandoned_once_a_member_will_not_take_part() -> None:
    """UpdateGroup.wait asks `abandon` while a broadcast is incomplete: once it gives a reason (an engine
    answered its bucket's request with a failure) and the grace passed, it raises with that reason
    instead of waiting out the group's timeout. Here rank 1 joins but never receives, and the bucket is
    larger than the sockets' buffers, so the send cannot complete."""
    port = free_port()
    joined: dict[str, Any] = {}
    member = threading.Thread(target=lambda: joined.setdefault(
        "group", create_group("127.0.0.1", port, 1, 2, "abandon", GROUP_TIMEOUT_S)))
    member.start()
    group = create_group("127.0.0.1", port, 0, 2, "abandon", GROUP_TIMEOUT_S)
    member.join(GROUP_TIMEOUT_S)
    told: list[float] = []

    def abandon() -> str | None:
        if not told:
            told.append(time.monotonic())
            return None  # asked while waiting: the member fails only from the second look on
        return "engine-1 refused its bucket"

    try:
        work = group.start_all([torch.zeros(64 * 2**20, dtype=torch.uint8)])
        with pytest.raises(RuntimeError, match="engine-1 refused its bucket"):
            group.wait(work, abandon, ABANDON_GRACE_S)
        assert ABANDON_GRACE_S <= time.monotonic() - told[0] < GROUP_TIMEOUT_S / 3
        assert not work[0].is_completed()
    finally:  # the member first: gloo's shutdown of the sender waits out a send still pending
        joined["group"].close()
        del work
        group.close()
