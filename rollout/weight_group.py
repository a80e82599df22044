"""The weight-update process group: a trainer (rank 0, the source) and engine ranks, for
broadcasting new weights. The trainer hosts it (trainer/publish.py); the stand-in engine joins it
over gloo on the CPU and over NCCL on a GPU, SGLang engines over NCCL with their own
init_custom_process_group.

The group is built from a TCPStore and a process group directly instead of through
torch.distributed's default group, so neither side's own distributed state is touched and a
process may hold several groups. The store keys are prefixed as SGLang's init_custom_process_group
prefixes them (the group name, then 'name/', then the device), so either side may use that helper
or this module.

Two wire layouts, as SGLang's /update_weights_from_distributed takes them (its load_format):
- per tensor (no load_format): one broadcast per tensor, in the order of the names;
- "flattened_bucket" (SGLang's FlattenedTensorBucket, weight_sync/tensor_bucket.py): ONE broadcast of
  a uint8 buffer holding every tensor's bytes back to back, in the order of the names, no padding;
  each tensor is that byte range viewed as its dtype and shape. Mixed dtypes share a bucket; a view
  needs its tensor to start at a multiple of its element size (SGLang fails otherwise), so the
  trainer orders a bucket's tensors by falling element size (flat_order).
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from packaging.version import InvalidVersion, Version

Backend = Literal["gloo", "nccl"]
FLATTENED_BUCKET = "flattened_bucket"  # /update_weights_from_distributed's load_format for one broadcast a bucket
# The first SGLang release taking that load_format (PR #13824, opened 2025-11-24, after 0.5.5; 0.5.7
# is the first release known here to have it: the bound errs towards the always-understood per-tensor form).
FLATTENED_SINCE = Version("0.5.7")
_DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64")}
_DEVICE_PREFIX = {"gloo": "cpu/", "nccl": "cuda/"}
# Read once, by ProcessGroupNCCL's constructor. By default (3, SkipCleanUp) a broadcast to a hung
# engine that times out takes the whole trainer down; 2 (CleanUpOnly) aborts only this group.
# (Seen on 2 H200s, torch 2.11: the trainer lives; the abort still waits about 60 s for the
# flight recorder's dump.)
_NCCL_GROUP_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
_NCCL_POLL_S = 5e-5  # between two looks at a broadcast's completion (UpdateGroup.wait)
_GLOO_POLL_S = 1e-3  # the same on gloo, where it is looked at only to abandon a wait (on the CPU: cheaper)


class WeightSyncError(Exception):
    """A group cannot be created or a broadcast request is malformed."""


@dataclass
class UpdateGroup:
    name: str
    rank: int
    world_size: int
    timeout: timedelta  # bounds the rendezvous and every broadcast's wait
    store: dist.Store  # held so the rendezvous store (hosted by rank 0) lives as long as the group
    pg: dist.ProcessGroupGloo | dist.ProcessGroupNCCL | None  # None once closed
    backend: Backend = "gloo"

    def start_broadcast(self, tensor: torch.Tensor, src: int = 0) -> dist.Work:
        """Queue sending (on src) or receiving (elsewhere) one tensor, in place; wait() on the answer."""
        options = dist.BroadcastOptions()
        options.rootRank = src
        if self.pg is None:
            raise WeightSyncError(f"update group {self.name!r} is closed")
        # torch 2.13's stubs lack Backend.broadcast, which both backends have at run time
        return self.pg.broadcast([tensor], options)  # type: ignore[union-attr]

    def start_all(self, tensors: list[torch.Tensor], src: int = 0) -> list[dist.Work]:
        """Queue every tensor's broadcast before any is waited on: the link never idles between them."""
        return [self.start_broadcast(tensor, src) for tensor in tensors]

    def wait(self, works: list[dist.Work], abandon: Callable[[], str | None] | None = None,
             grace_s: float = 0.0) -> None:
        """Wait for queued broadcasts, each bounded by the group's timeout (RuntimeError past it).
        NCCL's own wait with a timeout looks at the broadcast every millisecond (torch's
        WorkNCCL::synchronize): a millisecond lost a bucket on each side. Its completion is looked at
        every _NCCL_POLL_S here instead; the wait after it then returns at once, or raises.
        abandon: asked while waiting; once it has given a reason (a member that will not take part) for
        grace_s without the broadcasts completing, RuntimeError with that reason, not the timeout."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        poll_s = _NCCL_POLL_S if self.backend == "nccl" else _GLOO_POLL_S
        reason, since = None, 0.0
        for work in works:
            while (self.backend == "nccl" or abandon) and not work.is_completed() and time.monotonic() < deadline:
                if abandon is not None and reason is None and (reason := abandon()) is not None:
                    since = time.monotonic()
                if reason is not None and time.monotonic() - since > grace_s:
                    raise RuntimeError(reason)
                time.sleep(poll_s)
            work.wait(max(timedelta(milliseconds=1), timedelta(seconds=deadline - time.monotonic())))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Send (on src) or receive (elsewhere) one tensor, in place."""
        self.wait([self.start_broadcast(tensor, src)])

    def receive(self, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]],
                device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """Receive one tensor per name, in order, from rank 0, into `device` (default: the CPU; an
        NCCL group's tensors live on this process's GPU); every receive is queued before any is waited on."""
        tensors = [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in zip(dtypes, shapes)]
        self.wait(self.start_all(tensors))
        return dict(zip(names, tensors))

    def receive_flat(self, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]],
                     device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """Receive a flattened bucket (one broadcast) and view it as one tensor per name, in order."""
        flat = torch.empty(flat_bytes(dtypes, shapes), dtype=torch.uint8, device=device)
        self.broadcast(flat)
        return dict(zip(names, unflatten(flat, dtypes, shapes)))

    def close(self) -> None:
        """Shut the group down and let go of its process group now: only its destruction closes
        gloo's connections, which is what wakes ranks still blocked on a broadcast (else they
        wait for their own, longer, timeout while holding their group lock)."""
        if isinstance(self.pg, dist.ProcessGroupGloo):
            self.pg.shutdown()
        elif self.pg is not None:  # NCCL's shutdown waits for the collective a hung rank never finishes
            self.pg.abort()
        self.pg = None


