"""GPU figures for the megatron backend's optimizer options of slime's 30B/32B recipes (issue 14):
one GRPO optimizer step of a Qwen3-0.6B-shaped model (random weights, bf16 autocast) on one GPU,
with the optimizer on the GPU (the baseline), with --optimizer-cpu-offload, and with
--overlap-cpu-optimizer-d2h-h2d too: the step's time and the GPU memory held after it (weights,
gradients, optimizer state) and at its peak, each as a ratio to the baseline, measured in this process.

    python bench/bench_optimizer_offload.py [--tiny] [--steps N]

Prints one "RESULT {json}" line per variant.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from ckpt_tools.megatron_model import destroy_parallel
from trainer.args import build_config, build_parser
from trainer.batch import TrainSample
from trainer.losses import LossConfig
from trainer.rl_step import make_pack_loss

QWEN3_06B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
             "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
             "rope_theta": 1e6, "tie_word_embeddings": True, "hidden_act": "silu"}
TINY = {**QWEN3_06B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
VARIANTS = {"on_device": [], "cpu_offload": ["--optimizer-cpu-offload"],
            "cpu_offload_overlap": ["--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d"]}
GIB = 2**30


def _samples(vocab: int, count: int, length: int, response: int) -> list[TrainSample]:
    g = torch.Generator().manual_seed(0)
    return [TrainSample(tokens=torch.randint(0, vocab, (length,), generator=g), response_length=response,
                        loss_mask=torch.ones(response), reward=0.0, group_index=k, advantages=torch.randn(response, generator=g),
                        old_log_probs=torch.full((response,), -5.0)) for k in range(count)]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_variant(model_dir: Path, flags: list[str], samples: list[TrainSample], steps: int) -> dict[str, float]:
    from trainer.megatron.backend import MegatronBackend

    config = build_config(build_parser().parse_args([
        "--hf-checkpoint", str(model_dir), "--num-rollout", "1", "--n-samples-per-prompt", "2",
        "--debug-train-only", "--load-debug-rollout-data", "unused/{rollout_id}", "--bf16",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192", "--lr", "1e-6", *flags]))
    backend = MegatronBackend(config, json.loads((model_dir / "config.json").read_text()))
    ids = list(range(len(samples)))
    loss = make_pack_loss(LossConfig(), samples, ids)
    backend.train_step(samples, ids, loss, need_entropy=False)  # warm-up: allocations, host copies
    _sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    for _ in range(steps):
        backend.train_step(samples, ids, loss, need_entropy=False)
    _sync()
    seconds = (time.perf_counter() - began) / steps
    held = torch.cuda.memory_allocated() / GIB if torch.cuda.is_available() else 0.0
    peak = torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else 0.0
    params = sum(p.numel() for p in backend.model.parameters())
    del backend
    destroy_parallel()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {"step_s": seconds, "held_gib": held, "peak_gib": peak, "params": params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="2-layer model (CPU dry run)")
    parser.add_argument("--steps", type=int, default=5)
    opts = parser.parse_args()
    config = TINY if opts.tiny else QWEN3_06B
    samples = _samples(config["vocab_size"], 8, 64 if opts.tiny else 1024, 16 if opts.tiny else 512)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        (model_dir / "config.json").write_text(json.dumps(config))
        base = None
        for name, flags in VARIANTS.items():
            figures = run_variant(model_dir, flags, samples, opts.steps)
            base = base or figures
            figures |= {"variant": name, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                        "tokens": sum(s.tokens.numel() for s in samples),
                        "step_ratio": figures["step_s"] / base["step_s"],
                        "held_ratio": figures["held_gib"] / base["held_gib"] if base["held_gib"] else 1.0,
                        "peak_ratio": figures["peak_gib"] / base["peak_gib"] if base["peak_gib"] else 1.0}
            print("RESULT " + json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
