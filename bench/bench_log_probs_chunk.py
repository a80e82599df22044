"""--log-probs-chunk-size: the peak memory and time of one training micro-batch's log-probs and
entropies (forward and backward) from [tokens, vocab] logits, whole against chunked.

    python -m bench.bench_log_probs_chunk [--tokens 4096] [--vocab 151936] [--chunk 512]

On a GPU: bf16 logits, peak CUDA memory above the logits themselves, the best of 3 runs after a
warm-up. On the CPU: fp32 logits, each variant in a fresh child process, its peak RSS above the
RSS it had once the logits were made.
Prints each variant's figures and their ratio to the whole computation's (the baseline).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from trainer.token_stats import chunked_log_probs_and_entropy

CHILD_S = 600  # one CPU variant's child process
REPEATS = 3  # timed runs of each variant on a GPU, after one to warm up


def measure(tokens: int, vocab: int, chunk: int, device: str) -> dict[str, float]:
    """Seconds and bytes above the logits for one forward + backward of log-probs and entropies."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(tokens, vocab, device=device, dtype=dtype, generator=g).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    logp, ent = chunked_log_probs_and_entropy(logits, targets, with_entropy=True, chunk_size=chunk)
    assert ent is not None
    (logp.sum() + ent.sum()).backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"seconds": time.perf_counter() - start, "peak_bytes": float(peak)}


def _in_child(tokens: int, vocab: int, chunk: int) -> dict[str, float]:
    code = (f"import json; from bench.bench_log_probs_chunk import measure; "
            f"print(json.dumps(measure({tokens}, {vocab}, {chunk}, 'cpu')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=CHILD_S, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)  # Qwen3's
    parser.add_argument("--chunk", type=int, default=512)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    run = (lambda chunk: measure(args.tokens, args.vocab, chunk, "cuda")) if cuda else \
        (lambda chunk: _in_child(args.tokens, args.vocab, chunk))
    if cuda:  # each variant warmed up (kernels, the allocator), then the best of REPEATS
        whole, chunked = (min([run(chunk) for _ in range(REPEATS + 1)][1:], key=lambda r: r["seconds"])
                          for chunk in (-1, args.chunk))
    else:
        whole, chunked = run(-1), run(args.chunk)
    where = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"log-probs + entropies, forward + backward, {args.tokens} tokens x {args.vocab} vocab on {where}")
    for name, result in (("whole (baseline)", whole), (f"--log-probs-chunk-size {args.chunk}", chunked)):
        time_ratio, memory_ratio = result["seconds"] / whole["seconds"], result["peak_bytes"] / whole["peak_bytes"]
        print(f"  {name:32s} {result['seconds']:8.3f} s  peak {result['peak_bytes'] / 2**30:7.2f} GiB  "
              f"time {time_ratio:.2f}x  memory {memory_ratio:.2f}x")


if __name__ == "__main__":
    main()
