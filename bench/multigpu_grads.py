"""Per-parameter gradients of one RL step in each layout, against TP=1's (issue 29: under
--torch-compile at TP=2 + SP on 2 GPUs the gradient norm was 0.278 against TP=1's 1.490 while loss
and log-probs agreed, so something reduced over the TP group was lost). Each layout runs in its own
spawned processes, one rank a GPU (gloo on the CPU), from the same converted checkpoint:

    python -m bench.multigpu_grads [--shape tiny|qwen3-0.6b] [--dtype fp32|bf16] [--variants tp1,tp2_sp,...]

A variant is a layout with `+compile` for --torch-compile. Every row is a "RESULT {json}" line: loss,
grad norm and the parameters whose gradient differs most from TP=1's (relative L2, each TP shard's
squares summed over the TP group), and the largest difference of the fp32 master weights after the
step.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from bench.bench_trainer_step import make_model, make_samples
from ckpt_tools.convert import hf_to_torch_dist
from rollout.tiny_model import write_tiny_model
from tests.rollout.servers import free_port
from trainer.args import build_config, build_parser
from trainer.losses import LossConfig
from trainer.rl_step import make_pack_loss

LAYOUTS = {  # name -> (ranks, flags)
    "tp1": (1, []),
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "dp2": (2, ["--use-distributed-optimizer"]),
}
BATCHES = {"tiny": {"samples": 8, "min_len": 16, "max_len": 48, "max_tokens": 64},
           "qwen3-0.6b": {"samples": 32, "min_len": 256, "max_len": 768, "max_tokens": 4096}}


def _worker(rank: int, world: int, port: int, job: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from megatron.core import parallel_state as ps

    from trainer import dist_env, main_grads
    from trainer.megatron.backend import MegatronBackend

    config = build_config(build_parser().parse_args(job["flags"]))
    backend = MegatronBackend(config, json.loads((Path(job["model"]) / "config.json").read_text()))
    backend.load(Path(job["ckpt"]), weights_only=True)
    grads: dict[str, float] = {}
    reduce = backend._reduce_gradients

    def reduce_and_record(model) -> None:
        reduce(model)
        for name, p in model.named_parameters():
            g = main_grads.grad_of(p)
            if g is None:
                continue
            sq = g.float().pow(2).sum()
            if getattr(p, "tensor_model_parallel", False):
                torch.distributed.all_reduce(sq, group=ps.get_tensor_model_parallel_group())
            grads[name] = float(sq.sqrt())

    backend._reduce_gradients = reduce_and_record
    batch = job["batch"]
    samples = make_samples(batch["samples"], batch["min_len"], batch["max_len"], backend.shape.vocab_size)
    ids = list(range(len(samples)))
    logps = backend.log_probs(samples, ids)
    for i, s in enumerate(samples):
        s.old_log_probs = logps[i][0].detach().cpu().float() + (0.3 if i % 2 else -0.3)
    metrics = backend.train_step(samples, ids, make_pack_loss(LossConfig(), samples, ids), need_entropy=False)
    weights = {n: t.detach().float().cpu().clone() for n, t in backend.hf_weights()}  # collective: every rank
    if rank == 0:
        torch.save({"metrics": metrics, "grads": grads, "weights": weights}, job["out"])
    dist_env.shutdown()


def run(variants: list[str], shape: str, dtype: str, work: Path) -> list[dict]:
    model = write_tiny_model(work / "model", seed=0) if shape == "tiny" else make_model(work / "model", shape)
    ckpt = hf_to_torch_dist(model, work / "torch_dist", iteration=None, progress=False)
    batch = BATCHES[shape]
    common = ["--hf-checkpoint", str(model), "--num-rollout", "1", "--n-samples-per-prompt", "2",
              "--debug-train-only", "--load-debug-rollout-data", "unused/{rollout_id}", "--use-dynamic-batch-size",
              "--max-tokens-per-gpu", str(batch["max_tokens"]), "--lr", "1e-2", "--attention-backend", "sdpa",
              "--adam-eps", "1", "--clip-grad", "0"] + (["--bf16"] if dtype == "bf16" else [])
    rows, base = [], None
    for variant in variants:
        layout, _, compiled = variant.partition("+")
        world, flags = LAYOUTS[layout]
        out = work / f"{variant}.pt"
        job = {"model": str(model), "ckpt": str(ckpt), "batch": batch, "out": str(out),
               "flags": common + flags + (["--torch-compile"] if compiled else [])}
        try:
            mp.start_processes(_worker, args=(world, free_port(), job), nprocs=world, start_method="spawn")
        except mp.ProcessRaisedException as err:
            rows.append({"variant": variant, "error": str(err).strip().splitlines()[-1]})
            print("RESULT " + json.dumps(rows[-1]), flush=True)
            continue
        got = torch.load(out)
        base = base or got
        rel = {n: abs(g - base["grads"][n]) / max(base["grads"][n], 1e-12) for n, g in got["grads"].items()
               if n in base["grads"]}
        worst = sorted(rel.items(), key=lambda kv: -kv[1])[:6]
        row = {"variant": variant, "shape": shape, "dtype": dtype, "loss": got["metrics"]["loss"],
               "grad_norm": got["metrics"]["grad_norm"], "base_grad_norm": base["metrics"]["grad_norm"],
               "worst_grads": [(n, float(f"{r:.3g}"), got["grads"][n], base["grads"][n]) for n, r in worst],
               "d_weights_max": max(float((got["weights"][n] - t).abs().max()) for n, t in base["weights"].items())}
        rows.append(row)
        print("RESULT " + json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="tiny", choices=sorted(BATCHES))
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--variants", default="tp1,tp1+compile,tp2_sp,tp2_sp+compile")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run(opts.variants.split(","), opts.shape, opts.dtype, Path(tmp))


if __name__ == "__main__":
    main()
