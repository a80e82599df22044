"""Weight publishing against real CPU engines on 127.0.0.1: over disk and over gloo (the CPU
form of the nccl transport), in several buckets, with engines that die, hang or answer errors.
Every check reads the weights back from the engines, so nothing passes unless they moved."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file

from contract.control_protocol import CallerFenced, ControlError
from rollout.launch import EngineLaunch, cpu_engine_command
from rollout.tiny_model import write_tiny_model
from rollout.weight_group import buckets
from tests.rollout import servers
from trainer import publish_tensor
from trainer.engine_fanout import SERVING_POLL_S, TAKEN_OUT
from trainer.publish import LANES, PublishResult, WeightPublisher

BUCKET = 64 * 1024  # the tiny model is about 320 KiB: several buckets (and disk shards)
AUTH = {"Authorization": f"Bearer {servers.API_KEY}"}
Tensors = list[tuple[str, torch.Tensor]]
TIMEOUT_S = 60.0  # the update's own bound, which a cut-off engine would hold a publish for
TAKEN_OUT_AFTER_S = 3.0  # until the supervisor no longer serves with the cut-off engine


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("publish") / "model")


@pytest.fixture(scope="module")
def base(model: Path) -> dict[str, torch.Tensor]:
    return load_file(model / "model.safetensors")


@pytest.fixture(scope="module")
def engines(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[servers.Server]]:
    logs = tmp_path_factory.mktemp("engine-logs")
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(servers.engine, model, logs / f"engine{i}.log") for i in range(2)]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        if len(started) < 2:
            raise next(f.exception() for f in futures if f.exception() is not None)
        yield started
    finally:
        for server in started:
            server.stop()


def shifted(base: dict[str, torch.Tensor], delta: float, dtype: torch.dtype = torch.float32) -> Tensors:
    """Every tensor + delta, in `dtype`: the new weights a training step would produce."""
    return [(name, (tensor + delta).to(dtype)) for name, tensor in sorted(base.items())]


def assert_serving(url: str, version: int, tensors: Tensors) -> None:
    info = requests.get(url + "/model_info", headers=AUTH, timeout=10).json()
    assert info["weight_version"] == str(version)  # a string on SGLang's wire
    for name, expected in tensors:
        got = requests.post(url + "/get_weights_by_name", json={"name": name, "truncate_size": 10**6},
                            headers=AUTH, timeout=10).json()
        assert torch.equal(torch.tensor(got, dtype=torch.float32), expected.float()), name


def timed(publisher: WeightPublisher, version: int, engines: list[str], weights) -> tuple[PublishResult, float]:
    start = time.monotonic()
    result = publisher.publish(version, engines, weights)
    return result, time.monotonic() - start


def visible_incomplete(weights_dir: Path) -> list[str]:
    """Version folders an engine could be pointed at that lack their index or config (one that
    vanished while being looked at was being removed, which hides it first)."""
    if not weights_dir.is_dir():
        return []
    return [e.name for e in weights_dir.iterdir() if not e.name.startswith(".")
            and not ((e / "model.safetensors.index.json").is_file() and (e / "config.json").is_file())
            and e.exists()]


def test_disk_publish_reaches_every_engine_and_keeps_the_last_versions(
        engines: list[servers.Server], model: Path, base: dict[str, torch.Tensor], tmp_path: Path) -> None:
    urls = [e.url for e in engines]
    weights_dir = tmp_path / "weights"
    publisher = WeightPublisher("disk", tmp_path, model, servers.API_KEY, bucket_bytes=BUCKET, keep_versions=2,
                                timeout_s=60)
    seen_incomplete: list[str] = []
    done = threading.Event()

    def watch() -> None:  # what a reader of the job dir could see while publishes run
        while not done.wait(0.002):
            seen_incomplete.extend(visible_incomplete(weights_dir))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        # 4 twice: a resumed run publishes a version again, and its folder is replaced.
        for version, delta, dtype in ((2, 0.01, torch.float32), (3, 0.02, torch.bfloat16),
                                      (4, 0.03, torch.float32), (4, 0.04, torch.float32)):
            weights = shifted(base, delta, dtype)
            result, seconds = timed(publisher, version, urls, iter(weights))
            assert result.updated == urls and result.dropped == {}
            assert result.bytes == sum(t.numel() * t.element_size() for _, t in weights)
            for url in urls:
                assert_serving(url, version, weights)
            print(f"disk publish {version}: {seconds:.3f} s for {result.bytes} bytes to 2 engines")
        with pytest.raises(RuntimeError, match="trainer failed"):  # the caller's weights break off
            publisher.publish(5, urls, (item if i < 5 else _fail() for i, item in enumerate(shifted(base, 0.05))))
    finally:
        done.set()
        watcher.join()
    assert seen_incomplete == []
    assert sorted(e.name for e in weights_dir.iterdir()) == ["3", "4"]  # no 5, no temporary folder
    shards = sorted(p.name for p in (weights_dir / "4").glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert {p.name for p in model.iterdir() if p.suffix != ".safetensors"} <= {p.name for p in (weights_dir / "4").iterdir()}


def _fail() -> tuple[str, torch.Tensor]:
    raise RuntimeError("trainer failed while gathering weights")


def test_dead_or_failing_engines_are_dropped_and_the_others_still_update(
        engines: list[servers.Server], model: Path, base: dict[str, torch.Tensor], tmp_path: Path) -> None:
    live = engines[0].url
    dead = f"http://127.0.0.1:{servers.free_port()}"  # nothing listens there
    failing = engines[1].url + "/no-such-prefix"  # a live server answering 404
    calls: list[tuple[str, str]] = []
    publisher = WeightPublisher("disk", tmp_path, model, servers.API_KEY, timeout_s=30,
                                on_drop=lambda url, reason: calls.append((url, reason)))
    weights = shifted(base, 0.06)
    result = publisher.publish(6, [dead, live, failing], iter(weights))
    assert result.updated == [live]
    assert set(result.dropped) == {dead, failing} and dict(calls) == result.dropped and len(calls) == 2
    assert "ConnectionError" in result.dropped[dead] and "404" in result.dropped[failing]
    assert all(servers.API_KEY not in reason for reason in result.dropped.values())
    assert_serving(live, 6, weights)


class _CutOff:
    """A listening socket that accepts and never answers: an engine whose node is cut off (its
    requests get no answer, no error, for as long as the cut lasts). Closed by the test."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.sock.close()


