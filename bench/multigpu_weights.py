"""Part 2 of bench_multi_gpu: a weight update over NCCL from a one-rank trainer (this process, GPU 0)
to N engine-side processes (bench/multigpu_engine.py, engine i on GPU 1 + i: N + 1 GPUs), through the
real publisher, pipelined (trainer/publish.py: two buckets in flight, every broadcast queued before a wait;
/init_weights_update_group, /begin_weight_update, bucketed broadcasts with
/update_weights_from_distributed, /end_weight_update, /model_info) and update group
(rollout/weight_group.py); against a plain broadcast of the same bytes, as one flat buffer, over
an update group of the same processes, in the same run: ratio_vs_plain (the goal: >= 0.85). The
publisher sends a bucket as one flattened broadcast (SGLang's load_format "flattened_bucket"); the
same publish with one broadcast per tensor (the engines then say they are SGLang 0.5.5, which takes
only that) is timed too, the two alternating: per_tensor_publish_s, flattened_speedup. On the CPU every side uses gloo.
"""

from __future__ import annotations

import cProfile
import io
import itertools
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import requests
import torch

from bench.publish_timeline import traced_publish
from rollout.engine_client import EngineClient
from rollout.weight_group import create_group, free_port
from trainer.publish import DEFAULT_BUCKET_BYTES, WeightPublisher

ENGINE_START_S = 120.0  # the engine process imports torch and allocates its parameters
CALL_TIMEOUT_S = 300.0  # every engine call and broadcast of the bench


def qwen3_params(shape: dict) -> dict[str, list[int]]:
    """HF Qwen3 parameter names and shapes (tied embeddings: no lm_head)."""
    h, hq = shape["hidden_size"], shape["num_attention_heads"] * shape["head_dim"]
    hkv, ffn, d = shape["num_key_value_heads"] * shape["head_dim"], shape["intermediate_size"], shape["head_dim"]
    out = {"model.embed_tokens.weight": [shape["vocab_size"], h], "model.norm.weight": [h]}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": [hq, h], p + "self_attn.k_proj.weight": [hkv, h],
                    p + "self_attn.v_proj.weight": [hkv, h], p + "self_attn.o_proj.weight": [h, hq],
                    p + "self_attn.q_norm.weight": [d], p + "self_attn.k_norm.weight": [d],
                    p + "mlp.gate_proj.weight": [ffn, h], p + "mlp.up_proj.weight": [ffn, h],
                    p + "mlp.down_proj.weight": [h, ffn], p + "input_layernorm.weight": [h],
                    p + "post_attention_layernorm.weight": [h]})
    return out


