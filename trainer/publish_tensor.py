"""--update-weight-transport tensor: the weights handed by reference to engines on the trainer's own
GPU (--colocate), through SGLang's /update_weights_from_tensor, as slime updates colocated engines.

Bucket by bucket (--update-weight-buffer-size), between /begin_weight_update and /end_weight_update:
the bucket's tensors are packed into one buffer the engines can map (a CUDA IPC handle on a GPU,
shared memory on the CPU: rollout/tensor_handles.py), sent as views of it, one (name, tensor) list
per engine's tensor-parallel rank, and held until every engine has copied them into its own weights
(its answer). Nothing crosses a network or a disk: the engines read the trainer's memory.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rollout.engine_client import version_to_wire
from rollout.tensor_handles import serialize, shared_buffer
from rollout.weight_group import buckets, flat_order, flatten, unflatten
from trainer.engine_fanout import EngineFanOut

Weights = Iterable[tuple[str, torch.Tensor]]


def send_by_reference(engines: EngineFanOut, version: int, urls: list[str], weights: Weights, bucket_bytes: int
                      ) -> tuple[list[str], dict[str, str], int]:
    """Every bucket to every engine in `urls` (each already inside /begin_weight_update), the version
    on the last. Returns the engines that took every bucket, url -> why for those that failed (sent
    nothing more), and the bytes of the buckets."""
    live, failed, nbytes, last = list(urls), {}, 0, False
    for bucket, last in buckets(weights, bucket_bytes):
        bucket = [bucket[i] for i in flat_order([t.dtype for _, t in bucket])]  # each view aligned in the buffer
        names = [name for name, _ in bucket]
        tensors = [tensor.detach() for _, tensor in bucket]
        device = tensors[0].device
        size = sum(t.numel() * t.element_size() for t in tensors)
        with shared_buffer(size, device) as flat:  # held until every engine answered: they copied it
            views = unflatten(flatten(tensors, device, out=flat), [t.dtype for t in tensors],
                              [list(t.shape) for t in tensors])
            body = {"serialized_named_tensors": [serialize(list(zip(names, views)))], "load_format": None,
                    "flush_cache": last, "weight_version": version_to_wire(version) if last else None}
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # the engines read the buffer once asked
            _, bucket_failed = engines.on_all(live, "/update_weights_from_tensor", body)
            del views
        failed.update(bucket_failed)
        live = [url for url in live if url not in bucket_failed]
        nbytes += size
        if not live:
            break
    if not last:  # broke off: those that took the buckets so far still lack the rest
        failed.update({url: "the weight update broke off before its last bucket" for url in live})
        live = []
    return live, failed, nbytes