def parse_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' (how trainers write str(tensor.dtype))."""
    dtype = _DTYPES.get(name.removeprefix("torch.")) if isinstance(name, str) else None
    if dtype is None:
        raise WeightSyncError(f"unsupported dtype {name!r}; expected one of {', '.join(_DTYPES)}")
    return dtype


def takes_flattened_buckets(version: object) -> bool:
    """Whether an engine whose /server_info gives `version` takes FLATTENED_BUCKET: an SGLang release
    older than FLATTENED_SINCE ignores load_format (it would wait for one broadcast per tensor);
    anything else (a newer SGLang, the stand-in engines, which give no SGLang version) takes it."""
    try:
        return Version(str(version)) >= FLATTENED_SINCE
    except InvalidVersion:
        return True


def buckets(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
            ) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """Consecutive runs of at most bucket_bytes (a larger tensor goes alone), each with whether
    it is the last; only one bucket is held at a time."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket, False
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket, True


def _nbytes(dtype: torch.dtype, shape: list[int]) -> int:
    return math.prod(shape) * dtype.itemsize


def flat_bytes(dtypes: list[torch.dtype], shapes: list[list[int]]) -> int:
    return sum(_nbytes(dtype, shape) for dtype, shape in zip(dtypes, shapes))


def flat_order(dtypes: list[torch.dtype]) -> list[int]:
    """Indices in falling element size (stable): every tensor of a flattened bucket then starts at a
    multiple of its element size, as the views on the engine need."""
    return sorted(range(len(dtypes)), key=lambda i: -dtypes[i].itemsize)


def flatten(tensors: list[torch.Tensor], device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """The flattened bucket of `tensors` (their bytes back to back, in order), built on `device`:
    one buffer (`out`, a uint8 tensor of their size, if given), each tensor copied into its range
    (no host round trip for tensors already there; those on `device` in one batched copy)."""
    size = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.empty(size, dtype=torch.uint8, device=device) if out is None else out
    if flat.numel() != size or flat.dtype != torch.uint8:
        raise ValueError(f"out must be {size} bytes of uint8, got {flat.numel()} of {flat.dtype}")
    as_bytes = [tensor.detach().reshape(-1).view(torch.uint8) for tensor in tensors]
    if all(part.device == flat.device for part in as_bytes):  # one batched copy, not a launch per tensor
        return torch.cat(as_bytes, out=flat) if as_bytes else flat
    start = 0
    for part in as_bytes:
        flat[start:start + part.numel()].copy_(part)
        start += part.numel()
    return flat


def unflatten(flat: torch.Tensor, dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[torch.Tensor]:
    """Views of a flattened bucket, one per dtype and shape (SGLang's reconstruct_tensors)."""
    if flat.numel() != flat_bytes(dtypes, shapes):
        raise WeightSyncError(f"a flattened bucket of {flat.numel()} bytes does not hold dtypes and shapes "
                              f"of {flat_bytes(dtypes, shapes)} bytes")
    views, start = [], 0
    for dtype, shape in zip(dtypes, shapes):
        size = _nbytes(dtype, shape)
        if start % dtype.itemsize:
            raise WeightSyncError(f"a {dtype} tensor starts at byte {start} of the flattened bucket, not a "
                                  f"multiple of {dtype.itemsize}: order the bucket by falling element size")
        views.append(flat[start:start + size].view(dtype).reshape(shape))
        start += size
    return views


def create_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                 timeout_s: float, backend: Backend = "gloo") -> UpdateGroup:
    """Join (rank >= 1) or host (rank 0) the group; returns once every rank has joined.
    timeout_s (seconds) bounds the rendezvous and, later, each broadcast."""
    if not 0 <= rank < world_size:
        raise WeightSyncError(f"rank {rank} is outside a group of world_size {world_size}")
    timeout = timedelta(seconds=timeout_s)
    try:
        tcp = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                            multi_tenant=True)
        store = dist.PrefixStore(_DEVICE_PREFIX[backend],
                                 dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, tcp)))
        pg: dist.ProcessGroupGloo | dist.ProcessGroupNCCL
        if backend == "gloo":
            pg = _gloo(store, rank, world_size, timeout, route_address(master_address, master_port))
        else:
            pg = _nccl(store, rank, world_size, timeout)
    except (RuntimeError, OSError, ValueError) as err:
        raise WeightSyncError(f"cannot join {backend} group {group_name!r} at {master_address}:{master_port} "
                              f"as rank {rank}: {err}") from err
    return UpdateGroup(group_name, rank, world_size, timeout, tcp, pg, backend)


def _gloo(store: dist.Store, rank: int, world_size: int, timeout: timedelta, address: str) -> dist.ProcessGroupGloo:
    # torch 2.13's stubs name only Options (at run time Backend.Options, which lacks _devices)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def _nccl(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.ProcessGroupNCCL:
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    options.is_high_priority_stream = False
    with _environ(_NCCL_GROUP_ENV):
        return dist.ProcessGroupNCCL(store, rank, world_size, options)


@contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def route_address(host: str, port: int) -> str:
    """This host's address on the route to host:port, which the other side can dial back, and
    where gloo must bind (a node's hostname may resolve to an address the other side cannot use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # UDP: picks the route, sends nothing
        return probe.getsockname()[0]


def free_port(address: str) -> int:
    """A port free on `address` now, for rank 0's rendezvous store."""
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]
