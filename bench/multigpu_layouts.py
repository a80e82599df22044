"""Part 1 of bench_multi_gpu: the megatron backend's parallel layouts on 2 GPUs (NCCL; gloo on the
CPU), each in its own spawned processes, one rank a GPU:

- equivalence and speed: TP=1 (one GPU), TP=2 + sequence parallelism (compiled or not), PP=2, and
  DP=2 with the distributed optimizer (its gradient reduce after the backward, or overlapped with it)
  take one RL step on the same batch from the same converted checkpoint; log-probs, loss and grad
  norm against TP=1's, then the step time over more steps and MFU;
- resharding: a checkpoint saved at TP=2 (torch_dist) resumes at TP=1 and at PP=2, and the resumed
  step equals the step the uninterrupted TP=2 run takes (tiny model, fp32; the CPU tests' helpers).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from bench.bench_gpu_megatron import H200_BF16_PEAK, model_flops
from bench.bench_trainer_step import make_samples
from tests.rollout.servers import free_port
from trainer.args import build_config, build_parser, read_hf_config
from trainer.losses import LossConfig
from trainer.profiling import PHASE
from trainer.rl_step import make_pack_loss

LAYOUTS = {  # name -> (ranks, flags)
    "tp1": (1, []),
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    # the last stage also holds the output layer and the loss: at Qwen3-0.6B's 151,936-token vocabulary that is
    # about 9 layers' FLOPs, so an even split leaves the first stage idle a third of the step; a third of the
    # layers on the last stage evens them (slime's recipes set the flag too)
    "pp2_last_third": (2, ["--pipeline-model-parallel-size", "2", "--decoder-last-pipeline-num-layers", "{third}"]),
    "dp2_distopt": (2, ["--use-distributed-optimizer"]),
    # the gradient reduce bucket by bucket under the backward (megatron's flag, off by default as in slime)
    "dp2_overlap": (2, ["--use-distributed-optimizer", "--overlap-grad-reduce"]),
    "tp2_sp_compiled": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--torch-compile"]),
    "dp4_distopt": (4, ["--use-distributed-optimizer"]),
    "dp4_overlap": (4, ["--use-distributed-optimizer", "--overlap-grad-reduce"]),
    # slime's --balance-data: packs handed to ranks by Karmarkar-Karp on their tokens, not round-robin
    "dp4_balanced": (4, ["--use-distributed-optimizer", "--balance-data"]),
}
RESHARD = {"resume_tp1": (1, []), "resume_pp2": (2, ["--pipeline-model-parallel-size", "2"])}
SAVED_AT = (2, ["--tensor-model-parallel-size", "2"])
# bf16 on the GPU: the reduction order differs by layout (TP=2 vs TP=1 log-probs differed by up to
# 0.035 at this shape, bench/RESULTS.md). fp32 on the CPU: the CPU tests' 1e-5.
TOLERANCE = {"bf16": {"logp_mean": 0.02, "loss": 0.02, "grad_norm_rel": 0.03},
             "fp32": {"logp_mean": 1e-5, "loss": 1e-5, "grad_norm_rel": 1e-5}}
# fp32 both ways; on the GPU the sharded GEMMs sum in another order than the whole ones (1e-4, as
# tests/gpu/test_megatron_moe.py allows two GEMM orders), on the CPU the tests' 1e-5.
RESHARD_ATOL = 1e-4 if torch.cuda.is_available() else 1e-5


def _base_flags(model: Path) -> list[str]:
    return ["--hf-checkpoint", str(model), "--num-rollout", "1", "--n-samples-per-prompt", "2", "--debug-train-only",
            "--load-debug-rollout-data", "unused/{rollout_id}"]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _backend(job: dict):
    from trainer.megatron.backend import (
        MegatronBackend,  # imports megatron: only in the workers
    )

    config = build_config(build_parser().parse_args(_base_flags(Path(job["model"])) + job["flags"]))
    return MegatronBackend(config, read_hf_config(job["model"]))


def _layout_step(backend, job: dict) -> dict:
    """One step on the batch (old log-probs off by +-0.3 so that clipping matters), then timed steps."""
    samples = make_samples(job["samples"], job["min_len"], job["max_len"], backend.shape.vocab_size)
    ids = list(range(len(samples)))
    logps = backend.log_probs(samples, ids)
    for i, s in enumerate(samples):
        s.old_log_probs = logps[i][0].detach().cpu().float() + (0.3 if i % 2 else -0.3)
    loss = make_pack_loss(LossConfig(), samples, ids)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    first = backend.train_step(samples, ids, loss, need_entropy=False)
    times = []
    for _ in range(job["repeats"] + 1):  # one more warm-up
        _sync()
        began = time.perf_counter()
        backend.train_step(samples, ids, loss, need_entropy=False)
        _sync()
        times.append(time.perf_counter() - began)
    profile = _profiled_step(lambda: backend.train_step(samples, ids, loss, need_entropy=False)) \
        if job.get("profile") else None
    return {"logps": {i: lp[0].detach().float().cpu() for i, lp in logps.items()}, "metrics": first, "profile": profile,
            "gpus": int(os.environ["WORLD_SIZE"]),
            "step_s": statistics.median(times[1:]), "lengths": [s.tokens.numel() for s in samples],
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None}


PROFILE_ROWS = 20  # the ops of a profiled step shown, by their own time on the device and on the host


def _profiled_step(step) -> str:
    """One more step under torch.profiler: every rank's phases, and the ops that took most of it as a table
    (rank 0's). Every rank calls it."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        began = time.perf_counter()
        step()
        _sync()
        wall = time.perf_counter() - began
    tables = prof.key_averages()
    host = tables.table(sort_by="self_cpu_time_total", row_limit=PROFILE_ROWS, max_name_column_width=60)
    events = prof.events()
    if not torch.cuda.is_available():
        return f"{_every_rank(_phases(events))}\nby host time:\n{host}"
    # the GPU's busy time against the step's, on every rank (a pipeline stage or a data-parallel rank): a host-bound
    # step leaves the GPU idle between launches, a stage waiting on its neighbour idles too
    busy = _covered(_kernels(events)) / 1e6
    phases = _every_rank(f"profiled step: {wall * 1e3:.1f} ms wall, GPU busy {busy * 1e3:.1f} ms ({busy / wall:.0%})\n"
                         f"{_phases(events)}")
    # the host's table shows where it waits on the GPU (cudaStreamSynchronize, copies) and what it spends launching
    device = tables.table(sort_by="self_cuda_time_total", row_limit=PROFILE_ROWS, max_name_column_width=60)
    return f"{phases}\nby device time:\n{device}\nby host time:\n{host}"


def _every_rank(table: str) -> str:
    """Each data-parallel rank's phase table, one under the other: a collective waits for the slowest rank, so
    rank 0's NCCL time holds the others' lateness (DP=4's 35.7 ms reduce against 10.7 ms on idle GPUs)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return table
    tables: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(tables, table)
    return "\n".join(f"rank {rank}:\n{t}" for rank, t in enumerate(tables))


def _kernels(events) -> list:
    """The GPU's own work: its kernels and copies, not the ranges a record_function draws on its timeline."""
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]


