"""The nccl transport's pipelining, seen from the trainer: every broadcast of a bucket queued before
any is waited on, the next bucket queued before the previous one is waited on (two in flight at
most), and each engine asked for its buckets one at a time, in order, without the trainer waiting
for its answers. A recording group and engine stand in for the wire; tests/trainer/test_publish.py
checks the same transport against real engines over gloo."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.publish import WeightPublisher, _Group

# Seconds an engine's first answer may wait for the trainer to queue the second bucket.
QUEUE_WAIT_S = 10.0
ENGINES = ("http://127.0.0.1:1", "http://127.0.0.1:2")


class RecordingGroup:
    """Records ('start', bucket, tensors queued) and ('wait', bucket) in order."""

    name = "recorded"

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.second_bucket_queued = threading.Event()

    def start_all(self, tensors: list[torch.Tensor]) -> list[int]:
        bucket = sum(event[0] == "start" for event in self.events)
        self.events.append(("start", bucket, len(tensors)))
        if bucket == 1:
            self.second_bucket_queued.set()
        return [bucket] * len(tensors)

    def wait(self, works: list[int]) -> None:
        self.events.append(("wait", works[0]))

    def close(self) -> None:
        pass


def test_buckets_are_queued_ahead_and_each_engine_gets_them_in_order(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    publisher = WeightPublisher("nccl", tmp_path, tmp_path, None, bucket_bytes=64, backend="gloo")
    group = RecordingGroup()
    calls: dict[str, list[tuple[str, str]]] = {url: [] for url in ENGINES}
    lock = threading.Lock()

    def call(url: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
        with lock:
            calls[url].append(("enter", body["names"][0]))
        if len(calls[url]) == 1:  # the first bucket is answered only once the second is on its way
            assert group.second_bucket_queued.wait(QUEUE_WAIT_S), "the trainer waited for an answer"
        with lock:
            calls[url].append(("leave", body["names"][0]))
        return {"success": True}

    monkeypatch.setattr(publisher._engines, "call", call)
    weights = [(f"w{i}", torch.full((8,), float(i))) for i in range(6)]  # 32 bytes each: 3 buckets of 2
    layout = tuple((url, 1) for url in ENGINES)
    taken, nbytes = publisher._send_buckets(3, _Group(layout, group, "gloo"), iter(weights), {})  # type: ignore[arg-type]

    assert taken == list(ENGINES) and nbytes == 6 * 32
    assert group.events == [("start", 0, 2), ("start", 1, 2), ("wait", 0), ("start", 2, 2), ("wait", 1),
                            ("wait", 2)]
    for url in ENGINES:  # one request at a time, in bucket order
        assert calls[url] == [(step, first) for first in ("w0", "w2", "w4") for step in ("enter", "leave")]
