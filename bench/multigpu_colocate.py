"""Part 3 of bench_multi_gpu: colocation on shared GPUs. One engine-side process per GPU
(bench/multigpu_engine.py: the model's weights plus a KV cache, together --mem-fraction of the GPU)
and a 2-rank megatron trainer on the same GPUs with --offload-train, ordered by the real
trainer.colocation.Colocation and its EngineSide (rank 0 calls the engines' release/resume routes):

    rollout (engines generate; the trainer's state on the host) -> to_trainer() (engines release,
    trainer onloads) -> log-probs + train step -> before_publish() (grads and optimizer state to the
    host, engines resume weights) -> the publish's trainer side (hf_weights) -> to_engines()

for --steps steps; per phase, each GPU's memory in use (the driver's count: both processes), the
trainer's peak, the engine's holding, and the switch times.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.bench_trainer_step import make_samples
from bench.multigpu_weights import qwen3_params, start_engine, stop_engine
from tests.rollout.servers import free_port
from trainer.args import build_config, build_parser, read_hf_config
from trainer.losses import LossConfig
from trainer.rl_step import make_pack_loss

ENGINE_CALL_S = 300.0  # bounds each engine call of the colocated loop
PHASES = ("rollout", "to_trainer", "train", "before_publish", "publish", "to_engines")


def _memory() -> dict:
    """This rank's GPU: bytes in use by every process (the driver's count), the trainer's own."""
    if not torch.cuda.is_available():
        return {}
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"device_used": total - free, "device_total": total, "trainer_allocated": torch.cuda.memory_allocated(),
            "trainer_peak": torch.cuda.max_memory_allocated(), "trainer_reserved": torch.cuda.memory_reserved()}


def _generate(urls: list[str]) -> list[dict]:
    from bench.multigpu_weights import post

    answers: list[dict] = [{} for _ in urls]

    def one(k: int) -> None:
        answers[k] = post(urls[k], "/bench_generate", {"rounds": 16})
    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(urls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def _worker(rank: int, world: int, port: int, job: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from rollout.engine_client import EngineClient
    from trainer import dist_env
    from trainer.colocation import Colocation, EngineSide
    from trainer.megatron.backend import MegatronBackend

    config = build_config(build_parser().parse_args(job["flags"]))
    backend = MegatronBackend(config, read_hf_config(job["model"]))
    backend.load(Path(job["ckpt"]), weights_only=True)
    dropped: dict[str, str] = {}
    engines = EngineSide(EngineClient(None, ENGINE_CALL_S), lambda: job["urls"], dropped.__setitem__, None) \
        if rank == 0 else None
    colocation = Colocation(backend, config.run.offload_train, engines)
    colocation.to_engines()  # the engines hold the GPUs first, as after the start-up publish
    samples = make_samples(job["samples"], job["min_len"], job["max_len"], backend.shape.vocab_size)
    ids = list(range(len(samples)))
    records: list[dict] = []
    for step in range(job["steps"]):
        record: dict = {"step": step}

        def phase(name: str, fn, record: dict = record) -> None:
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            dist.barrier()
            began = time.perf_counter()
            out = fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            dist.barrier()
            record[name] = {"seconds": time.perf_counter() - began, **_memory(), **(out or {})}

        phase("rollout", lambda: {"engines": _generate(job["urls"])} if rank == 0 else None)
        phase("to_trainer", colocation.to_trainer)

        def train() -> dict:
            logps = backend.log_probs(samples, ids)
            for i, s in enumerate(samples):
                s.old_log_probs = logps[i][0].detach().cpu().float()
            metrics = backend.train_step(samples, ids, make_pack_loss(LossConfig(), samples, ids), need_entropy=False)
            return {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}
        phase("train", train)
        phase("before_publish", colocation.before_publish)
        phase("publish", lambda: {"tensors": sum(1 for _ in backend.hf_weights())})
        phase("to_engines", colocation.to_engines)
        records.append(record)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, records)
    if rank == 0:
        torch.save({"ranks": gathered, "dropped": dropped}, job["out"])
    dist_env.shutdown()


def _summary(ranks: list[list[dict]], fraction: float) -> dict:
    """Per phase: the most memory in use on any GPU and the trainer's peak over the steps, and
    the median switch time (the slowest rank's; the first step apart)."""
    out: dict = {}
    for name in PHASES:
        rows = [r[name] for records in ranks for r in records]
        seconds = [max(records[s][name]["seconds"] for records in ranks) for s in range(len(ranks[0]))]
        entry = {"median_s": statistics.median(seconds[1:] or seconds), "first_s": seconds[0]}
        if "device_used" in rows[0]:
            entry.update(device_used_max_gib=max(r["device_used"] for r in rows) / 2**30,
                         trainer_peak_max_gib=max(r["trainer_peak"] for r in rows) / 2**30,
                         trainer_allocated_end_max_gib=max(r["trainer_allocated"] for r in rows) / 2**30,
                         device_total_gib=rows[0]["device_total"] / 2**30)
        if name == "rollout":
            held = [e["held_bytes"] for r in ranks[0] for e in r["rollout"]["engines"]]
            entry["engine_held_max_gib"] = max(held) / 2**30
            if "device_total" in rows[0]:
                entry["engine_fraction"] = max(held) / rows[0]["device_total"]
                entry["fraction_honoured"] = max(held) <= fraction * rows[0]["device_total"] * 1.001
        out[name] = entry
    out["losses"] = [r["train"]["loss"] for r in ranks[0]]
    return out


def run(model: Path, ckpt: Path, shape: dict, batch: dict, steps: int, fraction: float, work: Path, out: Path,
        dtype: str, max_tokens: int) -> dict:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = 2
    shapes_file = work / "colocate_shapes.json"
    shapes_file.write_text(json.dumps({n: ["bfloat16", s] for n, s in qwen3_params(shape).items()}))
    ports = [free_port() for _ in range(world)]
    log = out / "engine_colocate.log"
    engines = []
    try:
        for k, port in enumerate(ports):
            engines.append(start_engine(port, ["--param-shapes", str(shapes_file), "--mem-fraction", str(fraction)],
                                        k % gpus if gpus else None, log))
        flags = ["--hf-checkpoint", str(model), "--num-rollout", "1", "--n-samples-per-prompt", "2",
                 "--debug-train-only", "--load-debug-rollout-data", "unused/{rollout_id}", "--offload-train",
                 "--offload-rollout", "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(max_tokens),
                 "--lr", "1e-6", "--attention-backend", "sdpa"] + (["--bf16"] if dtype == "bf16" else [])
        job = {"model": str(model), "ckpt": str(ckpt), "flags": flags, "urls": [f"http://127.0.0.1:{p}" for p in ports],
               "steps": steps, "out": str(work / "colocate.pt"), **batch}
        began = time.monotonic()
        mp.start_processes(_worker, args=(world, free_port(), job), nprocs=world, start_method="spawn")
        result = torch.load(job["out"])
    finally:
        for engine in engines:
            stop_engine(engine)
    summary = {"steps": steps, "ranks": world, "engines": len(ports), "mem_fraction": fraction,
               "dropped": result["dropped"], "wall_s": time.monotonic() - began,
               "phases": _summary(result["ranks"], fraction)}
    (out / "colocate_steps.json").write_text(json.dumps(result["ranks"]))
    print("RESULT " + json.dumps({"part": "colocate", **summary}), flush=True)
    return summary
