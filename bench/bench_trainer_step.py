"""Train-step throughput of the megatron backend, against plain HF transformers doing the same
work (forward, the same GRPO loss, backward, AdamW) on the same samples, in the same process.

    python -m bench.bench_trainer_step [--shape small|qwen3-0.6b] [--samples 32] [--min-len 64]
                                       [--max-len 256] [--repeats 5]

small: a Qwen3 of hidden 256, 4 layers, vocab 1024 (CPU). qwen3-0.6b: Qwen3-0.6B's shape (GPU;
bf16 compute, fp32 master weights, for both). The megatron backend packs the samples into
micro-batches of --max-tokens-per-gpu tokens; HF pads them into one batch. Both are timed per
optimizer step (median of --repeats) after warm-up steps. On a GPU each backend line also gives
its model FLOP/s as a share of --peak-tflops (MFU, bench_gpu_megatron's FLOP formula) and its
log-probs pass (forward only, as the trainer runs it before training) in tokens/s against the step's.
The megatron backend runs with --bf16 on a GPU (bf16 weights, fp32 main grads and masters).
--profile: the compiled step's top operations by GPU and by host time, and how busy the GPU was.
--busy-processes 1,3,7: the last variant's step timed again while that many other processes keep a CPU core
busy each (as the other ranks of a DP job do), against the same step alone: a host-bound step slows with them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import transformers

from trainer.args import build_config, build_parser, read_hf_config
from bench.bench_gpu_megatron import model_flops
from trainer.batch import Batching, TrainSample, rank_packs
from trainer.losses import LossConfig, total_loss
from trainer.rl_step import make_pack_loss, padded

SHAPES = {
    "small": dict(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1e6),
}


def make_model(folder: Path, shape: str) -> Path:
    config = transformers.Qwen3Config(**SHAPES[shape], tie_word_embeddings=True, dtype="float32")
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder


def make_samples(count: int, min_len: int, max_len: int, vocab: int) -> list[TrainSample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        total = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        response = total // 2
        s = TrainSample(tokens=torch.randint(0, vocab, (total,), generator=g), response_length=response,
                        loss_mask=torch.ones(response), reward=0.0, group_index=len(out), advantages=torch.randn(response, generator=g))
        s.old_log_probs = torch.full((response,), -7.0)
        out.append(s)
    return out


def packs(samples: list[TrainSample], max_tokens: int) -> list[list[int]]:
    """The sample lengths of each micro-batch, as the backend packs them (for the FLOP count)."""
    batching = Batching(dynamic=True, max_tokens=max_tokens, micro_batch_size=1)
    return [[samples[i].tokens.numel() for i in pack.sample_ids]
            for pack in rank_packs(samples, list(range(len(samples))), 1, 0, batching)]


def time_steps(step, repeats: int) -> float:
    for _ in range(2):  # warm-up (and torch.compile)
        step()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def profile_step(step) -> None:
    """One step under the torch profiler: the kernels that take the GPU's time, and how much of the
    step's wall time the GPU was busy (the rest is the host's)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - began
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
    print(f"    profiled step: {wall * 1e3:.1f} ms wall, GPU busy {busy * 1e3:.1f} ms ({busy / wall:.0%})")
    for key in ("self_cuda_time_total", "self_cpu_time_total"):
        print(events.table(sort_by=key, row_limit=20, max_name_column_width=70))


