"""Publishing new weights from trainer rank 0 to every ready engine as version v.

Two transports, named as slime names them:
- disk: an HF safetensors folder JOB/weights/<version>/, built in a hidden temporary folder and
  renamed into place, then POST /update_weights_from_disk to every engine at once.
- nccl: one process group of the trainer (rank 0) and every engine rank, kept across publishes
  while the engine set is unchanged; tensors are broadcast bucket by bucket between
  /begin_weight_update and /end_weight_update. Without a GPU it runs on gloo, as the CPU engine does.

An engine whose update fails or times out is fenced: reported, handed to on_fence and left out,
while the others still get the version. Every wait is bounded by timeout_s. The API key only
ever travels in the Authorization header: it is never printed, logged or put in a reason.
"""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import requests
import torch
import torch.distributed as dist

from ckpt_tools.convert import HF_SIDE_FILES
from ckpt_tools.safetensors_stream import StreamingSafetensorsWriter
from ckpt_tools.torch_dist import fsync_dir
from rollout.cpu_engine.weight_sync import UpdateGroup, WeightSyncError, create_group

DEFAULT_BUCKET_BYTES = 512 * 1024**2  # --update-weight-buffer-size
Transport = Literal["disk", "nccl"]
Weights = Iterable[tuple[str, torch.Tensor]]
OnFence = Callable[[str, str], None]
# Read once, by ProcessGroupNCCL's constructor. By default (3, SkipCleanUp) a broadcast to a hung
# engine that times out takes the whole trainer down; 2 (CleanUpOnly) aborts only this group.
# (Seen on 2 H200s, torch 2.11: the trainer lives; the abort still waits about 60 s for the
# flight recorder's dump.)
_NCCL_GROUP_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
_PARTIAL = ".partial-"  # marks a hidden folder still being written (or being removed)


class PublishError(Exception):
    """The trainer's side of a publish failed; no engine got the version."""


class EngineError(Exception):
    """One engine failed a call; the message is the reason it is fenced."""


@dataclass
class PublishResult:
    version: str
    updated: list[str]  # engines that now serve `version`
    fenced: dict[str, str]  # url -> reason
    seconds: float
    bytes: int


@dataclass
class _Group:
    """The update group and the engines in it, in rank order, with their tp sizes."""

    layout: tuple[tuple[str, int], ...]
    group: UpdateGroup

    @property
    def engines(self) -> list[str]:
        return [url for url, _ in self.layout]


