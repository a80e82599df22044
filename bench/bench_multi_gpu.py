"""The multi-GPU run (issue 19) on 2 GPUs, or on the CPU with gloo and tiny shapes (--tiny):

1. layouts: the megatron backend at TP=2 + SP, PP=2 and DP=2 (distributed optimizer) against TP=1
   on the same batch (log-probs, loss, grad norm), step time and MFU per layout on the Qwen3-0.6B
   shape; reshard: a TP=2 checkpoint resumed at TP=1 and at PP=2 (bench/multigpu_layouts.py; also
   tests/gpu/test_multi_gpu.py);
2. weights: a weight update over NCCL, trainer on GPU 0 -> engine-side process on GPU 1, for a
   Qwen3-0.6B (1.2 GB) and a Qwen3-4B (8 GB) set of tensors, against a plain broadcast of the same
   bytes (bench/multigpu_weights.py);
3. colocate: a 2-rank trainer with --offload-train and engine-side processes on the same GPUs,
   --steps steps (bench/multigpu_colocate.py).

    python -m bench.bench_multi_gpu [--tiny] [--parts layouts,reshard,weights,colocate] [--out DIR]
        [--torch-compile] [--max-tokens-per-gpu N] [--samples N] [--update-weight-buffer-size BYTES]
        [--weight-engines N]

--torch-compile and --max-tokens-per-gpu set the layouts' (and colocate's) trainer as a user runs it
(issue 31 measured users' figures with --torch-compile --max-tokens-per-gpu 8192); --samples sizes
the layouts' batch (32 samples of 256-768 tokens by default);
--update-weight-buffer-size is the publisher's bucket (slime's flag and default), --weight-engines
how many engine processes one update reaches at once.

Every figure is a "RESULT {json}" line; all of them go to DIR/multigpu.json (DIR: $OUT, else
./multigpu-out). NVLink multicast stays off in every process (NCCL_NVLS_ENABLE=0 and friends).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from bench.bench_trainer_step import SHAPES, make_model
from ckpt_tools.convert import hf_to_torch_dist
from rollout.tiny_model import write_tiny_model
from trainer.publish import DEFAULT_BUCKET_BYTES

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
QWEN3_4B = {"vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
TINY_WEIGHTS = {"tiny-a": SHAPES["small"], "tiny-b": {**SHAPES["small"], "num_hidden_layers": 8}}
# Batches: the GPU's 32 samples of 256..768 tokens in packs of 4096 tokens (a few micro-batches per
# step, so that PP=2 pipelines); the CPU's a handful of short ones.
GPU_BATCH = {"samples": 32, "min_len": 256, "max_len": 768, "repeats": 3}
CPU_BATCH = {"samples": 8, "min_len": 16, "max_len": 48, "repeats": 2}


def _layouts(opts, model, ckpt, shape, batch, dtype, max_tokens, work, out):
    from bench import multigpu_layouts

    return multigpu_layouts.run_layouts(model, ckpt, shape, batch, work, dtype, max_tokens, opts.torch_compile,
                                        opts.layouts.split(",") if opts.layouts else None, opts.profile)


def _reshard(opts, model, ckpt, shape, batch, dtype, max_tokens, work, out):
    from bench import multigpu_layouts

    tiny = write_tiny_model(work / "tiny")
    return multigpu_layouts.run_reshard(tiny, hf_to_torch_dist(tiny, work / "tiny_dist", iteration=None,
                                                               progress=False), work)


def _weights(opts, model, ckpt, shape, batch, dtype, max_tokens, work, out):
    from bench import multigpu_weights

    shapes = TINY_WEIGHTS if opts.tiny else {"qwen3-0.6b": SHAPES["qwen3-0.6b"], "qwen3-4b": QWEN3_4B}
    return multigpu_weights.run(shapes, opts.weight_repeats, out, opts.update_weight_buffer_size, opts.weight_engines,
                               opts.profile)


def _colocate(opts, model, ckpt, shape, batch, dtype, max_tokens, work, out):
    from bench import multigpu_colocate

    return multigpu_colocate.run(model, ckpt, shape, batch, opts.steps, opts.mem_fraction, work, out, dtype,
                                 max_tokens)


PARTS = {"layouts": _layouts, "reshard": _reshard, "weights": _weights, "colocate": _colocate}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: gloo, tiny shapes")
    parser.add_argument("--parts", default="layouts,reshard,weights,colocate")
    parser.add_argument("--out", default=os.environ.get("OUT") or "multigpu-out")
    parser.add_argument("--steps", type=int, default=20, help="colocated steps")
    parser.add_argument("--mem-fraction", type=float, default=0.8,
                        help="the colocated engines' share of each GPU (weights + KV cache)")
    parser.add_argument("--weight-repeats", type=int, default=3)
    parser.add_argument("--torch-compile", action="store_true", help="the layouts' trainer compiled, as users run it")
    parser.add_argument("--layouts", help="comma-separated layouts to run (TP=1, the baseline, always runs), e.g. "
                        "dp2_distopt; default: all")
    parser.add_argument("--profile", action="store_true",
                        help="print each layout's ops of one more step (torch.profiler); profile one more weight "
                             "update's trainer side (cProfile, OUT/profile_publish_*.txt)")
    parser.add_argument("--max-tokens-per-gpu", type=int, default=None,
                        help="the layouts' pack size (default: 4096 on GPUs, 64 with --tiny)")
    parser.add_argument("--update-weight-buffer-size", type=int, default=DEFAULT_BUCKET_BYTES,
                        help="the weight update's bucket in bytes (slime's default: 512 MiB)")
    parser.add_argument("--weight-engines", type=int, default=1, help="engine processes one weight update reaches")
    parser.add_argument("--samples", type=int, default=None,
                        help=f"the layouts' batch in samples (default {GPU_BATCH['samples']}, ~16k tokens; a user's "
                             "step holds more)")
    opts = parser.parse_args()
    for flag, value in (("--max-tokens-per-gpu", opts.max_tokens_per_gpu),
                        ("--update-weight-buffer-size", opts.update_weight_buffer_size),
                        ("--weight-engines", opts.weight_engines), ("--samples", opts.samples)):
        if value is not None and value < 1:
            raise SystemExit(f"{flag} must be at least 1, got {value}")
    os.environ.update(NO_MULTICAST)  # inherited by every process this one starts
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not opts.tiny and gpus < 2:
        raise SystemExit(f"bench_multi_gpu needs 2 GPUs ({gpus} visible); use --tiny for the CPU dry run")
    shape = SHAPES["small"] if opts.tiny else SHAPES["qwen3-0.6b"]
    batch, dtype = (CPU_BATCH, "fp32") if opts.tiny else (GPU_BATCH, "bf16")
    batch = {**batch, "samples": opts.samples or batch["samples"]}
    max_tokens = opts.max_tokens_per_gpu or (64 if opts.tiny else 4096)
    parts = opts.parts.split(",")
    results: dict = {"machine": torch.cuda.get_device_name(0) if gpus else "cpu", "gpus": gpus,
                     "torch": torch.__version__, "shape": shape, "batch": batch, "dtype": dtype, "parts": parts,
                     "torch_compile": opts.torch_compile, "max_tokens_per_gpu": max_tokens,
                     "update_weight_buffer_size": opts.update_weight_buffer_size, "weight_engines": opts.weight_engines}
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = ckpt = None
        if "layouts" in parts or "colocate" in parts:
            model = make_model(work / "model", "small" if opts.tiny else "qwen3-0.6b")
            ckpt = hf_to_torch_dist(model, work / "torch_dist", iteration=None, progress=False)
            print(f"model and checkpoint ready after {time.monotonic() - began:.0f} s", flush=True)
        for part in ("layouts", "reshard", "weights", "colocate"):
            if part in parts:
                try:
                    results[part] = PARTS[part](opts, model, ckpt, shape, batch, dtype, max_tokens, work, out)
                except Exception as err:  # noqa: BLE001 (a part's failure is recorded; the next part runs)
                    results[part] = {"error": f"{type(err).__name__}: {str(err).strip().splitlines()[-1:]}"}
                    print(f"RESULT {json.dumps({'part': part, **results[part]})}", flush=True)
    results["wall_s"] = time.monotonic() - began
    (out / "multigpu.json").write_text(json.dumps(results, indent=1))
    print(f"done in {results['wall_s']:.0f} s; {out / 'multigpu.json'}", flush=True)


if __name__ == "__main__":
    main()
