"""Trainer checkpoint save/load throughput: a megatron-core GPTModel with its AdamW state, saved by
trainer.checkpoint + trainer.megatron.state (torch_dist, manifest, fsync, rename, tracker), against
a plain fsync'd torch.save / torch.load of the same tensors in the same run.

    python -m bench.bench_trainer_ckpt [--workdir DIR] [--hidden 768] [--layers 6] [--repeats 3]

CPU, one process (TP=1). Files are read back from the page cache right after writing, both ways.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ckpt_tools.megatron_model import build_gpt_model, destroy_parallel, init_parallel
from trainer import checkpoint
from trainer.megatron.state import load_megatron, save_megatron


def qwen3_like(hidden: int, layers: int, vocab: int) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
            "intermediate_size": 4 * hidden, "num_hidden_layers": layers, "num_attention_heads": hidden // 64,
            "num_key_value_heads": hidden // 128, "head_dim": 64, "tie_word_embeddings": False}


def trained_state(config: dict) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model whose AdamW state exists (one step on random gradients)."""
    model = build_gpt_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def tensor_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = sum(v.numel() * v.element_size() for s in optimizer.state.values() for k, v in s.items() if k != "step")
    return params + moments


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def torch_save(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())


def torch_load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None, help="where to write (default: a temp folder)")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench_trainer_ckpt-", dir=args.workdir))
    try:
        init_parallel(tp=1)
        model, optimizer = trained_state(qwen3_like(args.hidden, args.layers, args.vocab))
        gb = tensor_bytes(model, optimizer) / 1e9
        print(f"model {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params fp32; "
              f"model + AdamW moments {gb:.2f} GB; {args.repeats} repeats")
        rows = {"megatron save": [], "torch.save + fsync": [], "megatron load": [], "torch.load": []}
        for i in range(args.repeats):
            rows["megatron save"].append(timed(lambda: checkpoint.save(
                workdir / "mc", i, lambda tmp: save_megatron(tmp, model, optimizer, {"rollout_id": i}), keep=1)))
            rows["torch.save + fsync"].append(timed(lambda: torch_save(workdir / "plain.pt", model, optimizer)))
            folder = checkpoint.find_loadable(workdir / "mc")
            rows["megatron load"].append(timed(lambda: load_megatron(folder, model, optimizer)))
            rows["torch.load"].append(timed(lambda: torch_load(workdir / "plain.pt", model, optimizer)))
        # Best of N estimates what the code can do on a shared, noisy machine; the median is shown too.
        for name, times in rows.items():
            print(f"{name:20s} first {times[0]:6.2f} s  best {min(times):6.2f} s ({gb / min(times):5.2f} GB/s)  "
                  f"median {statistics.median(times):6.2f} s ({gb / statistics.median(times):5.2f} GB/s)")
        for what in ("save", "load"):
            plain = "torch.save + fsync" if what == "save" else "torch.load"
            best = min(rows[plain]) / min(rows[f"megatron {what}"])
            median = statistics.median(rows[plain]) / statistics.median(rows[f"megatron {what}"])
            print(f"{what}: megatron / plain throughput = {best:.2f}x (best), {median:.2f}x (median)")
        destroy_parallel()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":  # dist_checkpointing's writers are processes: the guard is required
    main()
