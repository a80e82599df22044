"""Per-sample spans: what happened to a sample, when, and where (slime's trace_span, flattened).

A span is a plain dict kept in `Sample.spans` (so it travels with the sample through the buffer,
a partial rollout's later rounds and the debug rollout dump):

    {"kind": KIND, "start": unix s, "end": unix s, "engine": url | None, "weight_version": int | None,
     "attempt": int | None, ...free fields (outcome, error, kept, ...)}

Kinds: queued (waiting for a --rollout-concurrency slot), generate (one request, numbered by
attempt), retry_wait (the backoff before the next attempt), abort (the engine stopped it, a mark),
resume (a partial rollout continues it in a later round, a mark), reward, filter. Wall time, so
the viewer can put supervisor events (also wall time) on the same axis.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from rollout.sample import Sample

KINDS = ("queued", "generate", "retry_wait", "abort", "resume", "reward", "filter")
_OF_THE_RESPONSE = ("reward", "filter")  # spans about the finished response: its weight version is theirs


def add(sample: Sample, kind: str, start: float, end: float | None = None, *, engine: str | None = None,
        weight_version: int | None = None, attempt: int | None = None, **fields: Any) -> dict[str, Any]:
    """Record one span (end None: a mark at `start`) and return it, for fields known later."""
    if kind not in KINDS:
        raise ValueError(f"span kind {kind!r}: one of {', '.join(KINDS)}")
    if weight_version is None and kind in _OF_THE_RESPONSE:
        weight_version = sample.weight_version
    span = {"kind": kind, "start": start, "end": start if end is None else end, "engine": engine,
            "weight_version": weight_version, "attempt": attempt, **fields}
    sample.spans.append(span)
    return span


@contextlib.contextmanager
def span(samples: Sample | list[Sample], kind: str, **fields: Any) -> Iterator[dict[str, Any]]:
    """A span around the block on each sample; the yielded dict's fields are added to each at the
    end (an exception is recorded as the span's `error` and raised on)."""
    start, extra = time.time(), dict(fields)
    try:
        yield extra
    except BaseException as err:
        extra["error"] = f"{type(err).__name__}: {err}"[:300]
        raise
    finally:
        end = time.time()
        for sample in samples if isinstance(samples, list) else [samples]:
            add(sample, kind, start, end, **extra)


def generate_attempts(sample: Sample) -> int:
    """Requests sent for this sample so far, over all rounds: the next attempt's number."""
    return sum(1 for s in sample.spans if s["kind"] == "generate")
