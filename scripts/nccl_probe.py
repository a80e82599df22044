"""What NCCL makes of the data-parallel gradient reduce on this machine (session 51: DP=4's profile showed the
trainer's bucketed fp32 all-reduce as ncclDevKernel_AllReduce_Sum_f32_RING_LL at ~100 GB/s bus bandwidth, where a
plain broadcast between the same GPUs runs near 300). Each variant of NCCL's environment runs in fresh processes, one
a GPU; rank 0 prints each collective's time and bus bandwidth (NCCL's nccl-tests definition), and with
--debug NCCL's own log (INIT, GRAPH, TUNING) says which algorithm and protocol it chose.

    python scripts/nccl_probe.py [--gib 2.2] [--bucket-numel 40000000] [--variants default,simple] [--debug]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.rollout.servers import free_port

VARIANTS = {  # name -> NCCL environment (on top of the machine's)
    "default": {},
    "simple": {"NCCL_PROTO": "Simple"},
    "ll128": {"NCCL_PROTO": "LL128"},
    "tree": {"NCCL_ALGO": "Tree"},
    "channels32": {"NCCL_MIN_NCHANNELS": "32"},  # more rings at once: NCCL may pick few on a 4-GPU NVSwitch
}
REPEATS = 5


def _timed(op, repeats: int = REPEATS) -> float:
    op()  # warm-up: connections, buffers
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(repeats):
        op()
    torch.cuda.synchronize()
    return (time.perf_counter() - began) / repeats


def _rank(rank: int, world: int, port: int, env: dict[str, str], numel: int, bucket: int, debug: bool) -> None:
    os.environ.update(env)
    if rank == 0 and debug:  # NCCL's topology, and its tuning table: each algorithm and protocol's modelled speed
        os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,GRAPH,TUNING")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    group = dist.new_group(list(range(world)))  # as megatron's data-parallel group
    grads = torch.ones(numel, dtype=torch.float32, device="cuda")
    params = torch.ones(numel, dtype=torch.bfloat16, device="cuda")
    shard = torch.empty(numel // world, dtype=torch.float32, device="cuda")

    def buckets() -> None:  # trainer.grad_buckets without overlap: every bucket launched, then each waited
        works = [dist.all_reduce(grads[i:i + bucket], group=group, async_op=True) for i in range(0, numel, bucket)]
        for work in works:
            work.wait()

    ops = {  # name -> (op, bytes, bus factor: nccl-tests' busbw = algbw x factor)
        "all_reduce fp32, buckets": (buckets, grads.nbytes, 2 * (world - 1) / world),
        "all_reduce fp32, one call": (lambda: dist.all_reduce(grads, group=group), grads.nbytes,
                                      2 * (world - 1) / world),
        "reduce_scatter fp32": (lambda: dist.reduce_scatter_tensor(shard, grads, group=group), grads.nbytes,
                                (world - 1) / world),
        "all_gather bf16": (lambda: dist.all_gather_into_tensor(params, params[:numel // world], group=group),
                            params.nbytes, (world - 1) / world),
        "broadcast bf16": (lambda: dist.broadcast(params, src=0, group=group), params.nbytes, 1.0),
    }
    for name, (op, nbytes, factor) in ops.items():
        try:
            seconds = _timed(op)
        except dist.DistBackendError as err:  # e.g. NCCL_ALGO=Tree has no reduce-scatter: every rank refuses it
            if rank == 0:
                print(f"  {name:28s} not available: {str(err).strip().splitlines()[-1]}", flush=True)
            continue
        if rank == 0:
            print(f"  {name:28s} {nbytes / 2**30:5.2f} GiB {seconds * 1e3:8.2f} ms  "
                  f"busbw {nbytes / seconds * factor / 1e9:6.1f} GB/s", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=2.2, help="the fp32 gradients' size (Qwen3-0.6B: 2.2 GiB)")
    parser.add_argument("--bucket-numel", type=int, default=40_000_000, help="megatron's default bucket")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--debug", action="store_true", help="NCCL's INFO log on rank 0 of the first variant")
    opts = parser.parse_args()
    world = torch.cuda.device_count()
    if world < 2:
        raise SystemExit(f"nccl_probe needs 2 GPUs, {world} visible")
    numel = int(opts.gib * 2**30 / 4) // world * world
    for i, name in enumerate(opts.variants.split(",")):
        print(f"{name} ({world} GPUs, {VARIANTS[name] or 'NCCL chooses'}):", flush=True)
        mp.start_processes(_rank, args=(world, free_port(), VARIANTS[name], numel, opts.bucket_numel,
                                        opts.debug and i == 0), nprocs=world, start_method="spawn")


if __name__ == "__main__":
    main()
