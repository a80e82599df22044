"""Where a publish by reference spends its time, without HTTP or an engine (bench_tensor_publish --profile):
this process packs each flattened bucket as trainer/publish_tensor.py does and serializes it; a second
process (the engine's side, spawned on the same GPU) deserializes it (maps the CUDA IPC handle),
reconstructs the views, copies them into weights of its own and lets the mapping go, as SGLang does for
every /update_weights_from_tensor request. Each part is timed on its side and summed over a publish's
requests; the best of `repeats` publishes after a warm-up."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import time
from multiprocessing.connection import Connection

import torch

from rollout.tensor_handles import deserialize, flattened_bucket, reconstruct, serialize, shared_buffer
from rollout.weight_group import buckets, flat_order, flatten

CHILD_START_S = 120.0  # the spawned side imports torch and makes its CUDA context
ANSWER_S = 60.0  # one request's handling on the spawned side


def _engine_side(conn: Connection, shapes: dict[str, tuple[list[int], torch.dtype]]) -> None:
    torch.cuda.set_device(0)
    weights = {name: torch.zeros(shape, dtype=dtype, device="cuda") for name, (shape, dtype) in shapes.items()}
    conn.send("ready")
    while (payload := conn.recv()) is not None:
        began = time.perf_counter()
        bucket = deserialize(payload)
        mapped = time.perf_counter()
        named = reconstruct(bucket)
        rebuilt = time.perf_counter()
        for name, tensor in named:
            weights[name].copy_(tensor)
        torch.cuda.synchronize()
        copied = time.perf_counter()
        del bucket, named, tensor  # the last view goes: torch closes the IPC mapping
        conn.send({"map_s": mapped - began, "reconstruct_s": rebuilt - mapped, "copy_s": copied - rebuilt,
                   "release_s": time.perf_counter() - copied})


def _requests(weights: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """The publish's requests, one per bucket and dtype, as trainer/publish_tensor.py makes them."""
    out = []
    for bucket, _ in buckets(weights, bucket_bytes):
        bucket = [bucket[i] for i in flat_order([t.dtype for _, t in bucket])]
        out.extend(list(part) for _, part in itertools.groupby(bucket, lambda item: item[1].dtype))
    return out


def ipc_parts(weights: list[tuple[str, torch.Tensor]], bucket_bytes: int, repeats: int) -> dict[str, float]:
    """Seconds per publish of each part (pack, serialize, the engine side's map, reconstruct, copy, release,
    and the round trip over a pipe that carries them), summed over its requests; the fastest publish's."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_engine_side, args=(there, {n: (list(t.shape), t.dtype) for n, t in weights}))
    child.start()
    try:
        if not here.poll(CHILD_START_S):
            raise RuntimeError(f"the engine side did not start within {CHILD_START_S:g} s")
        here.recv()
        runs = []
        for _ in range(repeats + 1):  # a warm-up, then the timed ones
            parts = dict.fromkeys(("pack_s", "serialize_s", "round_trip_s", "map_s", "reconstruct_s", "copy_s",
                                   "release_s"), 0.0)
            began = time.perf_counter()
            for named in _requests(weights, bucket_bytes):
                tensors = [t for _, t in named]
                t0 = time.perf_counter()
                with shared_buffer(sum(t.numel() * t.element_size() for t in tensors), tensors[0].device) as flat:
                    flatten(tensors, flat.device, out=flat)
                    torch.cuda.current_stream().synchronize()
                    t1 = time.perf_counter()
                    payload = serialize(flattened_bucket(named, flat.view(tensors[0].dtype)))
                    t2 = time.perf_counter()
                    here.send(payload)
                    if not here.poll(ANSWER_S):
                        raise RuntimeError(f"the engine side did not answer within {ANSWER_S:g} s")
                    answer = here.recv()
                    t3 = time.perf_counter()
                parts["pack_s"] += t1 - t0
                parts["serialize_s"] += t2 - t1
                parts["round_trip_s"] += t3 - t2
                for key, seconds in answer.items():
                    parts[key] += seconds
            parts["publish_s"] = time.perf_counter() - began
            runs.append(parts)
        return min(runs[1:], key=lambda parts: parts["publish_s"])
    finally:
        here.send(None)
        child.join(CHILD_START_S)
        if child.is_alive():
            child.kill()