class _Engines:
    """HTTP calls to engines, one thread each so they run at once, each bounded by the timeout."""

    def __init__(self, api_key: str | None, timeout_s: float) -> None:
        # requests quotes a header value it refuses in its error text: refuse such a key here, unquoted.
        if api_key is not None and (not api_key.isprintable() or any(c.isspace() for c in api_key)):
            raise ValueError("the API key holds whitespace or control characters")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s

    def call(self, url: str, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """GET (no body) or POST; the JSON answer, or EngineError on anything but a success."""
        try:
            if body is None:
                response = requests.get(url + route, headers=self._headers, timeout=self.timeout_s)
            else:
                response = requests.post(url + route, json=body, headers=self._headers, timeout=self.timeout_s)
        except requests.RequestException as err:  # its text names the url, never the headers
            raise EngineError(f"{route} failed: {type(err).__name__}: {err}") from None
        try:
            answer = response.json()
        except ValueError:
            answer = None
        if response.status_code != 200 or not isinstance(answer, dict) or answer.get("success") is False:
            detail = answer.get("message", answer) if isinstance(answer, dict) else response.text[:300]
            raise EngineError(f"{route} answered {response.status_code}: {detail}")
        return answer

    def start(self, urls: list[str], fn: Callable[[str], Any]) -> dict[str, Future]:
        pool = ThreadPoolExecutor(max_workers=max(len(urls), 1))
        futures = {url: pool.submit(fn, url) for url in urls}
        pool.shutdown(wait=False)  # each thread ends with its call, which the timeout bounds
        return futures

    @staticmethod
    def settle(futures: dict[str, Future]) -> tuple[dict[str, Any], dict[str, str]]:
        """(url -> answer for the successes, url -> reason for the failures)."""
        done, failed = {}, {}
        for url, future in futures.items():
            try:
                done[url] = future.result()
            except EngineError as err:
                failed[url] = str(err)
        return done, failed

    def start_call(self, urls: list[str], route: str, body: dict[str, Any] | None = None) -> dict[str, Future]:
        return self.start(urls, lambda url: self.call(url, route, body))

    def on_all(self, urls: list[str], route: str, body: dict[str, Any] | None = None
               ) -> tuple[dict[str, Any], dict[str, str]]:
        return self.settle(self.start_call(urls, route, body))


class WeightPublisher:
    """Publishes trainer rank 0's full HF-named weights to engines; see the module docstring.

    bucket_bytes bounds one broadcast bucket (nccl) and one safetensors shard (disk); timeout_s
    bounds every single wait; on_fence(url, reason) is called once per fenced engine, as soon as
    it is fenced. Call close() when done, to destroy the update group."""

    def __init__(self, transport: Transport, job_dir: Path, hf_checkpoint: Path, api_key: str | None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, keep_versions: int = 3, timeout_s: float = 600.0,
                 on_fence: OnFence | None = None, backend: Literal["nccl", "gloo"] | None = None) -> None:
        if transport not in ("disk", "nccl"):
            raise ValueError(f"transport must be disk or nccl, got {transport!r}")
        if bucket_bytes <= 0 or keep_versions < 1 or timeout_s <= 0:
            raise ValueError("bucket_bytes and timeout_s must be positive and keep_versions at least 1")
        self.transport = transport
        self.weights_dir = Path(job_dir) / "weights"
        self.hf_checkpoint = Path(hf_checkpoint)
        self.bucket_bytes = bucket_bytes
        self.keep_versions = keep_versions
        self.timeout_s = timeout_s
        self.on_fence = on_fence or (lambda url, reason: None)
        # NCCL needs the trainer's GPU; SGLang engines join with nccl, CPU engines with gloo.
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self._engines = _Engines(api_key, timeout_s)
        self._group: _Group | None = None
        self._group_ids = itertools.count(1)

    @property
    def group_engines(self) -> list[str]:
        """The engines in the current update group (nccl), in rank order; empty when there is none."""
        return self._group.engines if self._group else []

    @property
    def group_name(self) -> str | None:
        return self._group.group.name if self._group else None

    def publish(self, version: str, engines: list[str], weights: Weights) -> PublishResult:
        if not version or "/" in version or version.startswith("."):
            raise ValueError(f"weight version {version!r} cannot name a folder")
        start = time.monotonic()
        fenced: dict[str, str] = {}
        weights = iter(weights)
        try:
            if self.transport == "disk":
                updated, nbytes = self._publish_disk(version, list(engines), weights, fenced)
            else:
                updated, nbytes = self._publish_distributed(version, list(engines), weights, fenced)
        finally:
            for _ in weights:  # whatever was not sent is still drawn: the other ranks gather it with us
                pass
        updated = self._verify(version, updated, fenced)
        return PublishResult(version, updated, fenced, time.monotonic() - start, nbytes)

    def close(self) -> None:
        """Destroy the update group on the engines and here."""
        self._drop_group()

    def _fence(self, failed: dict[str, str], fenced: dict[str, str]) -> None:
        for url, reason in failed.items():
            if url not in fenced:
                fenced[url] = reason
                self.on_fence(url, reason)

    def _verify(self, version: str, engines: list[str], fenced: dict[str, str]) -> list[str]:
        """Fence every engine whose /model_info does not name the new version."""
        infos, failed = self._engines.on_all(engines, "/model_info")
        for url, info in infos.items():
            if info.get("weight_version") != version:
                failed[url] = f"/model_info says weight_version {info.get('weight_version')!r}, expected {version!r}"
        self._fence(failed, fenced)
        return [url for url in engines if url not in fenced]

    # ---- disk ----

    def _publish_disk(self, version: str, engines: list[str], weights: Weights,
                      fenced: dict[str, str]) -> tuple[list[str], int]:
        folder, nbytes = self._write_folder(version, weights)
        done, failed = self._engines.on_all(engines, "/update_weights_from_disk",
                                            {"model_path": str(folder), "weight_version": version})
        self._fence(failed, fenced)
        self._prune(folder)
        return [url for url in engines if url in done], nbytes

    def _write_folder(self, version: str, weights: Weights) -> tuple[Path, int]:
        """JOB/weights/<version>: safetensors shards of bucket_bytes with their index, and the
        config and tokenizer of the HF checkpoint. It appears only once complete."""
        # Held whole (on the CPU): the writer plans every shard's header before its first byte.
        tensors = [(name, tensor.detach().cpu()) for name, tensor in weights]
        if not tensors:
            raise PublishError("no weights to publish")
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{version}{_PARTIAL}", dir=self.weights_dir))
        try:
            writer = StreamingSafetensorsWriter(tmp, [(n, tuple(t.shape), t.dtype) for n, t in tensors],
                                                self.bucket_bytes)
            for name, tensor in tensors:
                writer.write(name, tensor)
            writer.close()
            for side in HF_SIDE_FILES:
                if (self.hf_checkpoint / side).is_file():
                    shutil.copy2(self.hf_checkpoint / side, tmp / side)
            fsync_dir(tmp)
            final = self._move_into_place(tmp, version)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final, writer.total_bytes

    def _move_into_place(self, tmp: Path, version: str) -> Path:
        """Rename the finished folder in; a folder of the same version (a resumed run publishing
        it again) is removed first, as rename cannot replace a full folder."""
        final = self.weights_dir / version
        if final.exists():
            self._remove(final)
        os.rename(tmp, final)
        fsync_dir(self.weights_dir)
        return final

    def _prune(self, current: Path) -> None:
        """Keep the newest keep_versions folders (current among them); drop what a publisher
        that died mid-write left behind."""
        entries = list(self.weights_dir.iterdir())
        for entry in entries:
            if entry.name.startswith(".") and _PARTIAL in entry.name:
                shutil.rmtree(entry, ignore_errors=True)
        versions = sorted((e for e in entries if e.is_dir() and not e.name.startswith(".") and e != current),
                          key=lambda e: e.stat().st_mtime_ns, reverse=True)
        for old in versions[self.keep_versions - 1:]:
            self._remove(old)

    def _remove(self, folder: Path) -> None:
        """Hide the folder first, so nobody sees it half deleted."""
        hidden = tempfile.mkdtemp(prefix=f".{folder.name}{_PARTIAL}", dir=self.weights_dir)
        os.rename(folder, hidden)  # onto an empty folder, which rename may replace
        shutil.rmtree(hidden, ignore_errors=True)

    # ---- nccl (gloo on CPU) ----

    def _publish_distributed(self, version: str, engines: list[str], weights: Weights,
                             fenced: dict[str, str]) -> tuple[list[str], int]:
        group = self._ready_group(engines, fenced)
        if group is None:
            return [], 0
        members = group.engines
        try:
            done, nbytes = self._send_buckets(version, group, weights, fenced)
        finally:  # even when the caller's weights fail: engines must not stay held
            ending = self._engines.start_call(members, "/end_weight_update", {})
        # A fenced engine is ended too, in case it lives, but not waited for: it may hang.
        _, end_failed = self._engines.settle({url: f for url, f in ending.items() if url not in fenced})
        self._fence({url: reason for url, reason in end_failed.items() if url in done}, fenced)
        if any(url in fenced for url in members):
            self._drop_group(fenced)  # a member failed: the group may hang; the next publish rebuilds it
        return [url for url in members if url not in fenced], nbytes

    def _ready_group(self, engines: list[str], fenced: dict[str, str]) -> _Group | None:
        """The group of the live engines with the update begun on each. An engine failing on the
        way is fenced and the group rebuilt without it; each round drops one, so this ends."""
        while engines:
            tp_sizes, failed = self._engines.settle(self._engines.start(engines, self._tp_size))
            self._fence(failed, fenced)
            layout = tuple((url, tp_sizes[url]) for url in engines if url in tp_sizes)
            if not layout:
                return None
            if self._group is None or self._group.layout != layout:
                self._drop_group(fenced)
                self._group = self._build_group(layout, fenced)
                if self._group is None:
                    engines = [url for url, _ in layout if url not in fenced]
                    continue
            begun, failed = self._engines.on_all(self._group.engines, "/begin_weight_update", {"selector": "all"})
            if not failed:
                return self._group
            self._fence(failed, fenced)
            self._engines.on_all(list(begun), "/end_weight_update", {})
            self._drop_group(fenced)
            engines = list(begun)
        return None

    def _tp_size(self, url: str) -> int:
        size = self._engines.call(url, "/server_info").get("tp_size", 1)
        if not isinstance(size, int) or size < 1:
            raise EngineError(f"/server_info gives tp_size {size!r}")
        return size

    def _build_group(self, layout: tuple[tuple[str, int], ...], fenced: dict[str, str]) -> _Group | None:
        """Rank 0 here, engine i's ranks from 1 + the tp sizes before it. Engines that fail to
        join are fenced and None is returned; a failure of the trainer's own side raises."""
        name = f"slurmrl_weights_{os.getpid()}_{next(self._group_ids)}"  # unique: a stale group never clashes
        address = _address_towards(layout[0][0])
        port = _free_port(address)
        world_size = 1 + sum(tp for _, tp in layout)
        offsets = itertools.accumulate((tp for _, tp in layout[:-1]), initial=1)
        bodies = {url: {"master_address": address, "master_port": port, "rank_offset": offset,
                        "world_size": world_size, "group_name": name, "backend": self.backend}
                  for (url, _), offset in zip(layout, offsets)}
        futures = self._engines.start(list(bodies), lambda url: self._engines.call(
            url, "/init_weights_update_group", bodies[url]))
        group, error = None, None
        try:
            group = self._join(address, port, world_size, name)
        except (WeightSyncError, RuntimeError) as err:
            error = err
        joined, failed = self._engines.settle(futures)
        if not failed and group is not None:
            return _Group(layout, group)
        if group is not None:
            _release(group)
        self._engines.on_all(list(joined), "/destroy_weights_update_group", {"group_name": name})
        if not failed:
            raise PublishError(f"the trainer could not form the weight update group: {error}")
        self._fence(failed, fenced)
        return None

    def _join(self, address: str, port: int, world_size: int, name: str) -> UpdateGroup:
        if self.backend == "gloo":
            return create_group(address, port, 0, world_size, name, self.timeout_s)
        return _create_nccl_group(address, port, world_size, name, self.timeout_s)

    def _send_buckets(self, version: str, group: _Group, weights: Weights,
                      fenced: dict[str, str]) -> tuple[list[str], int]:
        """Broadcast bucket by bucket while every member receives it; returns the members that
        took every bucket and the bytes sent. The version (and cache flush) ride on the last."""
        members, nbytes, last = group.engines, 0, None
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        for bucket, last in _buckets(weights, self.bucket_bytes):
            tensors = [tensor.detach().to(device).contiguous() for _, tensor in bucket]
            body = {"names": [name for name, _ in bucket],
                    "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
                    "shapes": [list(t.shape) for t in tensors], "group_name": group.group.name,
                    "flush_cache": last, "weight_version": version if last else None}
            futures = self._engines.start_call(members, "/update_weights_from_distributed", body)
            broken = self._broadcast(group.group, tensors)
            done, failed = self._engines.settle(futures)
            nbytes += sum(t.numel() * t.element_size() for t in tensors)
            failed.update({url: broken for url in members if broken and url not in done and url not in failed})
            self._fence(failed, fenced)
            members = [url for url in members if url in done]
            if broken or not members:
                break
        if last is None:
            raise PublishError("no weights to publish")
        if not last:  # broke off early: those that took the buckets so far still lack the rest
            self._fence({url: "the weight update broke off before its last bucket" for url in members}, fenced)
            return [], nbytes
        return members, nbytes

    def _broadcast(self, group: UpdateGroup, tensors: list[torch.Tensor]) -> str | None:
        """Send each tensor from rank 0, each wait bounded; the reason it broke off, or None."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        try:
            for tensor in tensors:
                group.pg.broadcast([tensor], options).wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as err:
            return f"the weight broadcast broke off: {err}"
        return None

    def _drop_group(self, fenced: dict[str, str] | None = None) -> None:
        """Close the trainer's side first (so engines blocked on it fail fast), then destroy it
        on the engines not fenced (those may hang, and are replaced anyway), best effort."""
        if self._group is None:
            return
        group, self._group = self._group, None
        _release(group.group)
        alive = [url for url in group.engines if url not in (fenced or {})]
        self._engines.on_all(alive, "/destroy_weights_update_group", {"group_name": group.group.name})


def _buckets(weights: Weights, bucket_bytes: int) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
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


def _release(group: UpdateGroup) -> None:
    """Shut the group down and let go of its process group now: only its destruction closes
    gloo's connections, which is what wakes engines still blocked on a broadcast (else they wait
    for their own, longer, timeout while holding their group lock)."""
    if isinstance(group.pg, dist.ProcessGroupGloo):
        group.close()
    else:  # NCCL's shutdown waits for the collective a hung engine never finishes: abort it
        group.pg.abort()
    group.pg = None  # type: ignore[assignment]


def _create_nccl_group(address: str, port: int, world_size: int, name: str, timeout_s: float) -> UpdateGroup:
    """Rank 0 of an NCCL group that SGLang's init_custom_process_group joins: the same TCPStore
    and the same key prefixes (group name, then 'name/', then the device 'cuda/')."""
    timeout = timedelta(seconds=timeout_s)
    tcp = dist.TCPStore(address, port, world_size, is_master=True, timeout=timeout, multi_tenant=True)
    store = dist.PrefixStore("cuda/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, tcp)))
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    options.is_high_priority_stream = False
    with _environ(_NCCL_GROUP_ENV):
        pg = dist.ProcessGroupNCCL(store, 0, world_size, options)
    return UpdateGroup(name=name, rank=0, world_size=world_size, store=tcp, pg=pg)


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


def _address_towards(url: str) -> str:
    """This host's address on the route to an engine, which the engine can dial back."""
    parts = urlsplit(url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((parts.hostname, parts.port or 80))  # UDP: picks the route, sends nothing
        return probe.getsockname()[0]


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]