def _covered(kernels) -> float:
    """Microseconds in which at least one of these ran (NCCL's stream runs beside the compute stream)."""
    total, end = 0.0, float("-inf")
    for k in sorted(kernels, key=lambda k: k.time_range.start):
        total += max(0.0, k.time_range.end - max(k.time_range.start, end))
        end = max(end, k.time_range.end)
    return total


def _phases(events) -> str:
    """The step's phases (trainer.profiling.phase ranges): the host's time in each; on a GPU the phase's span
    on the GPU's timeline (its first kernel's start to its last's end), the time a kernel ran in that span and
    NCCL's share (collectives: what data parallelism adds to a step)."""
    kernels = _kernels(events)
    on_gpu = {e.name: e.time_range for e in events
              if e.device_type == torch.autograd.DeviceType.CUDA and e.is_user_annotation}
    lines = ["phase         host ms  GPU span ms  busy ms  NCCL ms"]
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or not e.name.startswith(PHASE):
            continue
        row = f"{e.name.removeprefix(PHASE).strip():<12} {e.time_range.elapsed_us() / 1e3:8.1f}"
        if (span := on_gpu.get(e.name)) is not None:
            inside = [k for k in kernels if span.start <= k.time_range.start < span.end]
            nccl = [k for k in inside if "nccl" in k.name.lower()]
            row += f" {span.elapsed_us() / 1e3:12.1f} {_covered(inside) / 1e3:8.1f} {_covered(nccl) / 1e3:8.1f}"
        lines.append(row)
    return "\n".join(lines)


