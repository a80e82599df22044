"""The engine side of bench_multi_gpu: one process on one GPU (or the CPU), answering the routes of
SGLang's HTTP contract that a weight update and a colocated trainer call, as the CPU engine's weight
and memory routes answer them, but holding its tensors on cuda and joining the update group over
NCCL (the CPU engine always takes gloo). It generates nothing: /bench_generate stands for a rollout
(matrix products over the KV cache it holds).

    python -m bench.multigpu_engine --port P [--weights-bytes N] [--mem-fraction F] [--param-shapes FILE]

--param-shapes: a JSON {name: [dtype, shape]} of the parameters a weight update fills (loaded in
place, as an engine loads a bucket into its model); --mem-fraction: the engine's whole share of the
device (weights + KV cache, SGLang's --mem-fraction-static), released and resumed by tag.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from rollout.weight_group import UpdateGroup, WeightSyncError, create_group, parse_dtype

DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")  # one GPU visible
GROUP_TIMEOUT_S = 300.0  # bounds the group's rendezvous and each broadcast
KV_BLOCK = 256 * 1024**2  # the KV cache is held in blocks of this many bytes


class EngineState:
    def __init__(self, params: dict[str, torch.Tensor], kv_bytes: int) -> None:
        self.params = params  # the model's weights, filled in place by updates
        self.kv_bytes = kv_bytes
        self.kv: list[torch.Tensor] = []
        self.groups: dict[str, UpdateGroup] = {}
        self.version: str | None = "0"
        self.sglang_version: str | None = None  # what /server_info says (an old SGLang's: per-tensor buckets)
        self.open = False
        self.released: set[str] = set()
        self.lock = threading.Lock()  # one group operation at a time
        self.bucket_seconds: list[tuple[float, float]] = []  # per bucket received: (receive, load), for the bench
        self._allocate_kv()

    def _allocate_kv(self) -> None:
        left = self.kv_bytes
        while left > 0:
            self.kv.append(torch.empty(min(left, KV_BLOCK), dtype=torch.uint8, device=DEVICE))
            left -= self.kv[-1].numel()

    def held_bytes(self) -> int:
        weights = 0 if "weights" in self.released else sum(t.numel() * t.element_size() for t in self.params.values())
        return weights + sum(t.numel() for t in self.kv)

    def release(self, tags: list[str]) -> None:
        """As SGLang's memory saver: the weights go to the host (kept), the KV cache is freed."""
        if "weights" in tags and "weights" not in self.released:
            for name, tensor in self.params.items():
                self.params[name] = tensor.to("cpu")
        if "kv_cache" in tags:
            self.kv.clear()
        self.released.update(tags)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def resume(self, tags: list[str]) -> None:
        if "weights" in tags and "weights" in self.released:
            for name, tensor in self.params.items():
                self.params[name] = tensor.to(DEVICE)
        if "kv_cache" in tags and "kv_cache" in self.released:
            self._allocate_kv()
        self.released.difference_update(tags)

    def generate(self, rounds: int) -> float:
        """Stand-in for a rollout: matrix products and writes into the KV cache; the products' sum."""
        if self.released:
            raise ValueError(f"released ({', '.join(sorted(self.released))}): resume first")
        side = 4096 if DEVICE.type == "cuda" else 64
        a = torch.ones(side, side, device=DEVICE, dtype=torch.bfloat16 if DEVICE.type == "cuda" else torch.float32)
        total = 0.0
        for i in range(rounds):
            if self.kv:  # write into the cache, as decoding does
                self.kv[i % len(self.kv)][: 1 << 20].add_(1)
            total += float((a @ a).sum())
        return total

    def receive(self, group: UpdateGroup, names: list[str], dtypes: list[str], shapes: list[list[int]],
                load_format: str | None, last: bool) -> None:
        """One bucket, as the CPU engine takes it (SGLang's load_format): one flattened broadcast, or
        one per tensor (all queued before any is waited on), on the device; then load each into its
        parameter. As the CPU engine, a bucket loads while the next one is received: its copies are
        queued on the stream the next receive waits on, and only the last bucket (the versioned one)
        waits for every load before its answer."""
        if load_format not in (None, "flattened_bucket"):
            raise ValueError(f"load_format {load_format!r} is not supported")
        receive = group.receive_flat if load_format else group.receive
        began = time.perf_counter()
        tensors = receive(names, [parse_dtype(d) for d in dtypes], shapes, DEVICE)
        received = time.perf_counter()
        for name, tensor in tensors.items():
            if name in self.params:
                self.params[name].copy_(tensor)
        if last:
            _sync()
        self.bucket_seconds.append((received - began, time.perf_counter() - received))


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def make_handler(state: EngineState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # connections kept alive, as SGLang's uvicorn keeps them
        # Headers and body go out as two writes: with Nagle's algorithm on a kept-alive connection the body
        # would wait for the client's delayed ACK (40 ms)
        disable_nagle_algorithm = True

        def log_message(self, *args: Any) -> None:  # quiet: one line per request would drown the bench's
            pass

        def answer(self, body: dict[str, Any], status: int = 200) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/server_info":
                self.answer({"tp_size": 1, "version": state.sglang_version})
            elif self.path == "/model_info":
                self.answer({"weight_version": state.version})
            elif self.path == "/health":
                self.answer({"ok": True, "held_bytes": state.held_bytes(), "device": str(DEVICE)})
            else:
                self.answer({"success": False, "message": f"no route {self.path}"}, 404)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            try:
                self.answer(self.route(self.path, body))
            except (ValueError, KeyError, WeightSyncError, RuntimeError) as err:
                self.answer({"success": False, "message": f"{type(err).__name__}: {err}"}, 400)

        def route(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
            if path == "/init_weights_update_group":
                with state.lock:
                    state.groups[body["group_name"]] = create_group(
                        body["master_address"], body["master_port"], body["rank_offset"], body["world_size"],
                        body["group_name"], GROUP_TIMEOUT_S, "nccl" if DEVICE.type == "cuda" else "gloo")
                return {"success": True, "message": "joined"}
            if path == "/destroy_weights_update_group":
                with state.lock:
                    state.groups.pop(body["group_name"]).close()
                return {"success": True, "message": "destroyed"}
            if path == "/begin_weight_update":
                state.open = True
                return {"success": True, "message": "begun"}
            if path == "/end_weight_update":
                state.open = False
                return {"success": True, "message": "ended"}
            if path == "/update_weights_from_distributed":
                if not state.open:
                    raise ValueError("update_weights_from_distributed outside /begin_weight_update")
                with state.lock:
                    state.receive(state.groups[body["group_name"]], body["names"], body["dtypes"], body["shapes"],
                                  body.get("load_format"), last=body.get("weight_version") is not None)
                if body.get("weight_version") is not None:
                    state.version = body["weight_version"]
                return {"success": True, "message": f"updated {len(body['names'])} parameters"}
            if path == "/bench_broadcast":  # the baseline: plain broadcasts of one flat buffer
                flat = torch.empty(body["nbytes"], dtype=torch.uint8, device=DEVICE)
                with state.lock:
                    group = state.groups[body["group_name"]]
                    for _ in range(body["repeats"]):
                        group.broadcast(flat, src=0)
                    if DEVICE.type == "cuda":
                        torch.cuda.synchronize()
                return {"success": True, "message": "received", "checksum": int(flat[:4096].sum())}
            if path == "/bench_sglang_version":  # e.g. "0.5.5": the trainer then sends one broadcast per tensor
                state.sglang_version = body["version"]
                return {"success": True}
            if path == "/bench_bucket_seconds":  # each bucket's receive and load since the last ask
                seconds, state.bucket_seconds = state.bucket_seconds, []
                return {"success": True, "buckets": seconds}
            if path == "/bench_checksum":  # the weights' sum, to check an update arrived whole
                with state.lock:
                    return {"success": True, "checksum": sum(float(t.float().sum()) for t in state.params.values())}
            if path == "/release_memory_occupation":
                state.release(body["tags"])
                return {"success": True, "message": "released"}
            if path == "/resume_memory_occupation":
                state.resume(body["tags"])
                return {"success": True, "message": "resumed"}
            if path == "/bench_generate":
                began = time.monotonic()
                value = state.generate(body.get("rounds", 8))
                return {"success": True, "value": value, "seconds": time.monotonic() - began,
                        "held_bytes": state.held_bytes()}
            raise KeyError(f"no route {path}")

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--param-shapes", help="JSON file {name: [dtype, shape]}")
    parser.add_argument("--mem-fraction", type=float, default=0.0,
                        help="weights + KV cache as a share of the device's memory (0: no KV cache)")
    opts = parser.parse_args()
    shapes = json.loads(Path(opts.param_shapes).read_text()) if opts.param_shapes else {}
    params = {name: torch.zeros(shape, dtype=parse_dtype(dtype), device=DEVICE) for name, (dtype, shape) in shapes.items()}
    weights = sum(t.numel() * t.element_size() for t in params.values())
    total = torch.cuda.mem_get_info(DEVICE)[1] if DEVICE.type == "cuda" else 2 * 1024**3
    kv = max(0, int(opts.mem_fraction * total) - weights) if opts.mem_fraction else 0
    server = ThreadingHTTPServer(("127.0.0.1", opts.port), make_handler(EngineState(params, kv)))
    print(f"engine on {DEVICE} at 127.0.0.1:{opts.port}: {weights / 1e9:.2f} GB weights, {kv / 1e9:.2f} GB KV cache",
          flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
