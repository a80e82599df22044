"""One publish's timeline, for the publish benches' --profile: the publisher's engine calls, packing,
serializing, broadcasts queued and waited, each as a span (start, end, thread) from the publish's start,
so what runs in turn and what overlaps can be read off. The functions are wrapped only while the block
runs; nothing in trainer/ or rollout/ knows of it."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rollout import engine_client, weight_group
from trainer import bucket_broadcast, publish_tensor

# (owner, attribute): what a span is taken of; an engine call is labelled by its route
_TRACED: list[tuple[Any, str]] = [
    (engine_client.EngineClient, "call"), (weight_group.UpdateGroup, "start_all"), (weight_group.UpdateGroup, "wait"),
    (bucket_broadcast, "flatten"), (publish_tensor, "flatten"), (publish_tensor, "serialize"),
]


@contextmanager
def timeline() -> Iterator[list[tuple[float, float, str, str]]]:
    """Inside the block, every traced function's call is appended as (start_s, end_s, thread, label)."""
    spans: list[tuple[float, float, str, str]] = []
    began = time.perf_counter()
    saved = [(owner, name, getattr(owner, name)) for owner, name in _TRACED]

    def traced(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                route = args[2] if label == "call" and len(args) > 2 else ""
                spans.append((start - began, time.perf_counter() - began, threading.current_thread().name,
                              f"{label} {route}".strip()))
        return run

    for owner, name, fn in saved:
        setattr(owner, name, traced(fn, name))
    try:
        yield spans
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def render(spans: list[tuple[float, float, str, str]], total_s: float) -> str:
    """The spans by start, in milliseconds, one a line."""
    lines = [f"publish {total_s * 1e3:.2f} ms; spans (ms from its start: start - end, length, thread, what)"]
    for start, end, thread, label in sorted(spans):
        lines.append(f"{start * 1e3:8.2f} - {end * 1e3:8.2f} {(end - start) * 1e3:7.2f}  {thread[:24]:24}  {label}")
    return "\n".join(lines) + "\n"


def traced_publish(run: Callable[[], Any]) -> str:
    """run() (one publish) with its timeline rendered."""
    with timeline() as spans:
        began = time.perf_counter()
        run()
        total = time.perf_counter() - began
    return render(spans, total)