def start_engine(port: int, args: list[str], gpu: int | None, log: Path) -> subprocess.Popen:
    """The engine-side process on `gpu` (None: the CPU), once it answers /health."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    proc = subprocess.Popen([sys.executable, "-m", "bench.multigpu_engine", "--port", str(port), *args], env=env,
                            stdout=log.open("a"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + ENGINE_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the engine process exited ({proc.returncode}); see {log}")
        try:
            requests.get(f"http://127.0.0.1:{port}/health", timeout=2).raise_for_status()
            return proc
        except requests.RequestException:
            time.sleep(0.2)  # polling the condition (it answers), bounded by ENGINE_START_S
    stop_engine(proc)
    raise RuntimeError(f"the engine did not answer within {ENGINE_START_S:g} s; see {log}")


def stop_engine(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def post(url: str, route: str, body: dict) -> dict:
    answer = requests.post(url + route, json=body, timeout=CALL_TIMEOUT_S)
    answer.raise_for_status()
    return answer.json()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def plain_broadcast_seconds(urls: list[str], backend: str, nbytes: int, repeats: int, device: torch.device) -> float:
    """Mean seconds of one plain broadcast of nbytes (one flat buffer) over a fresh group of this
    process and the engines."""
    name, port, world = f"bench_plain_{os.getpid()}", free_port("127.0.0.1"), 1 + len(urls)
    joins = [threading.Thread(target=post, args=(url, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1 + i, "world_size": world,
        "group_name": name})) for i, url in enumerate(urls)]
    for join in joins:
        join.start()
    group = create_group("127.0.0.1", port, 0, world, name, CALL_TIMEOUT_S, backend)
    for join in joins:
        join.join()
    flat = torch.ones(nbytes, dtype=torch.uint8, device=device)
    try:
        timings = []
        for count in (1, repeats):  # a warm-up round, then the timed one
            receivers = [threading.Thread(target=post, args=(url, "/bench_broadcast", {
                "group_name": name, "nbytes": nbytes, "repeats": count})) for url in urls]
            for receiver in receivers:
                receiver.start()
            _sync()
            began = time.perf_counter()
            for _ in range(count):
                group.broadcast(flat)
            _sync()
            timings.append((time.perf_counter() - began) / count)
            for receiver in receivers:
                receiver.join()
        return timings[-1]
    finally:
        for url in urls:
            post(url, "/destroy_weights_update_group", {"group_name": name})
        group.close()


# Engine calls a publish waits for in turn besides its buckets: /begin_weight_update, then /end_weight_update with
# /model_info beside it (trainer/publish.py; a kept group's /server_info is not asked again).
FIXED_CALLS = 2


def serial_calls(engines: int, buckets: int) -> int:
    """The engine calls a publish waits for in turn. One engine has lanes: its next bucket's request is on its way
    while it takes one, and only the last (asked once every other was answered) is waited for; several engines share
    one lane, and every bucket's request follows the answer to the one before."""
    return FIXED_CALLS + (1 if engines == 1 else buckets)


def engine_call_seconds(url: str, count: int = 50, api_key: str | None = None) -> float:
    """The median seconds of one engine call as the publisher makes it (GET /model_info), after a warm-up."""
    client = EngineClient(api_key, CALL_TIMEOUT_S)
    timings = []
    for _ in range(count + 5):
        began = time.perf_counter()
        client.call(url, "/model_info")
        timings.append(time.perf_counter() - began)
    return statistics.median(timings[5:])


def profiled(run: Callable[[], object], path: Path) -> None:
    """run() (a publish) twice: once traced (bench/publish_timeline.py), once under cProfile; the timeline and
    the 40 costliest functions, by cumulative and by own time, written to path."""
    text = io.StringIO()
    text.write(traced_publish(run))
    profile = cProfile.Profile()
    profile.runcall(run)
    for order in ("cumulative", "tottime"):
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(40)
    path.write_text(text.getvalue())