def _reshard_step(backend, job: dict) -> dict:
    from tests.trainer.test_megatron_optimizer import (
        _step,  # the CPU tests' step: tiny LENGTHS, clipping
    )
    from trainer import checkpoint

    save = Path(job["save"])
    if job["phase"] == "save":
        backend.load(Path(job["ckpt"]), weights_only=True)
        _step(backend)
        checkpoint.save(save, 1, lambda tmp: backend.save(tmp, {"rollout_id": 1}))
    elif backend.load(checkpoint.find_loadable(save), weights_only=False) != {"rollout_id": 1}:
        raise RuntimeError("the resumed checkpoint's common state is not the saved one")
    metrics = _step(backend)
    return {"metrics": metrics, "weights": {n: t.detach().float().cpu().clone() for n, t in backend.hf_weights()}}


def _worker(rank: int, world: int, port: int, job: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from trainer import dist_env

    backend = _backend(job)
    if job["kind"] == "layout":
        if job["ckpt"]:  # else megatron's random init: a speed figure only (each layout draws its own weights)
            backend.load(Path(job["ckpt"]), weights_only=True)
        result = _layout_step(backend, job)
    else:
        result = _reshard_step(backend, job)
    if rank == 0:
        torch.save(result, job["out"])
    dist_env.shutdown()


def _spawn(world: int, job: dict) -> dict:
    mp.start_processes(_worker, args=(world, free_port(), job), nprocs=world, start_method="spawn")
    return torch.load(job["out"])


def _logp_diff(a: dict, b: dict) -> tuple[float, float]:
    diffs = torch.cat([(a[i] - b[i]).abs() for i in a])
    return float(diffs.max()), float(diffs.mean())


def run_layouts(model: Path, ckpt: Path | None, shape: dict, batch: dict, work: Path, dtype: str,
                max_tokens: int, torch_compile: bool = False, names: list[str] | None = None,
                profile: bool = False, baseline: str = "tp1") -> list[dict]:
    """Every layout's step (or those `names`, the baseline first) against the baseline's (TP=1: the same
    step in every layout); figures per layout (MFU against the H200 bf16 peak). torch_compile: every layout
    compiled (as users run the trainer), the baseline of the same call too. profile: each layout's table of
    the ops one more step spent its time in. ckpt None: every layout starts from megatron's random init (a
    shape too large to convert here): speeds only, no equivalence."""
    common = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", str(max_tokens), "--lr", "1e-6",
              "--attention-backend", "sdpa", "--adam-eps", "1"] + (["--bf16"] if dtype == "bf16" else [])
    common += ["--torch-compile"] if torch_compile else []
    tol, rows, base = TOLERANCE[dtype], [], None
    for name in [baseline, *(name for name in LAYOUTS if name != baseline)]:
        world, flags = LAYOUTS[name]
        flags = [flag.format(third=shape["num_hidden_layers"] // 3) for flag in flags]
        if (torch_compile and name.endswith("_compiled")) or (names and name != baseline and name not in names):
            continue  # compiled already, or not asked for
        began, got, why_not = time.monotonic(), None, None
        if torch.cuda.is_available() and world > torch.cuda.device_count():
            why_not = {"skipped": f"needs {world} GPUs, {torch.cuda.device_count()} here"}
        else:
            try:
                got = _spawn(world, {"kind": "layout", "model": str(model), "ckpt": str(ckpt) if ckpt else None,
                                     "flags": common + flags,
                                     "out": str(work / f"{name}.pt"), "profile": profile, **batch})
            except mp.ProcessRaisedException as err:  # one layout's failure is its row; the others still run
                why_not = {"error": str(err).strip().splitlines()[-1]}
        if got is None:
            rows.append({"layout": name, "gpus": world, **(why_not or {})})
            print("RESULT " + json.dumps({"part": "layouts", **rows[-1]}), flush=True)
            continue
        base = base or got
        flops = model_flops(shape, got["lengths"])
        logp_max, logp_mean = _logp_diff(got["logps"], base["logps"])
        m, b = got["metrics"], base["metrics"]
        row = {"layout": name, "gpus": world, "tokens": sum(got["lengths"]), "loss": m["loss"],
               "grad_norm": m["grad_norm"], "d_loss": abs(m["loss"] - b["loss"]),
               "d_grad_norm_rel": abs(m["grad_norm"] - b["grad_norm"]) / max(b["grad_norm"], 1e-12),
               "d_logp_max": logp_max, "d_logp_mean": logp_mean, "step_ms": got["step_s"] * 1e3, "baseline": baseline,
               "speed_vs_baseline": base["step_s"] / got["step_s"], "tokens_per_s": sum(got["lengths"]) / got["step_s"],
               "per_gpu_vs_baseline": base["step_s"] * base["gpus"] / (got["step_s"] * world),
               "tflops_per_gpu": flops / got["step_s"] / world / 1e12,
               "mfu_vs_989": flops / got["step_s"] / world / H200_BF16_PEAK, "peak_gib": got["peak_gib"],
               "process_s": time.monotonic() - began}
        row["equal_to_baseline"] = (row["d_logp_mean"] <= tol["logp_mean"] and row["d_loss"] <= tol["loss"]
                                    and row["d_grad_norm_rel"] <= tol["grad_norm_rel"]) if ckpt else None
        rows.append(row)
        print("RESULT " + json.dumps({"part": "layouts", **row}), flush=True)
        if got["profile"]:
            print(f"PROFILE {name} (rank 0, one step):\n{got['profile']}", flush=True)
    return rows


def run_reshard(model: Path, ckpt: Path, work: Path) -> list[dict]:
    """Save at TP=2 after one step; the next step, uninterrupted at TP=2 and resumed at TP=1 / PP=2."""
    common = ["--lr", "1e-2", "--adam-eps", "1", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "24"]
    save = work / "save_tp2"
    job = {"kind": "reshard", "model": str(model), "ckpt": str(ckpt), "save": str(save)}
    before = _spawn(SAVED_AT[0], {**job, "phase": "save", "flags": common + SAVED_AT[1], "out": str(work / "tp2.pt")})
    rows = []
    for name, (world, flags) in RESHARD.items():
        got = _spawn(world, {**job, "phase": "resume", "flags": common + flags, "out": str(work / f"{name}.pt")})
        d_weights = max(float((got["weights"][n] - t).abs().max()) for n, t in before["weights"].items())
        row = {"saved_at": "tp2", "resumed_at": name.removeprefix("resume_"), "gpus": world,
               "loss": got["metrics"]["loss"], "uninterrupted_loss": before["metrics"]["loss"],
               "d_loss": abs(got["metrics"]["loss"] - before["metrics"]["loss"]),
               "d_grad_norm": abs(got["metrics"]["grad_norm"] - before["metrics"]["grad_norm"]),
               "d_weights_max": d_weights, "same_names": got["weights"].keys() == before["weights"].keys()}
        row["equal"] = row["same_names"] and max(row["d_loss"], row["d_grad_norm"], d_weights) <= RESHARD_ATOL
        rows.append(row)
        print("RESULT " + json.dumps({"part": "reshard", **row}), flush=True)
    return rows