def test_an_engine_the_supervisor_took_out_is_not_waited_for(
        engines: list[servers.Server], model: Path, base: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """Supervised, the trainer stops waiting for an engine once the supervisor no longer serves with
    it, long before the update's own timeout; while the supervisor cannot say, it waits on."""
    live, cut = engines[0].url, _CutOff()
    serving = [live, cut.url]
    unanswered = {"asks": 0}

    def supervisor_says() -> list[str]:
        unanswered["asks"] += 1
        if unanswered["asks"] == 1:
            raise ControlError("no supervisor answers")  # ignored: asked again at the next look
        return list(serving)

    publisher = WeightPublisher("disk", tmp_path, model, servers.API_KEY, timeout_s=TIMEOUT_S, serving=supervisor_says)
    try:
        weights = shifted(base, 0.07)
        threading.Timer(TAKEN_OUT_AFTER_S, serving.remove, args=(cut.url,)).start()  # the supervisor's probes
        result, seconds = timed(publisher, 7, [live, cut.url], iter(weights))
    finally:
        cut.close()
    assert result.updated == [live] and result.dropped == {cut.url: TAKEN_OUT}, result
    assert TAKEN_OUT_AFTER_S <= seconds < TAKEN_OUT_AFTER_S + 3 * SERVING_POLL_S < TIMEOUT_S / 2, seconds
    assert unanswered["asks"] >= 2
    assert_serving(live, 7, weights)


def test_a_fenced_trainer_stops_waiting_and_publishes_nothing(model: Path, tmp_path: Path,
                                                              base: dict[str, torch.Tensor]) -> None:
    """The supervisor says a newer run of the job owns it: the publish raises at the next look (the
    trainer then exits as fenced) instead of waiting for the engine as for a silent supervisor."""
    cut = _CutOff()

    def fenced() -> list[str]:
        raise CallerFenced("a newer run of the job owns it")

    publisher = WeightPublisher("disk", tmp_path, model, servers.API_KEY, timeout_s=TIMEOUT_S, serving=fenced)
    try:
        began = time.monotonic()
        with pytest.raises(CallerFenced):
            publisher.publish(8, [cut.url], iter(shifted(base, 0.08)))
        assert time.monotonic() - began < 3 * SERVING_POLL_S < TIMEOUT_S / 2
    finally:
        cut.close()


# nccl: what a trainer on a GPU asks for; the CPU engines' /server_info says device cpu, so the
# group is gloo all the same (asked for nccl, they would never meet the trainer: it would wait).
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_gloo_publish_in_buckets_keeps_its_group(engines: list[servers.Server], model: Path,
                                                 base: dict[str, torch.Tensor], tmp_path: Path, backend: str) -> None:
    urls = [e.url for e in engines]
    publisher = WeightPublisher("nccl", tmp_path, model, servers.API_KEY, bucket_bytes=BUCKET, timeout_s=60,
                                backend=backend)
    try:
        names = []
        for version, delta, dtype in ((7, 0.07, torch.float32), (8, 0.08, torch.bfloat16),
                                      (9, 0.09, torch.float32)):
            weights = shifted(base, delta, dtype)
            result, seconds = timed(publisher, version, urls, iter(weights))
            assert result.updated == urls and result.dropped == {}
            for url in urls:
                assert_serving(url, version, weights)
            names.append(publisher.group_name)
            print(f"gloo publish {version}: {seconds:.3f} s for {result.bytes} bytes to 2 engines")
        assert publisher.group_engines == urls and names[0] is not None and names == [names[0]] * 3
        assert not (tmp_path / "weights").exists()  # nothing went through the disk
    finally:
        publisher.close()
    for url in urls:  # close() destroyed the group on every engine
        answer = requests.post(url + "/destroy_weights_update_group", json={"group_name": names[0]},
                               headers=AUTH, timeout=10)
        assert answer.status_code == 400


# 16 KiB is below the largest tensor (32 KiB, which then goes alone), 1 MiB holds the whole model.
@pytest.mark.parametrize("bucket_bytes", [16 * 1024, BUCKET, 1024**2])
def test_pipelined_publish_is_bit_exact_for_any_bucket_size(engines: list[servers.Server], model: Path,
                                                            base: dict[str, torch.Tensor], tmp_path: Path,
                                                            bucket_bytes: int) -> None:
    urls = [e.url for e in engines]
    publisher = WeightPublisher("nccl", tmp_path, model, servers.API_KEY, bucket_bytes=bucket_bytes, timeout_s=60,
                                backend="gloo")
    try:
        for version, dtype in ((21, torch.float32), (22, torch.bfloat16)):
            # Not a constant shift: noise, so a bucket landing on the wrong tensor cannot match by chance.
            generator = torch.Generator().manual_seed(version)
            weights = [(name, (tensor + torch.randn(tensor.shape, generator=generator)).to(dtype))
                       for name, tensor in sorted(base.items())]
            result = publisher.publish(version, urls, iter(weights))
            assert result.updated == urls and result.dropped == {}
            assert result.bytes == sum(t.numel() * t.element_size() for _, t in weights)
            for url in urls:
                assert_serving(url, version, weights)
    finally:
        publisher.close()


def publish_mixed_dtypes(publisher: WeightPublisher, urls: list[str], base: dict[str, torch.Tensor],
                         version: int) -> list[tuple[str, torch.Tensor]]:
    """fp32 and bf16 tensors, alternately (so buckets hold both), published as `version`; every engine serves
    them bit for bit. Returns them."""
    weights = [(name, (t + version / 100).to(torch.bfloat16 if i % 2 else torch.float32))
               for i, (name, t) in enumerate(sorted(base.items()))]
    result = publisher.publish(version, urls, iter(weights))
    assert result.updated == urls and result.dropped == {}
    for url in urls:
        assert_serving(url, version, weights)
    return weights


@pytest.mark.parametrize("sglang_version", [None, "0.5.5"])
def test_mixed_dtype_buckets_reach_engines_flattened_or_per_tensor(engines: list[servers.Server], model: Path,
                                                                   base: dict[str, torch.Tensor], tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   sglang_version: str | None) -> None:
    """fp32 and bf16 tensors in the same buckets reach real engines bit for bit: as flattened buckets
    (one broadcast each, the engine says so), or, when the engines say they are an SGLang older than
    that format (0.5.5), one broadcast per tensor."""
    urls = [e.url for e in engines]
    publisher = WeightPublisher("nccl", tmp_path, model, servers.API_KEY, bucket_bytes=BUCKET, timeout_s=60,
                                backend="gloo")
    call, answers = publisher._engines.call, []

    def as_version(url: str, route: str, body=None):
        answer = call(url, route, body)
        if route == "/server_info" and sglang_version:
            answer["version"] = sglang_version
        if route == "/update_weights_from_distributed":
            answers.append(answer["message"])
        return answer

    monkeypatch.setattr(publisher._engines, "call", as_version)
    try:
        publish_mixed_dtypes(publisher, urls, base, 31)
        assert len(answers) > 2 * 2 and all(("in one broadcast" in a) == (sglang_version is None) for a in answers)
    finally:
        publisher.close()


def test_tensor_publish_hands_the_engines_its_buckets_by_reference(engines: list[servers.Server], model: Path,
                                                                     base: dict[str, torch.Tensor],
                                                                     tmp_path: Path) -> None:
    """--update-weight-transport tensor on the CPU: each bucket (fp32 and bf16 tensors in the same
    ones) in shared memory through /update_weights_from_tensor, nothing on disk; a dead engine is
    dropped and the others still update; no shared-memory file outlives the publish."""
    urls = [e.url for e in engines]
    dead = f"http://127.0.0.1:{servers.free_port()}"  # nothing listens there
    shm_before = set(os.listdir("/dev/shm"))
    publisher = WeightPublisher("tensor", tmp_path, model, servers.API_KEY, bucket_bytes=BUCKET, timeout_s=30)
    for version, delta in ((40, 0.4), (41, 0.41)):
        weights = [(name, (t + delta).to(torch.bfloat16 if i % 2 else torch.float32))
                   for i, (name, t) in enumerate(sorted(base.items()))]
        result = publisher.publish(version, [*urls, dead], iter(weights))
        assert result.updated == urls and list(result.dropped) == [dead], result.dropped
        assert result.bytes == sum(t.numel() * t.element_size() for _, t in weights)
        for url in urls:
            assert_serving(url, version, weights)
    assert not (tmp_path / "weights").exists() or not any((tmp_path / "weights").iterdir())
    # Other processes of a parallel suite make and remove their own semaphores and CUDA files meanwhile.
    left = {name for name in set(os.listdir("/dev/shm")) - shm_before if not name.startswith(("sem.", "cuda.shm."))}
    assert left == set()


@pytest.mark.parametrize("sglang_version", [None, "0.5.5"])
def test_tensor_publish_sends_flattened_buckets_or_a_handle_per_tensor(engines: list[servers.Server], model: Path,
                                                                       base: dict[str, torch.Tensor], tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       sglang_version: str | None) -> None:
    """By reference, a bucket of fp32 and bf16 tensors goes as one flattened bucket per dtype (SGLang's form: one
    handle to map), or, to engines that say they are an SGLang older than that form (0.5.5), as one handle per
    tensor; either way the engines serve the weights bit for bit."""
    urls = [e.url for e in engines]
    publisher = WeightPublisher("tensor", tmp_path, model, servers.API_KEY, bucket_bytes=BUCKET, timeout_s=30)
    call, formats = publisher._engines.call, []

    def recorded(url: str, route: str, body=None):
        if route == "/update_weights_from_tensor" and url == urls[0]:
            formats.append((body["load_format"], body["weight_version"]))
        return call(url, route, body)

    monkeypatch.setattr(publisher._engines, "call", recorded)
    for url in urls:  # the stand-in's /server_info says it is that SGLang (null: its own version)
        requests.post(url + "/slurmrl_fault", json={"version": sglang_version}, headers=AUTH,
                      timeout=10).raise_for_status()
    try:
        weights = publish_mixed_dtypes(publisher, urls, base, 51)
    finally:
        for url in urls:
            requests.post(url + "/slurmrl_fault", json={"version": None}, headers=AUTH, timeout=10).raise_for_status()
    dtypes = [len({t.dtype for _, t in bucket}) for bucket, _ in buckets(iter(weights), BUCKET)]
    want = "flattened_bucket" if sglang_version is None else None
    assert {fmt for fmt, _ in formats} == {want} and [v for _, v in formats if v] == ["51"] and formats[-1][1] == "51"
    # a request per dtype of a bucket, or one per bucket
    assert len(formats) == (sum(dtypes) if sglang_version is None else len(dtypes)) and max(dtypes) == 2


PACK_BOUND_S = 10.0  # an engine's request waits at most this long for the next request's packing to begin


def test_tensor_publish_packs_the_next_request_while_the_engines_take_one(
        engines: list[servers.Server], model: Path, base: dict[str, torch.Tensor], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """By reference, pipelined: while the engines take request k, request k+1 is packed (each request
    here holds its answer back until that packing began, so a publish in lock step would fail); each
    engine still has one request at a time, at most two buffers are held, and the weights arrive bit for bit."""
    urls = [e.url for e in engines]
    publisher = WeightPublisher("tensor", tmp_path, model, servers.API_KEY, bucket_bytes=BUCKET, timeout_s=30)
    call, packs, overlapped = publisher._engines.call, [], []
    in_flight: dict[str, int] = dict.fromkeys(urls, 0)
    buffers, most_buffers, lock = [0], [0], threading.Lock()
    pack, shared_buffer = publish_tensor.flatten, publish_tensor.shared_buffer

    def counted_flatten(*args, **kwargs):
        packs.append(time.monotonic())
        return pack(*args, **kwargs)

    @contextlib.contextmanager
    def counted_buffer(*args, **kwargs):
        with lock:
            buffers[0] += 1
            most_buffers[0] = max(most_buffers[0], buffers[0])
        try:
            with shared_buffer(*args, **kwargs) as flat:
                yield flat
        finally:
            with lock:
                buffers[0] -= 1

    def held_back(url: str, route: str, body=None):
        if route != "/update_weights_from_tensor":
            return call(url, route, body)
        with lock:
            in_flight[url] += 1
            assert in_flight[url] == 1, f"two requests at once to {url}"
            packed_so_far = len(packs)
        try:
            answer = call(url, route, body)
            if body["weight_version"] is None and url == urls[0]:  # not the last: the next is being packed
                deadline = time.monotonic() + PACK_BOUND_S
                while len(packs) == packed_so_far and time.monotonic() < deadline:
                    time.sleep(0.005)  # polling the condition (the next packing began), bounded by PACK_BOUND_S
                overlapped.append(len(packs) > packed_so_far)
            return answer
        finally:
            with lock:
                in_flight[url] -= 1

    monkeypatch.setattr(publish_tensor, "flatten", counted_flatten)
    monkeypatch.setattr(publish_tensor, "shared_buffer", counted_buffer)
    monkeypatch.setattr(publisher._engines, "call", held_back)
    try:
        publish_mixed_dtypes(publisher, urls, base, 61)
    finally:
        publisher.close()
    assert len(overlapped) >= 3 and all(overlapped), overlapped
    assert most_buffers[0] == 2 and buffers[0] == 0


def relaunched(server: servers.Server, model: Path, log: Path) -> servers.Server:
    """`server` stopped and a new CPU engine started at its url (a supervisor's restart of it)."""
    server.stop()
    port = int(server.url.rsplit(":", 1)[1])
    return servers.start(cpu_engine_command(EngineLaunch(str(model), "127.0.0.1", port, api_key=servers.API_KEY,
                                                         weight_version=1)), server.url, log, "/health")


def test_an_engine_relaunched_at_its_url_gets_the_group_formed_again(engines: list[servers.Server], model: Path,
                                                                     base: dict[str, torch.Tensor],
                                                                     tmp_path: Path) -> None:
    """A supervisor's restart keeps an engine's url, and the new process is not in the kept update group.
    Told (the supervisor's launch count moved), the publisher forms the group again and every engine takes
    the version. (Not told, the relaunched engine failed its bucket with "no group", and the healthy one
    was dropped with it when the broadcast broke off.)"""
    a = engines[0].url
    own = servers.engine(model, tmp_path / "own.log")
    launches = {a: 0, own.url: 0}
    publisher = WeightPublisher("nccl", tmp_path, model, servers.API_KEY, bucket_bytes=BUCKET,
                                timeout_s=30, backend="gloo", launches=lambda: launches)
    try:
        assert publisher.publish(71, [a, own.url], iter(shifted(base, 0.71))).updated == [a, own.url]
        first = publisher.group_name
        own = relaunched(own, model, tmp_path / "own2.log")
        launches[own.url] += 1
        weights = shifted(base, 0.72)
        result = publisher.publish(72, [a, own.url], iter(weights))
        assert result.updated == [a, own.url] and result.dropped == {} and publisher.group_name != first
        assert_serving(own.url, 72, weights)
    finally:
        publisher.close()
        own.stop()


def stop_process_at(weights: Tensors, index: int, pid: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights, freezing an engine (SIGSTOP) once the publisher asks for tensor `index`:
    mid-publish, after some buckets went out."""
    for i, item in enumerate(weights):
        if i == index:
            os.kill(pid, signal.SIGSTOP)
        yield item


def test_gloo_survives_hung_dead_and_replaced_engines(engines: list[servers.Server], model: Path,
                                                      base: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """Last in the file: it freezes the second module engine for good."""
    timeout = 5.0
    (a, b), hung = (e.url for e in engines), engines[1]
    dropped: list[str] = []
    publisher = WeightPublisher("nccl", tmp_path, model, servers.API_KEY, bucket_bytes=BUCKET, timeout_s=timeout,
                                backend="gloo", on_drop=lambda url, reason: dropped.append(url))
    fresh = None
    try:
        # Frozen mid-broadcast: bounded by the timeout, the engine is dropped, the group dropped.
        weights = shifted(base, 0.11)
        stream = stop_process_at(weights, len(weights) // 2, hung.proc.pid)
        result, seconds = timed(publisher, 11, [a, b], stream)
        print(f"gloo publish with an engine frozen mid-broadcast: {seconds:.1f} s, dropped {result.dropped}")
        assert b in result.dropped and dropped == list(result.dropped)
        assert seconds < 2 * timeout and publisher.group_engines == []
        assert next(stream, None) is None  # drawn to the end all the same: gathering it is collective

        # The next publish, without it, works.
        weights = shifted(base, 0.12)
        result = publisher.publish(12, [a], iter(weights))
        assert result.updated == [a], result.dropped
        assert_serving(a, 12, weights)
        alone = publisher.group_name
        assert publisher._group is not None and len(publisher._group.lanes) == LANES  # one engine: its lanes

        # A freshly started engine replaces it: the group is rebuilt around the new set.
        fresh = servers.engine(model, tmp_path / "fresh.log")
        weights = shifted(base, 0.13, torch.bfloat16)
        result = publisher.publish(13, [a, fresh.url], iter(weights))
        assert result.updated == [a, fresh.url] and publisher.group_engines == [a, fresh.url]
        assert publisher.group_name != alone
        # two engines could take two lanes' requests in different orders: one lane
        assert publisher._group is not None and len(publisher._group.lanes) == 1
        for url in (a, fresh.url):
            assert_serving(url, 13, weights)

        # Dead before the publish: dropped at once, the other still updated.
        fresh.stop()
        weights = shifted(base, 0.14)
        result, seconds = timed(publisher, 14, [a, fresh.url], iter(weights))
        assert result.updated == [a] and list(result.dropped) == [fresh.url] and seconds < timeout
        assert_serving(a, 14, weights)

        # No engine left: nothing is sent, yet every tensor is still drawn.
        stream = iter(shifted(base, 0.15))
        result = publisher.publish(15, [fresh.url], stream)
        assert result.updated == [] and list(result.dropped) == [fresh.url] and next(stream, None) is None
    finally:
        os.kill(hung.proc.pid, signal.SIGCONT)
        publisher.close()
        if fresh is not None:
            fresh.stop()
