"""Publishing new weights from trainer rank 0 to every ready engine as version v.

Three transports, the first two named as slime names them:
- disk: an HF safetensors folder JOB/weights/<version>/, built in a hidden temporary folder and
  renamed into place, then POST /update_weights_from_disk to every engine at once.
- nccl: one process group of the trainer (rank 0) and every engine rank (two, lanes, for a single
  engine: LANES), kept across publishes while the engine set and their processes are unchanged (the
  supervisor's relaunch counts; its engines' sizes are not asked again); tensors are broadcast
  (trainer/bucket_broadcast.py) in buckets of --update-weight-buffer-size between /begin_weight_update
  and /end_weight_update (each engine's /model_info asked beside its end), pipelined (no lock step):
  the next bucket is gathered and queued while the previous one is on the wire (two in flight), and
  engines get each bucket's request as soon as they answered the one before, or, on two lanes, while
  they still take the one before. A bucket goes as ONE broadcast of its
  tensors' bytes packed on the trainer's device (SGLang's load_format "flattened_bucket"; layout in
  rollout/weight_group.py), unless an engine of the group is an SGLang older than that format
  (its /server_info version below weight_group.FLATTENED_SINCE): an older SGLang ignores load_format and would
  wait for one broadcast per tensor, so the whole group (the broadcasts are collective) then sends
  one per tensor, all queued before any is waited on. Without a GPU, or with a CPU engine in the
  group (its /server_info says device cpu), it runs on gloo, as the CPU engine does.

- tensor: by reference, for engines on the trainer's own GPU (--colocate; slime's path for colocated
  engines): POST /update_weights_from_tensor with CUDA IPC handles (shared memory on the CPU) of each
  bucket, as flattened buckets where every engine takes them (its /server_info, asked once, as for nccl);
  trainer/publish_tensor.py.

An engine whose update fails or times out is dropped: reported, handed to on_drop and left out,
while the others still get the version. Every wait is bounded by timeout_s. The API key only
ever travels in the Authorization header: it is never printed, logged or put in a reason.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import torch

from contract.job_dir import JobDir
from rollout.engine_client import EngineError, version_to_wire
from rollout.weight_group import (
    Backend,
    UpdateGroup,
    WeightSyncError,
    create_group,
    free_port,
    route_address,
    takes_flattened_buckets,
)
from trainer.bucket_broadcast import broadcast_buckets
from trainer.engine_fanout import EngineFanOut
from trainer.publish_tensor import send_by_reference
from trainer.weight_folders import WeightFolders

DEFAULT_BUCKET_BYTES = 512 * 1024**2  # --update-weight-buffer-size
Transport = Literal["disk", "nccl", "tensor"]
TRANSPORTS: tuple[Transport, ...] = ("disk", "nccl", "tensor")
Weights = Iterable[tuple[str, torch.Tensor]]
OnDrop = Callable[[str, str], None]
# Seconds: bounds every single wait of a publish (one engine call, the group's rendezvous, one
# broadcast) unless the caller names its own (--update-weight-timeout).
DEFAULT_TIMEOUT_S = 600.0


class PublishError(Exception):
    """The trainer's side of a publish failed; no engine got the version."""


@dataclass
class PublishResult:
    version: int
    updated: list[str]  # engines that now serve `version`
    dropped: dict[str, str]  # url -> reason
    seconds: float
    bytes: int


# Update groups over the same members, which buckets take turns on (trainer/bucket_broadcast.py): an
# engine holds the next bucket's request while it receives one. Each costs the engine one more
# communicator (NCCL's buffers) and the group's forming one more rendezvous. Only a group of one engine
# has them: its ranks take its requests in one order, but two engines may take the lanes' requests in
# different orders, and a broadcast that one relays to the other (NCCL's ring) then waits forever.
LANES = 2
# Numbers the update groups of this process, of every publisher in it: an engine may keep a group it was dropped
# from (its destroy is sent only to the engines not dropped), and a group formed later never takes its name.
_GROUP_IDS = itertools.count(1)


@dataclass
class _Group:
    """The update groups (lanes) and the engines in them, in rank order, with their tp sizes."""

    layout: tuple[tuple[str, int], ...]
    lanes: tuple[UpdateGroup, ...]  # their backend: gloo where a member is a CPU engine
    launches: dict[str, int | None] = field(default_factory=dict)  # each member's relaunches when it joined

    @property
    def engines(self) -> list[str]:
        return [url for url, _ in self.layout]


