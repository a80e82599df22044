"""--update-weight-transport tensor (issue 31, item 2): a publish by reference into a stand-in engine
on the trainer's own device (this process, GPU 0; on the CPU: /dev/shm), through the real publisher
and the engine's /update_weights_from_tensor, against, in the same run:
- a device-to-device copy of the same bytes into tensors of this process (the goal: the publish
  >= 0.85x of it: ratio_vs_copy);
- the disk publish of the same weights (what colocated jobs take otherwise: disk_publish_s);
- the same publish with a CUDA IPC handle per tensor, as to an SGLang older than flattened buckets
  (per_tensor_handles_s; the flattened buckets' speed-up over it: flattened_speedup);
- the bound SGLang's contract sets (the copy and the engine's calls in turn, each timed alone:
  contract_bound_ratio).

    python -m bench.bench_tensor_publish [--shape small|qwen3-0.6b] [--repeats 3]

Each figure is the best of `--repeats` after one warm-up; one "RESULT {json}" line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import requests
import torch

from bench.bench_trainer_step import make_model
from bench.multigpu_weights import FIXED_CALLS, engine_call_seconds, profiled
from bench.tensor_ipc_parts import ipc_parts
from rollout.cpu_engine.faults import ROUTE as FAULT_ROUTE
from rollout.cpu_engine.weights import read_safetensors_folder
from rollout.weight_group import buckets
from tests.rollout.servers import API_KEY, engine
from trainer.publish import DEFAULT_BUCKET_BYTES, WeightPublisher


def best_of(repeats: int, run: Callable[[int], None], device: torch.device) -> float:
    """Seconds of the fastest of `repeats` runs of run(i), after one run to warm up."""
    times = []
    for i in range(repeats + 1):
        began = time.perf_counter()
        run(i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - began)
    return min(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("small", "qwen3-0.6b"), default=None,
                        help="default: qwen3-0.6b on a GPU, small on the CPU")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help="also: one more publish's trainer side under cProfile (DIR/profile_tensor_publish.txt), "
                             "and the parts of a publish by reference without HTTP (bench/tensor_ipc_parts.py)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    shape = args.shape or ("qwen3-0.6b" if cuda else "small")
    work = Path(tempfile.mkdtemp(prefix="bench_tensor_publish_"))
    model = make_model(work / "model", shape)
    weights = [(name, (t + 0.01).to(device, torch.bfloat16))
               for name, t in sorted(read_safetensors_folder(model).items())]
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    flags = ("--device", "cuda", "--base-gpu-id", "0", "--mem-fraction-static", "0.5") if cuda else ()
    server = engine(model, work / "engine.log", flags=("--skip-server-warmup", *flags))
    try:
        by_reference = WeightPublisher("tensor", work / "job", model, API_KEY, timeout_s=600)
        through_disk = WeightPublisher("disk", work / "job", model, API_KEY, timeout_s=600)
        per_tensor = WeightPublisher("tensor", work / "job", model, API_KEY, timeout_s=600)

        def publish(publisher: WeightPublisher, version: int) -> None:
            result = publisher.publish(version, [server.url], iter(weights))
            assert result.updated == [server.url], result.dropped

        tensor_s = best_of(args.repeats, lambda i: publish(by_reference, 10 + i), device)
        # the same publish as to an SGLang older than flattened buckets (0.5.5): a CUDA IPC handle per tensor
        requests.post(server.url + FAULT_ROUTE, json={"version": "0.5.5"},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).raise_for_status()
        per_tensor_s = best_of(args.repeats, lambda i: publish(per_tensor, 30 + i), device)
        if args.profile:
            Path(args.profile).mkdir(parents=True, exist_ok=True)
            versions = itertools.count(50)
            profiled(lambda: publish(by_reference, next(versions)), Path(args.profile) / "profile_tensor_publish.txt")
        disk_s = best_of(args.repeats, lambda i: publish(through_disk, 20 + i), device)
        targets = [torch.empty_like(t) for _, t in weights]
        copy_s = best_of(args.repeats, lambda i: [dst.copy_(src) for dst, (_, src) in zip(targets, weights)], device)
        call_s = engine_call_seconds(server.url, api_key=API_KEY)
    finally:
        server.stop()
    # The best a publish by reference can do under SGLang's contract: the engine's one copy of the bytes, and its
    # calls in turn (a request per bucket and dtype, each answered once copied; /begin_weight_update and
    # /end_weight_update), none overlapped
    calls = FIXED_CALLS + sum(len({t.dtype for _, t in bucket}) for bucket, _ in buckets(iter(weights),
                                                                                       DEFAULT_BUCKET_BYTES))
    bound_s = copy_s + calls * call_s
    parts = ipc_parts(weights, DEFAULT_BUCKET_BYTES, args.repeats) if args.profile and cuda else None
    where = torch.cuda.get_device_name(device) if cuda else "cpu"
    result = {"shape": shape, "device": where, "bytes": nbytes, "tensors": len(weights),
              "tensor_publish_s": tensor_s, "tensor_publish_gbps": nbytes / tensor_s / 1e9,
              "per_tensor_handles_s": per_tensor_s, "flattened_speedup": per_tensor_s / tensor_s, "copy_s": copy_s,
              "copy_gbps": nbytes / copy_s / 1e9, "ratio_vs_copy": copy_s / tensor_s, "disk_publish_s": disk_s,
              "tensor_vs_disk": disk_s / tensor_s, "engine_calls": calls, "call_s": call_s,
              "contract_bound_s": bound_s, "contract_bound_ratio": copy_s / bound_s, "ipc_parts": parts}
    print(f"{shape} ({nbytes / 1e9:.2f} GB bf16, {len(weights)} tensors) on {where}: publish by reference "
          f"{tensor_s * 1e3:.1f} ms (a handle per tensor: {per_tensor_s * 1e3:.1f} ms), device copy "
          f"{copy_s * 1e3:.1f} ms (ratio {copy_s / tensor_s:.3f}, goal >= 0.85; SGLang's contract bounds it at "
          f"{copy_s / bound_s:.3f}: {calls} calls of {call_s * 1e3:.2f} ms), "
          f"disk publish {disk_s * 1e3:.1f} ms ({disk_s / tensor_s:.1f}x the by-reference time)")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
