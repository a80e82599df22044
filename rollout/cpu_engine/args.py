"""Command-line flags of the stand-in engine: `sglang.launch_server`'s names, so launch code is shared."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

# sglang.launch_server flags that a job spec may pass but that mean nothing to the stand-in engine
# (one process, one device). They are accepted (so the same command line works) and reported in
# /server_info.
_IGNORED_FLAGS: tuple[tuple[str, type | None, Any], ...] = (
    ("--tp-size", int, 1), ("--dp-size", int, 1),
    ("--gpu-id-step", int, 1), ("--enable-memory-saver", None, False),
    ("--trust-remote-code", None, False),
    ("--log-level", str, "info"), ("--disable-radix-cache", None, False), ("--chunked-prefill-size", int, None),
    ("--cuda-graph-max-bs", int, None), ("--disable-cuda-graph", None, False), ("--attention-backend", str, None),
    ("--sampling-backend", str, None), ("--max-total-tokens", int, None), ("--schedule-policy", str, "fcfs"),
    ("--watchdog-timeout", float, 300.0),
    ("--load-format", str, "auto"),
    # prefill/decode: the KV moves over the bootstrap server's HTTP (rollout/cpu_engine/disagg.py)
    ("--disaggregation-transfer-backend", str, "mooncake"),
    ("--prefill-round-robin-balance", None, False),
    ("--load-balance-method", str, "round_robin"),
)


@dataclass(frozen=True)
class ServerArgs:
    model_path: str
    tokenizer_path: str
    served_model_name: str
    host: str
    port: int
    api_key: str | None
    weight_version: str
    skip_server_warmup: bool
    max_running_requests: int
    context_length: int | None
    dtype: str
    random_seed: int | None
    num_threads: int
    weight_update_group_timeout: float = 300.0
    enable_deterministic_inference: bool = False
    decode_step_hold_ms: float = 0.0  # a simulation of a GPU's step time: each forward step sleeps this long
    nnodes: int = 1  # an engine over several nodes (rollout/cpu_engine/node_link.py): one process per node
    node_rank: int = 0
    dist_init_addr: str | None = None  # HOST:PORT where node-rank 0 gathers the engine's ranks
    disaggregation_mode: str = "null"  # SGLang's: null (whole requests), prefill or decode
    disaggregation_bootstrap_port: int = 8998
    device: str = "cpu"  # SGLang's --device: cpu or cuda (rollout/cpu_engine/device.py)
    base_gpu_id: int = 0  # --device cuda: which of the GPUs this process sees
    mem_fraction_static: float | None = None  # --device cuda: the most of the GPU's memory it may take
    ignored: dict[str, Any] = field(default_factory=dict)

    def without_effect(self) -> dict[str, Any]:
        """The flags that change nothing here, with their values: the ignored ones, and on the CPU the
        GPU's own."""
        gpu_only = {"base_gpu_id": self.base_gpu_id, "mem_fraction_static": self.mem_fraction_static}
        return {**self.ignored, **(gpu_only if self.device == "cpu" else {})}

    def public(self) -> dict[str, Any]:
        """The resolved flags as /server_info shows them: flat, and without the API key. tp_size is
        the ranks this engine has (one per node), whatever --tp-size said: a trainer sizes its weight
        update group from it, as from SGLang's (whose tp ranks span every node)."""
        shown = {k: v for k, v in self.__dict__.items() if k not in ("api_key", "ignored")}
        return {**shown, **self.ignored, "tp_size": self.nnodes}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rollout.cpu_engine",
        description="SGLang-compatible HTTP engine over a transformers causal LM, on CPU or one CUDA GPU")
    parser.add_argument("--model-path", required=True, help="HF model folder (config, safetensors, tokenizer)")
    parser.add_argument("--tokenizer-path", help="tokenizer folder (default: --model-path)")
    parser.add_argument("--served-model-name", help="name in /model_info (default: --model-path)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    parser.add_argument("--port", type=int, default=30000, help="port to bind (default %(default)s)")
    parser.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every route")
    parser.add_argument("--weight-version", default="default", help="initial weight version (default %(default)s)")
    parser.add_argument("--skip-server-warmup", action="store_true", help="be ready without a warmup generation")
    parser.add_argument("--max-running-requests", type=int, default=64,
                        help="most sequences decoded together in one batch (default %(default)s)")
    parser.add_argument("--context-length", type=int,
                        help="most prompt + output tokens (default: the model's max_position_embeddings)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights dtype (default: the checkpoint's)")
    parser.add_argument("--random-seed", type=int, help="seed of requests without sampling_seed (default: random)")
    parser.add_argument("--num-threads", type=int, default=1,
                        help="torch CPU threads (default %(default)s, to stay light beside other processes)")
    parser.add_argument("--weight-update-group-timeout", type=float, default=300.0,
                        help="seconds a weight-update group's rendezvous or one broadcast waits for the "
                             "trainer before failing (default %(default)s; the CPU engine's own flag)")
    parser.add_argument("--enable-deterministic-inference", action="store_true",
                        help="batch-invariant results: every sequence runs its own forward pass, so its "
                             "logits never depend on what else is running (slower under load)")
    parser.add_argument("--decode-step-hold-ms", type=float, default=0.0,
                        help="SIMULATION of GPU decode (benchmarks, tests): each forward step is held this long, "
                             "sleeping, using no CPU, as if a GPU computed it while the host waits (the CPU "
                             "engine's own flag; default %(default)s: none)")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes the engine spans, one process each "
                        "(default %(default)s); node rank 0 serves HTTP, the others follow it")
    parser.add_argument("--node-rank", type=int, default=0, help="this process's node (default %(default)s)")
    parser.add_argument("--dist-init-addr", help="HOST:PORT of node rank 0, where the engine's ranks meet "
                        "(required with --nnodes above 1)")
    parser.add_argument("--disaggregation-mode", default="null", choices=["null", "prefill", "decode"],
                        help="prefill: run prompts and serve their first token on the bootstrap port; decode: "
                             "continue requests from a prefill engine's bootstrap server (default %(default)s)")
    parser.add_argument("--disaggregation-bootstrap-port", type=int, default=8998,
                        help="a prefill engine's bootstrap server port (default %(default)s)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where the model runs (default %(default)s; SGLang's default is to detect): cuda "
                             "takes one GPU, --base-gpu-id among those CUDA_VISIBLE_DEVICES shows")
    parser.add_argument("--base-gpu-id", type=int, default=0,
                        help="--device cuda: the GPU to use among those this process sees (default %(default)s)")
    parser.add_argument("--mem-fraction-static", type=float,
                        help="--device cuda: the most of the GPU's memory this engine may take, weights and "
                             "cache (default: no cap); past it a load or a batch fails with out-of-memory")
    ignored = parser.add_argument_group("accepted for sglang compatibility, no effect on the stand-in engine")
    for flag, kind, default in _IGNORED_FLAGS:
        if kind is None:
            ignored.add_argument(flag, action="store_true", default=default)
        else:
            ignored.add_argument(flag, type=kind, default=default)
    return parser


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if not 0 < ns.port < 65536:
        parser.error(f"--port must be 1..65535, got {ns.port}")
    if ns.weight_update_group_timeout <= 0:
        parser.error(f"--weight-update-group-timeout must be positive, got {ns.weight_update_group_timeout}")
    for flag in ("max_running_requests", "num_threads", "context_length"):
        value = getattr(ns, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be 1 or more, got {value}")
    if ns.decode_step_hold_ms < 0:
        parser.error(f"--decode-step-hold-ms must be 0 or more, got {ns.decode_step_hold_ms}")
    if ns.nnodes < 1 or not 0 <= ns.node_rank < ns.nnodes:
        parser.error(f"--node-rank must be 0..--nnodes - 1 and --nnodes 1 or more, got {ns.node_rank} "
                     f"and {ns.nnodes}")
    if ns.nnodes > 1 and not (ns.dist_init_addr and ns.dist_init_addr.rpartition(":")[2].isdigit()):
        parser.error(f"--nnodes {ns.nnodes} needs --dist-init-addr HOST:PORT (node rank 0's), got "
                     f"{ns.dist_init_addr!r}")
    problem = _device_problem(ns.device, ns.base_gpu_id, ns.mem_fraction_static, ns.tp_size, ns.nnodes,
                              ns.disaggregation_mode)
    if problem:
        parser.error(problem)
    ignored_names = {flag[2:].replace("-", "_") for flag, _, _ in _IGNORED_FLAGS}
    return ServerArgs(
        model_path=ns.model_path, tokenizer_path=ns.tokenizer_path or ns.model_path,
        served_model_name=ns.served_model_name or ns.model_path, host=ns.host, port=ns.port,
        api_key=ns.api_key, weight_version=ns.weight_version, skip_server_warmup=ns.skip_server_warmup,
        max_running_requests=ns.max_running_requests, context_length=ns.context_length, dtype=ns.dtype,
        random_seed=ns.random_seed, num_threads=ns.num_threads,
        weight_update_group_timeout=ns.weight_update_group_timeout,
        enable_deterministic_inference=ns.enable_deterministic_inference, decode_step_hold_ms=ns.decode_step_hold_ms,
        nnodes=ns.nnodes, node_rank=ns.node_rank, dist_init_addr=ns.dist_init_addr,
        disaggregation_mode=ns.disaggregation_mode, disaggregation_bootstrap_port=ns.disaggregation_bootstrap_port,
        device=ns.device, base_gpu_id=ns.base_gpu_id, mem_fraction_static=ns.mem_fraction_static,
        ignored={name: getattr(ns, name) for name in sorted(ignored_names)},
    )


def _device_problem(device: str, base_gpu_id: int, mem_fraction: float | None, tp_size: int, nnodes: int,
                    disaggregation_mode: str) -> str | None:
    """What is wrong with the GPU flags' values, or with what the stand-in engine does on the CPU only."""
    if base_gpu_id < 0:
        return f"--base-gpu-id must be 0 or more, got {base_gpu_id}"
    if mem_fraction is not None and not 0.0 < mem_fraction <= 1.0:
        return f"--mem-fraction-static must be in (0, 1], got {mem_fraction}"
    if device != "cuda":
        return None
    if nnodes > 1:
        return (f"--device cuda: the stand-in engine spans nodes (--nnodes {nnodes}) on CPU only; give --device cpu "
                "or --nnodes 1")
    if tp_size != 1:
        return f"--tp-size {tp_size}: the stand-in engine uses one GPU (--device cuda); give --tp-size 1"
    if disaggregation_mode != "null":
        return (f"--device cuda: the stand-in engine's prefill/decode disaggregation (--disaggregation-mode "
                f"{disaggregation_mode}) runs on CPU only; give --device cpu")
    return None
