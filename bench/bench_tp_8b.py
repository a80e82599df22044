"""Issue 31's TP=2 + SP goal, on a shape that needs it: Qwen3-8B's (8.2B parameters; with bf16 weights,
fp32 main gradients and Adam's fp32 state, about 147 GB at one rank, more than an 80 GB or a 141 GB
card holds), on 2 GPUs: TP=2 + sequence parallelism against DP=2 with the distributed optimizer (the
data-parallel layout that fits a 141 GB card, and not an 80 GB one), in tokens/s per GPU
(per_gpu_vs_baseline; the goal: TP=2 + SP >= 0.8x DP's), compiled as users run the trainer.

The weights are megatron's random init: an 8B checkpoint is not converted for a speed figure, and each
layout draws its own weights, so the rows' loss and log-probs are not compared (the layouts' equality is
bench_multi_gpu's, on the 0.6B shape from one checkpoint).

    python -m bench.bench_tp_8b [--samples 32] [--max-tokens-per-gpu 8192] [--no-compile] [--tiny]

--tiny: a CPU dry run of the same code on gloo, the small shape. One "RESULT {json}" line a layout.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
import transformers

from bench.bench_multi_gpu import CPU_BATCH, GPU_BATCH, NO_MULTICAST
from bench.bench_trainer_step import SHAPES
from bench.multigpu_layouts import run_layouts

QWEN3_8B = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1e6}
LAYOUTS = ["dp2_distopt", "tp2_sp"]  # the first is the baseline


def write_config(folder: Path, shape: dict) -> Path:
    """A model folder of config.json only (Qwen3-8B does not tie its embeddings): the layouts build from it."""
    config = transformers.Qwen3Config(**shape, tie_word_embeddings=False, dtype="bfloat16")
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=GPU_BATCH["samples"])
    parser.add_argument("--max-tokens-per-gpu", type=int, default=8192)
    parser.add_argument("--no-compile", action="store_true", help="the trainer uncompiled (users compile it)")
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: gloo, the small shape")
    opts = parser.parse_args()
    if opts.samples < 1 or opts.max_tokens_per_gpu < 1:
        raise SystemExit("--samples and --max-tokens-per-gpu must be at least 1")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not opts.tiny and gpus < 2:
        raise SystemExit(f"bench_tp_8b needs 2 GPUs ({gpus} visible); use --tiny for the CPU dry run")
    os.environ.update(NO_MULTICAST)
    shape = SHAPES["small"] if opts.tiny else QWEN3_8B
    batch = {**(CPU_BATCH if opts.tiny else GPU_BATCH), "samples": opts.samples}
    with tempfile.TemporaryDirectory() as tmp:
        model = write_config(Path(tmp) / "model", shape)
        run_layouts(model, None, shape, batch, Path(tmp), "fp32" if opts.tiny else "bf16",
                    64 if opts.tiny else opts.max_tokens_per_gpu, torch_compile=not opts.no_compile,
                    names=LAYOUTS, baseline=LAYOUTS[0])


if __name__ == "__main__":
    main()
