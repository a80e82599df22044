"""--update-weight-transport tensor: the weights handed by reference to engines on the trainer's own
GPU (--colocate), through SGLang's /update_weights_from_tensor, as slime updates colocated engines.

Bucket by bucket (--update-weight-buffer-size), between /begin_weight_update and /end_weight_update:
the bucket's tensors are packed into one buffer the engines can map (a CUDA IPC handle on a GPU,
shared memory on the CPU: rollout/tensor_handles.py) and held until every engine has copied them into
its own weights (its answer). Nothing crosses a network or a disk: the engines read the trainer's
memory. An engine that takes SGLang's "flattened_bucket" gets, per dtype in the bucket, one request
with the buffer as one tensor and each name's place in it: it maps one handle, as slime sends them.
Otherwise each tensor goes as a view of the buffer, a handle each.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from rollout.engine_client import version_to_wire
from rollout.tensor_handles import flattened_bucket, serialize, shared_buffer
from rollout.weight_group import FLATTENED_BUCKET, buckets, flat_order, flatten, unflatten
from trainer.engine_fanout import EngineFanOut

Weights = Iterable[tuple[str, torch.Tensor]]
Named = list[tuple[str, torch.Tensor]]


def send_by_reference(engines: EngineFanOut, version: int, urls: list[str], weights: Weights, bucket_bytes: int,
                      flattened: bool) -> tuple[list[str], dict[str, str], int]:
    """Every bucket to every engine in `urls` (each already inside /begin_weight_update), the version
    on the last request; `flattened`: as SGLang's flattened buckets (every engine takes them). Returns
    the engines that took every bucket, url -> why for those that failed (sent nothing more), and the
    bytes of the buckets. Pipelined: request k+1 is packed while the engines copy from request k's
    buffer (two buffers held at most), and posted once they answered k (one request at a time each)."""
    live, nbytes, last = list(urls), 0, False
    failed: dict[str, str] = {}
    asked: _Asked | None = None
    try:
        for named, last in _requests(weights, bucket_bytes, flattened):
            packed = _pack(named, flattened, version_to_wire(version) if last else None)
            nbytes += sum(t.numel() * t.element_size() for _, t in named)
            live, asked = _settle(engines, asked, live, failed), None
            if not live:
                packed.holder.close()
                break
            asked = _Asked(engines.start_call(live, "/update_weights_from_tensor", packed.body), packed)
        live, asked = _settle(engines, asked, live, failed), None
    finally:
        if asked is not None:  # failing with a request out: its memory is freed only once the engines answered
            _settle(engines, asked, live, failed)
    if not last:  # broke off: those that took the buckets so far still lack the rest
        failed.update({url: "the weight update broke off before its last bucket" for url in live})
        live = []
    return live, failed, nbytes


def _requests(weights: Weights, bucket_bytes: int, flattened: bool) -> Iterator[tuple[Named, bool]]:
    """Each request's tensors, with whether it is the publish's last: a bucket, or, flattened, a bucket's
    tensors of one dtype (a flattened bucket holds one: flat_order keeps a dtype's tensors together)."""
    for bucket, last in buckets(weights, bucket_bytes):
        bucket = [bucket[i] for i in flat_order([t.dtype for _, t in bucket])]  # each view aligned in the buffer
        parts = [list(part) for _, part in itertools.groupby(bucket, lambda item: item[1].dtype)] if flattened \
            else [bucket]
        for k, part in enumerate(parts):
            yield part, last and k == len(parts) - 1


@dataclass
class _Packed:
    body: dict[str, Any]
    # what the body's handles map, kept (and, on the CPU, its memory file open) until every engine answered
    flat: torch.Tensor
    holder: ExitStack


@dataclass
class _Asked:
    calls: dict[str, Future]
    packed: _Packed


def _pack(named: Named, flattened: bool, version: str | None) -> _Packed:
    """`named` copied into a buffer the engines can map, and the request that hands it over."""
    tensors = [tensor.detach() for _, tensor in named]
    device = tensors[0].device
    with ExitStack() as held:
        flat = held.enter_context(shared_buffer(sum(t.numel() * t.element_size() for t in tensors), device))
        flatten(tensors, device, out=flat)
        if flattened:
            payload: object = flattened_bucket(named, flat.view(tensors[0].dtype))
        else:
            payload = list(zip([name for name, _ in named], unflatten(flat, [t.dtype for t in tensors],
                                                                      [list(t.shape) for t in tensors])))
        body = {"serialized_named_tensors": [serialize(payload)], "flush_cache": version is not None,
                "load_format": FLATTENED_BUCKET if flattened else None, "weight_version": version}
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the engines read the buffer once asked
        return _Packed(body, flat, held.pop_all())


def _settle(engines: EngineFanOut, asked: _Asked | None, live: list[str], failed: dict[str, str]) -> list[str]:
    """Wait for the engines' answers to the request in flight, then free its buffer; the engines still live."""
    if asked is None:
        return live
    with asked.packed.holder:
        _, request_failed = engines.settle(asked.calls)
    failed.update(request_failed)
    return [url for url in live if url not in request_failed]