def with_busy_cores(count: int, step) -> float:
    """The step's seconds (time_steps) while `count` other processes each spin a CPU core."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        return time_steps(step, 5)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def hf_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, samples: list[TrainSample]) -> None:
    """The same loss on a padded batch: log-probs of the response tokens, policy loss, AdamW."""
    device = next(model.parameters()).device
    tokens = torch.nn.utils.rnn.pad_sequence([s.tokens for s in samples], batch_first=True).to(device)
    attention = padded([torch.ones(s.tokens.numel()) for s in samples]).long().to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(input_ids=tokens, attention_mask=attention).logits.float()
    logp_all = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    logps = [logp_all[i, s.prompt_length - 1: s.tokens.numel() - 1] for i, s in enumerate(samples)]
    loss, _ = total_loss(LossConfig(), padded(logps), *(padded([getattr(s, name) for s in samples]).to(device)
                                                          for name in ("old_log_probs", "advantages", "loss_mask")))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()


def hf_seconds(model_dir: Path, samples: list[TrainSample], device: str, repeats: int) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                               attn_implementation="sdpa").to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device == "cuda")
    return time_steps(lambda: hf_step(model, optimizer, samples), repeats)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--max-tokens-per-gpu", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H100/H200 SXM: 989)")
    parser.add_argument("--profile", action="store_true", help="print the compiled step's top GPU kernels (torch profiler)")
    parser.add_argument("--busy-processes", default="", help="e.g. 1,3,7: the last variant's step again beside "
                        "that many processes spinning a core each")
    opts = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29513")
    from trainer.megatron.backend import MegatronBackend

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "model", opts.shape)
        samples = make_samples(opts.samples, opts.min_len, opts.max_len, SHAPES[opts.shape]["vocab_size"])
        ids = list(range(len(samples)))
        tokens = sum(s.tokens.numel() for s in samples)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        baseline = hf_seconds(model_dir, samples, device, opts.repeats)
        print(f"{opts.shape}: {tokens} tokens in {len(samples)} samples of {opts.min_len}..{opts.max_len} tokens, "
              f"on {torch.cuda.get_device_name() if device == 'cuda' else f'{torch.get_num_threads()} CPU threads'}")
        print(f"  HF transformers (padded batch, sdpa):  {baseline * 1e3:8.1f} ms/step  {tokens / baseline:8.0f} tokens/s  1.00x")
        # On GPU the local attention's [heads, T, T] scores of a whole pack do not fit: sdpa only.
        variants = [("sdpa", []), ("sdpa", ["--torch-compile"])] if device == "cuda" else [("local", []), ("sdpa", [])]
        for attention, extra in variants:
            config = build_config(build_parser().parse_args([
                "--hf-checkpoint", str(model_dir), "--num-rollout", "1", "--n-samples-per-prompt", "2", "--debug-train-only",
                "--load-debug-rollout-data", "unused/{rollout_id}", "--attention-backend", attention,
                "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(opts.max_tokens_per_gpu), "--lr", "1e-6",
                *(["--bf16"] if device == "cuda" else []), *extra]))
            backend = MegatronBackend(config, read_hf_config(str(model_dir)))
            loss = make_pack_loss(LossConfig(), samples, ids)
            seconds = time_steps(partial(backend.train_step, samples, ids, loss, False), opts.repeats)
            name = f"megatron backend, {attention} attention{' compiled' if extra else ''}:"
            print(f"  {name:39s} {seconds * 1e3:8.1f} ms/step  {tokens / seconds:8.0f} tokens/s  "
                  f"{baseline / seconds:.2f}x")
            if device == "cuda":
                flops = sum(model_flops(SHAPES[opts.shape], pack) for pack in packs(samples, opts.max_tokens_per_gpu))
                forward = time_steps(partial(backend.log_probs, samples, ids), opts.repeats)
                print(f"    {flops / seconds / 1e12:6.1f} TFLOP/s = {flops / seconds / 1e12 / opts.peak_tflops:.1%} MFU; "
                      f"log-probs pass {forward * 1e3:.1f} ms, {tokens / forward:.0f} tokens/s = "
                      f"{seconds / forward:.2f}x the step's")
                if opts.profile and extra:
                    profile_step(partial(backend.train_step, samples, ids, loss, False))
            if (attention, extra) == variants[-1]:
                for count in [int(n) for n in opts.busy_processes.split(",") if n]:
                    busy = with_busy_cores(count, partial(backend.train_step, samples, ids, loss, False))
                    print(f"    beside {count} busy processes: {busy * 1e3:8.1f} ms/step, {seconds / busy:.2f}x "
                          f"the step alone")
            del backend
            # one backend per process in megatron's global state: tear it down before the next
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
