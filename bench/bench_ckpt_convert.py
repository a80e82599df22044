"""Conversion throughput and peak memory on a synthetic Qwen3-1.7B-shaped checkpoint (random bf16,
about 3.4 GB), against a raw fsync'd copy of the same bytes in the same run.

    python bench/bench_ckpt_convert.py [--workdir DIR] [--layers 28]

Each conversion runs as `python -m ckpt_tools ...` in a child process, so its peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from ckpt_tools.safetensors_stream import StreamingSafetensorsWriter

QWEN3_1_7B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
    "max_position_embeddings": 40960, "torch_dtype": "bfloat16",
}


def hf_tensors(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", (config["vocab_size"], h))]
    for l in range(config["num_hidden_layers"]):
        p = f"model.layers.{l}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                (p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i))]
    return out + [("model.norm.weight", (h,))]


def make_checkpoint(folder: Path, config: dict) -> int:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    tensors = hf_tensors(config)
    writer = StreamingSafetensorsWriter(folder, [(n, s, torch.bfloat16) for n, s in tensors], 2 * 1024**3)
    gen = torch.Generator().manual_seed(0)
    for name, shape in tensors:
        writer.write(name, torch.randn(shape, generator=gen, dtype=torch.float32).to(torch.bfloat16))
    writer.close()
    return writer.total_bytes


def raw_copy(src: Path, dst: Path) -> None:
    dst.mkdir()
    for f in sorted(src.iterdir()):
        with open(f, "rb") as i, open(dst / f.name, "wb") as o:
            shutil.copyfileobj(i, o, 16 * 1024**2)
            o.flush()
            os.fsync(o.fileno())


def timed_child(argv: list[str]) -> tuple[float, float]:
    """Run a command; its wall seconds and peak RSS in GiB."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)} failed")
    return elapsed, usage.ru_maxrss / 1024**2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--layers", type=int, default=28)
    args = parser.parse_args()
    config = {**QWEN3_1_7B, "num_hidden_layers": args.layers}
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.workdir))
    try:
        # Made in a child: a child's peak RSS counts what it inherits at fork, so this process stays small.
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            size = pool.submit(make_checkpoint, work / "hf", config).result()
        gb = size / 1e9
        largest = max(s[0] * (s[1] if len(s) > 1 else 1) for _, s in hf_tensors(config)) * 2 / 1024**3
        start = time.perf_counter()
        raw_copy(work / "hf", work / "copy")
        copy_s = time.perf_counter() - start
        shutil.rmtree(work / "copy")
        cli = [sys.executable, "-m", "ckpt_tools"]
        to_td_s, to_td_rss = timed_child([*cli, "hf-to-torch-dist", "--hf", str(work / "hf"), "--out",
                                          str(work / "td"), "--no-progress"])
        to_hf_s, to_hf_rss = timed_child([*cli, "torch-dist-to-hf", "--ckpt", str(work / "td"), "--out",
                                          str(work / "back"), "--hf-config", str(work / "hf"), "--no-progress"])
        print(f"checkpoint: Qwen3-1.7B shape, {args.layers} layers, {gb:.2f} GB bf16; largest tensor {largest:.2f} GiB")
        print(f"raw copy + fsync (baseline): {copy_s:6.1f} s  {gb / copy_s:5.2f} GB/s")
        for name, secs, rss in (("hf -> torch_dist", to_td_s, to_td_rss), ("torch_dist -> hf", to_hf_s, to_hf_rss)):
            print(f"{name:<28} {secs:6.1f} s  {gb / secs:5.2f} GB/s  ({copy_s / secs:.2f}x raw copy)  "
                  f"peak RSS {rss:.2f} GiB = {rss / (size / 1024**3):.2f}x model, {rss / largest:.1f}x largest tensor")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
