"""The NCCL (gloo on the CPU) publish's buckets on the wire (trainer/publish.py): bucket by bucket,
pipelined: bucket k+1 is gathered, packed and queued while k is still on the wire (two buckets in
flight at most). A bucket is one broadcast of its tensors' bytes (SGLang's "flattened_bucket") or, for
an engine older than that format, one per tensor, all queued before any is waited on.

Buckets take turns on the lanes, update groups of their own over the same members (BucketFeed; two
for a single engine, trainer/publish.py says why): an engine is asked for bucket k+1 while it still
receives k, so it goes from one to the next without a round trip to the trainer; each lane's
broadcasts run on their own communicator (and stream), so whichever request the engine takes first
finds its bytes. The last bucket carries the version: on lanes it is asked for only once every other
was answered, so the engine serves it with all of them loaded."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rollout.weight_group import FLATTENED_BUCKET, UpdateGroup, WeightSyncError, buckets, flat_order, flatten
from trainer.bucket_feed import BucketFeed
from trainer.engine_fanout import EngineFanOut

# Two buffers: the bucket on the wire and the next one being gathered and queued behind it.
_BUCKETS_IN_FLIGHT = 2
# Seconds a broadcast may still complete after a member's request failed (it may have failed after
# receiving: a load error) before the publish gives it up, instead of waiting out the update's timeout
# (NCCL's group is then aborted at once; gloo's shutdown still waits for a send in progress).
FAILED_MEMBER_GRACE_S = 1.0
# Seconds, once a broadcast was given up, that the members' answers to their bucket requests are waited for.
GIVEN_UP_ANSWER_S = 1.0


@dataclass
class Sent:
    failed: dict[str, str | None]  # member -> why its requests failed, None if they did not
    broken: str | None  # why the broadcast broke off, for every member
    last: bool | None  # whether the last bucket went (None: there were no weights)
    nbytes: int


def broadcast_buckets(engines: EngineFanOut, lanes: Sequence[UpdateGroup], members: list[str],
                      weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, version: str,
                      flattened: bool) -> Sent:
    """Every bucket to the lanes' members (`version` on the last); see the module docstring."""
    feeds = {url: BucketFeed(engines, url, len(lanes)) for url in members}
    device = torch.device("cuda", torch.cuda.current_device()) if lanes[0].backend == "nccl" else torch.device("cpu")
    # a bucket's lane and buffers (held till its broadcasts were waited on) and those broadcasts
    in_flight: deque[tuple[UpdateGroup, list[torch.Tensor], list[Any]]] = deque()
    nbytes, last, broken = 0, None, None

    def wait_oldest() -> str | None:
        lane, _, works = in_flight.popleft()
        return _wait(lane, works, feeds)

    try:
        for index, (bucket, last) in enumerate(buckets(weights, bucket_bytes)):
            lane = index % len(lanes)
            if flattened:  # a tensor of element size k starts at a multiple of k (flat_order)
                bucket = [bucket[i] for i in flat_order([t.dtype for _, t in bucket])]
            tensors = [tensor.detach() for _, tensor in bucket]
            body = {"names": [name for name, _ in bucket],
                    "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
                    "shapes": [list(t.shape) for t in tensors], "group_name": lanes[lane].name, "flush_cache": last,
                    "weight_version": version if last else None}
            if flattened:
                body["load_format"] = FLATTENED_BUCKET
                tensors = [flatten(tensors, device)]
            else:
                tensors = [tensor.to(device).contiguous() for tensor in tensors]
            if last and index and len(lanes) > 1:  # every other bucket answered first (on one lane, its order says so)
                while in_flight:
                    broken = broken or wait_oldest()
                for feed in feeds.values():
                    feed.wait_answered()
                if broken or all(feed.failure for feed in feeds.values()):
                    break
            for feed in feeds.values():
                feed.post(body, lane)
            in_flight.append((lanes[lane], tensors, lanes[lane].start_all(tensors)))
            nbytes += sum(t.numel() * t.element_size() for t in tensors)
            while len(in_flight) >= _BUCKETS_IN_FLIGHT or (last and in_flight):
                broken = broken or wait_oldest()
            if broken or all(feed.failure for feed in feeds.values()):
                break
    except WeightSyncError as err:  # a lane was closed under us
        broken = f"the weight broadcast broke off: {err}"
    finally:
        if broken:  # wakes engines blocked on a broadcast that will not come; the lanes are rebuilt
            in_flight.clear()  # a queued broadcast holds the group's connections open
            for group in lanes:
                group.close()
            for feed in feeds.values():
                feed.stop(broken)
        # Given up, an engine still blocked on it (one that relays it to others, or over NCCL, which
        # does not see the trainer's side go) answers at its own timeout: it is dropped, not waited for.
        failed = {url: feed.finish(GIVEN_UP_ANSWER_S if broken else None) for url, feed in feeds.items()}
    return Sent(failed, broken, last, nbytes)


def _wait(group: UpdateGroup, works: list[Any], feeds: dict[str, BucketFeed]) -> str | None:
    """Wait for one bucket's queued broadcasts on its lane; the reason they broke off, or None. An engine whose
    request failed (e.g. a new process at a member's url, outside the group) will not take part: the
    broadcast is given up FAILED_MEMBER_GRACE_S after, not at the update's timeout."""
    def failed_member() -> str | None:
        return next((f"{feed.url} failed its bucket: {feed.failure}" for feed in feeds.values() if feed.failure),
                    None)
    try:
        group.wait(works, failed_member, FAILED_MEMBER_GRACE_S)
    except RuntimeError as err:
        return f"the weight broadcast broke off: {err}"
    return None