class WeightPublisher:
    """Publishes trainer rank 0's full HF-named weights to engines; see the module docstring.

    model_files: the folder with the model's config and tokenizer, which disk versions carry
    (contract.job_dir.model_files_dir). bucket_bytes bounds one broadcast bucket (nccl) and one
    safetensors shard (disk); timeout_s bounds every single wait; on_drop(url, reason) is called
    once per dropped engine, as soon as it is dropped; serving (supervised) lists the engines the
    supervisor serves with now: one it took out is no longer waited for (trainer.engine_fanout);
    launches (supervised) says how often each engine was launched again: a new process at a member's
    url is no longer in the group, which is then formed again (not the engine dropped for it).
    Call close() when done, to destroy the update group."""

    def __init__(self, transport: Transport, job_dir: Path, model_files: Path, api_key: str | None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, keep_versions: int = 3, timeout_s: float = DEFAULT_TIMEOUT_S,
                 on_drop: OnDrop | None = None, backend: Backend | None = None,
                 serving: Callable[[], list[str]] | None = None,
                 launches: Callable[[], Mapping[str, int]] | None = None) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        if bucket_bytes <= 0 or keep_versions < 1 or timeout_s <= 0:
            raise ValueError("bucket_bytes and timeout_s must be positive and keep_versions at least 1")
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self._folders = WeightFolders(JobDir(job_dir), Path(model_files), bucket_bytes, keep_versions)
        self.timeout_s = timeout_s
        self.on_drop = on_drop or (lambda url, reason: None)
        # NCCL needs the trainer's GPU; SGLang engines join with nccl, CPU engines with gloo (a group
        # with a CPU engine in it is gloo: a trainer on a GPU asking it for nccl would wait forever).
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self._on_cpu: dict[str, bool] = {}  # engine url -> its /server_info says device cpu
        self._takes_flat: dict[str, bool] = {}  # engine url -> it takes flattened buckets (takes_flattened_buckets)
        self._engines = EngineFanOut(api_key, timeout_s, serving)
        self._launches = launches or dict
        self._group: _Group | None = None

    @property
    def group_engines(self) -> list[str]:
        """The engines in the current update group (nccl), in rank order; empty when there is none."""
        return self._group.engines if self._group else []

    @property
    def group_name(self) -> str | None:
        return self._group.lanes[0].name if self._group else None

    def publish(self, version: int, engines: list[str], weights: Weights) -> PublishResult:
        if version < 0:
            raise ValueError(f"weight versions count from 0, got {version}")
        start = time.monotonic()
        dropped: dict[str, str] = {}
        weights = iter(weights)
        try:
            if self.transport == "disk":
                updated, nbytes = self._publish_disk(version, list(engines), weights, dropped)
            elif self.transport == "tensor":
                updated, nbytes = self._publish_tensor(version, list(engines), weights, dropped)
            else:
                updated, nbytes = self._publish_distributed(version, list(engines), weights, dropped)
        finally:
            for _ in weights:  # whatever was not sent is still drawn: the other ranks gather it with us
                pass
        return PublishResult(version, updated, dropped, time.monotonic() - start, nbytes)

    def close(self) -> None:
        """Destroy the update group on the engines and here; close the engine connections."""
        self._drop_group()
        self._engines.close()

    def _drop_engines(self, failed: dict[str, str], dropped: dict[str, str]) -> None:
        for url, reason in failed.items():
            if url not in dropped:
                dropped[url] = reason
                self._on_cpu.pop(url, None)
                self._takes_flat.pop(url, None)
                self.on_drop(url, reason)

    def _verify(self, version: int, engines: list[str], dropped: dict[str, str],
                asked: dict[str, Future] | None = None) -> list[str]:
        """Fence every engine whose /model_info does not name the new version (asked: those calls, made already)."""
        asked = self._engines.start(engines, self._engines.weight_version) if asked is None else asked
        versions, failed = self._engines.settle(asked)
        for url, served in versions.items():
            if served != version:
                failed[url] = f"/model_info says weight_version {served}, expected {version}"
        self._drop_engines(failed, dropped)
        return [url for url in engines if url not in dropped]

    def _end(self, version: int, members: list[str], done: list[str], dropped: dict[str, str]) -> list[str]:
        """/end_weight_update on every member, with /model_info asked beside it of those that took every
        bucket (`done`: the version rode on their last one); those that now serve `version`. A dropped
        engine is ended too, in case it lives, but not waited for: it may hang."""
        ending = self._engines.start_call(members, "/end_weight_update", {})
        done = [url for url in done if url not in dropped]
        asked = self._engines.start(done, self._engines.weight_version)
        _, end_failed = self._engines.settle({url: f for url, f in ending.items() if url not in dropped})
        self._drop_engines({url: reason for url, reason in end_failed.items() if url in done}, dropped)
        return self._verify(version, [url for url in done if url not in dropped], dropped,
                            {url: f for url, f in asked.items() if url not in dropped})

    # ---- disk ----

    def _publish_disk(self, version: int, engines: list[str], weights: Weights,
                      dropped: dict[str, str]) -> tuple[list[str], int]:
        # Held whole (on the CPU): the writer plans every shard's header before its first byte.
        tensors = [(name, tensor.detach().cpu()) for name, tensor in weights]
        if not tensors:
            raise PublishError("no weights to publish")
        folder, nbytes = self._folders.write(version, tensors)
        done, failed = self._engines.each(
            engines, lambda url: self._engines.load_from_disk(url, folder, version, self.timeout_s))
        self._drop_engines(failed, dropped)
        self._folders.prune(folder)
        return self._verify(version, [url for url in engines if url in done], dropped), nbytes

    # ---- tensor (by reference) ----

    def _publish_tensor(self, version: int, engines: list[str], weights: Weights,
                        dropped: dict[str, str]) -> tuple[list[str], int]:
        _, failed = self._engines.each([url for url in engines if url not in self._takes_flat],
                                       self._ask_server_info)
        self._drop_engines(failed, dropped)
        begun, failed = self._engines.on_all([url for url in engines if url not in dropped], "/begin_weight_update",
                                             {"selector": "all"})
        self._drop_engines(failed, dropped)
        members = [url for url in engines if url in begun]
        flattened = all(self._takes_flat[url] for url in members)
        taken, nbytes = list[str](), 0
        try:
            taken, failed, nbytes = send_by_reference(self._engines, version, members, weights, self.bucket_bytes,
                                                      flattened)
            self._drop_engines(failed, dropped)
        finally:  # even when the caller's weights fail: engines must not stay held
            updated = self._end(version, members, taken, dropped)
        if nbytes == 0:
            raise PublishError("no weights to publish")
        return updated, nbytes

    # ---- nccl (gloo on CPU) ----

    def _publish_distributed(self, version: int, engines: list[str], weights: Weights,
                             dropped: dict[str, str]) -> tuple[list[str], int]:
        group = self._ready_group(engines, dropped)
        if group is None:
            return [], 0
        members, done = group.engines, list[str]()
        try:
            done, nbytes = self._send_buckets(version, group, weights, dropped)
        finally:  # even when the caller's weights fail: engines must not stay held
            updated = self._end(version, members, done, dropped)
        if any(url in dropped for url in members):
            self._drop_group(dropped)  # a member failed: the group may hang; the next publish rebuilds it
        return updated, nbytes

    def _ready_group(self, engines: list[str], dropped: dict[str, str]) -> _Group | None:
        """The group of the live engines with the update begun on each. An engine failing on the
        way is dropped and the group rebuilt without it; each round drops one, so this ends."""
        launches = self._launches()
        while engines:
            same = self._group is not None and all(
                launches.get(url) == launched for url, launched in self._group.launches.items())
            if same and self._group is not None and engines == self._group.engines:
                layout = self._group.layout  # the same processes (one gone fails begin)
            else:
                tp_sizes, failed = self._engines.each(engines, self._ask_server_info)
                self._drop_engines(failed, dropped)
                layout = tuple((url, tp_sizes[url]) for url in engines if url in tp_sizes)
            if not layout:
                return None
            if self._group is None or self._group.layout != layout or not same:
                self._drop_group(dropped)
                self._group = self._build_group(layout, dropped, {url: launches.get(url) for url, _ in layout})
                if self._group is None:
                    engines = [url for url, _ in layout if url not in dropped]
                    continue
            begun, failed = self._engines.on_all(self._group.engines, "/begin_weight_update", {"selector": "all"})
            if not failed:
                return self._group
            self._drop_engines(failed, dropped)
            self._engines.on_all(list(begun), "/end_weight_update", {})
            self._drop_group(dropped)
            engines = list(begun)
        return None

    def _ask_server_info(self, url: str) -> int:
        """The engine's tp size, from its /server_info, which also says its device and SGLang version
        (kept for the publishes after it, until the engine is dropped: a replacement may differ)."""
        info = self._engines.call(url, "/server_info")
        size = info.get("tp_size", 1)
        if not isinstance(size, int) or size < 1:
            raise EngineError(f"{url}/server_info gives tp_size {size!r}")
        self._on_cpu[url] = info.get("device") == "cpu"  # SGLang's --device, as its server_info shows it
        self._takes_flat[url] = takes_flattened_buckets(info.get("version"))
        return size

    def _build_group(self, layout: tuple[tuple[str, int], ...], dropped: dict[str, str],
                     launches: dict[str, int | None]) -> _Group | None:
        """Every lane's group (LANES for one engine, else one), formed one after the other. Engines that
        fail to join one are dropped, the lanes formed so far destroyed, and None is returned; a failure
        of the trainer's own side raises."""
        count = LANES if len(layout) == 1 else 1
        lanes: list[UpdateGroup] = []
        try:
            for _ in range(count):
                lane = self._form_lane(layout, dropped)
                if lane is None:
                    break
                lanes.append(lane)
        finally:
            if len(lanes) < count:
                self._destroy_lanes(lanes, [url for url, _ in layout if url not in dropped])
        return _Group(layout, tuple(lanes), launches) if len(lanes) == count else None

    def _form_lane(self, layout: tuple[tuple[str, int], ...], dropped: dict[str, str]) -> UpdateGroup | None:
        """Rank 0 here, engine i's ranks from 1 + the tp sizes before it."""
        name = f"slurmrl_weights_{os.getpid()}_{next(_GROUP_IDS)}"  # unique: a stale group never clashes
        engine = urlsplit(layout[0][0])
        if engine.hostname is None:
            raise EngineError(f"{layout[0][0]} names no host")
        address = route_address(engine.hostname, engine.port or 80)
        port = free_port(address)
        world_size = 1 + sum(tp for _, tp in layout)
        offsets = itertools.accumulate((tp for _, tp in layout[:-1]), initial=1)
        backend = "gloo" if any(self._on_cpu.get(url) for url, _ in layout) else self.backend
        bodies = {url: {"master_address": address, "master_port": port, "rank_offset": offset,
                        "world_size": world_size, "group_name": name, "backend": backend}
                  for (url, _), offset in zip(layout, offsets)}
        futures = self._engines.start(list(bodies), lambda url: self._engines.call(
            url, "/init_weights_update_group", bodies[url]))
        group, error = None, None
        try:
            group = create_group(address, port, 0, world_size, name, self.timeout_s, backend)
        except WeightSyncError as err:
            error = err
        joined, failed = self._engines.settle(futures)
        if not failed and group is not None:
            return group
        if group is not None:
            group.close()
        self._engines.on_all(list(joined), "/destroy_weights_update_group", {"group_name": name})
        if not failed:
            raise PublishError(f"the trainer could not form the weight update group: {error}")
        self._drop_engines(failed, dropped)
        return None

    def _send_buckets(self, version: int, group: _Group, weights: Weights,
                      dropped: dict[str, str]) -> tuple[list[str], int]:
        """The buckets broadcast to the group (trainer/bucket_broadcast.py); returns the members that
        took every bucket and the bytes sent; the version rides on the last bucket."""
        flattened = all(self._takes_flat.get(url, True) for url in group.engines)
        sent = broadcast_buckets(self._engines, group.lanes, group.engines, weights, self.bucket_bytes,
                                 version_to_wire(version), flattened)
        if sent.last is None:
            raise PublishError("no weights to publish")
        self._drop_engines({url: reason for url, reason in sent.failed.items() if reason}, dropped)
        taken = [url for url in group.engines if url not in dropped]
        if sent.broken or not sent.last:  # broke off early: those that took the buckets so far still lack the rest
            self._drop_engines({url: sent.broken or "the weight update broke off before its last bucket"
                                for url in taken}, dropped)
            return [], sent.nbytes
        return taken, sent.nbytes

    def _drop_group(self, dropped: dict[str, str] | None = None) -> None:
        """Close the trainer's side first (so engines blocked on it fail fast), then destroy it
        on the engines not dropped (those may hang, and are replaced anyway), best effort."""
        if self._group is None:
            return
        group, self._group = self._group, None
        self._destroy_lanes(group.lanes, [url for url in group.engines if url not in (dropped or {})])

    def _destroy_lanes(self, lanes: Sequence[UpdateGroup], alive: list[str]) -> None:
        for lane in lanes:
            lane.close()
        for lane in lanes:
            self._engines.on_all(alive, "/destroy_weights_update_group", {"group_name": lane.name})