def bench_model(label: str, shape: dict, repeats: int, gpus: int, work: Path, bucket_bytes: int,
                engines: int, profile_to: Path | None = None) -> dict:
    params = qwen3_params(shape)
    shapes_file = work / f"{label}.json"
    shapes_file.write_text(json.dumps({name: ["bfloat16", s] for name, s in params.items()}))
    device = torch.device("cuda", 0) if gpus else torch.device("cpu")
    gen = torch.Generator(device=device).manual_seed(0)
    weights = {name: torch.randn(s, generator=gen, device=device, dtype=torch.bfloat16) for name, s in params.items()}
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    ports = [free_port("127.0.0.1") for _ in range(engines)]
    publisher = WeightPublisher("nccl", work / label, work / label, None, bucket_bytes=bucket_bytes,
                                timeout_s=CALL_TIMEOUT_S)
    procs = []
    try:
        for i, port in enumerate(ports):
            procs.append(start_engine(port, ["--param-shapes", str(shapes_file)], 1 + i if gpus else None,
                                      work / f"engine{i}.log"))
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        want = sum(float(t.float().sum()) for t in weights.values())

        times: list[float] = []
        per_tensor_times: list[float] = []
        engine_side: list[list[tuple[float, float]]] = []  # engine 0's (receive, load) per bucket, each flat publish
        equal = True
        for _ in range(repeats + 1):  # the first publish also forms the group; the two forms alternate
            for sglang_version, timings in ((None, times), ("0.5.5", per_tensor_times)):
                for url in urls:  # "0.5.5": an SGLang older than flattened buckets, sent one broadcast per tensor
                    post(url, "/bench_sglang_version", {"version": sglang_version})
                    post(url, "/bench_bucket_seconds", {})
                _sync()
                result = publisher.publish(len(times) + len(per_tensor_times) + 1, urls, iter(weights.items()))
                if result.updated != urls:
                    raise RuntimeError(f"engines were dropped: {result.dropped}")
                timings.append(result.seconds)
                if sglang_version is None:
                    engine_side.append(post(urls[0], "/bench_bucket_seconds", {})["buckets"])
                checksums = [post(url, "/bench_checksum", {})["checksum"] for url in urls]
                equal = equal and all(abs(c - want) <= 1e-3 * max(1.0, abs(want)) for c in checksums)
        if profile_to is not None:  # more steady publishes, their trainer side profiled
            versions = itertools.count(len(times) + len(per_tensor_times) + 1)
            profiled(lambda: publisher.publish(next(versions), urls, iter(weights.items())),
                     profile_to / f"profile_publish_{label}.txt")
        publisher.close()
        plain = plain_broadcast_seconds(urls, publisher.backend, nbytes, repeats, device)
        call_s = engine_call_seconds(urls[0])
    finally:
        publisher.close()
        for proc in procs:
            stop_engine(proc)
    steady, per_tensor = statistics.median(times[1:]), statistics.median(per_tensor_times[1:])
    received = statistics.median(sum(r for r, _ in buckets) for buckets in engine_side[1:])
    loaded = statistics.median(sum(load for _, load in buckets) for buckets in engine_side[1:])
    calls = serial_calls(engines, len(engine_side[-1]))
    return {"model": label, "bytes": nbytes, "tensors": len(weights), "bucket_bytes": bucket_bytes,
            "engines": engines, "backend": publisher.backend, "first_publish_s": times[0], "publish_s": steady,
            "publish_gbps": nbytes / steady / 1e9, "plain_broadcast_s": plain, "plain_gbps": nbytes / plain / 1e9,
            "ratio_vs_plain": plain / steady, "per_tensor_publish_s": per_tensor,
            "per_tensor_ratio_vs_plain": plain / per_tensor, "flattened_speedup": per_tensor / steady,
            "checksum_equal": equal, "all_publish_s": times,
            # Where a flattened publish's time goes (engine 0, steady state): the engine's HTTP calls in
            # turn (each timed alone: call_s), each bucket received off the wire, then loaded, and what is
            # left: the trainer's own work not overlapped, and waits
            "buckets": len(engine_side[-1]), "call_s": call_s, "serial_calls": calls,
            "engine_receive_s": received, "engine_load_s": loaded,
            "unexplained_s": steady - calls * call_s - received - loaded,
            # The best a publish can do under SGLang's contract (between begin and end, each bucket a request
            # the engine takes one at a time and answers once loaded): the wire's time, every load (no bucket
            # arrives while one loads) and the calls in turn
            "contract_bound_s": (bound := plain + loaded + calls * call_s),
            "contract_bound_ratio": plain / bound,
            "all_per_tensor_publish_s": per_tensor_times}


def run(shapes: dict[str, dict], repeats: int, out: Path, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        engines: int = 1, profile: bool = False) -> list[dict]:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and engines > gpus - 1:  # NCCL refuses two ranks of one group on one GPU (it hangs at the group's start)
        raise SystemExit(f"{engines} engine(s) need {engines + 1} GPUs, one each beside the trainer's; {gpus} visible")
    if gpus:
        torch.cuda.set_device(0)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, shape in shapes.items():
            results.append(bench_model(label, shape, repeats, gpus, Path(tmp), bucket_bytes, engines,
                                       out if profile else None))
            print("RESULT " + json.dumps({"part": "weights", **results[-1]}), flush=True)
            if gpus:
                torch.cuda.empty_cache()
        logs = sorted(Path(tmp).glob("engine*.log"))
        (out / "engine_weights.log").write_text("".join(log.read_text() for log in logs))
    return results
