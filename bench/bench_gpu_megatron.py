"""GPU figures for the megatron backend (issue 5): fused attention, HF parity, GRPO-step throughput,
TP=2, and NCCL weight broadcast. Qwen3-0.6B-shaped, random weights.

    python bench/bench_gpu_megatron.py single          # one GPU: attention kernels, HF parity, TP=1 steps
    torchrun --nproc-per-node 2 bench/bench_gpu_megatron.py dist   # TP=2 parity + steps, weight broadcast

`single --only 5,4` runs just those TRAIN_VARIANTS (by index, in that order; no parity, no
kernels). `single` must run first: it writes the converted checkpoint and the TP=1 logits that `dist`
compares against (under --work). `--tiny` runs the same code on a 2-layer model (CPU dry run).
Every figure is printed as one JSON line prefixed "RESULT " and appended to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from ckpt_tools.convert import hf_to_torch_dist
from ckpt_tools.megatron_model import (
    destroy_parallel,
    init_parallel,
    load_torch_dist,
    transformer_config_from_hf,
)
from trainer.megatron import attention as megatron_attention
from trainer.losses import policy_loss
from trainer.megatron.attention import SDPAttention, gpt_layer_spec

H200_BF16_PEAK = 989e12  # dense bf16 datasheet peak (no sparsity); KINDS.md measured ~790e12 for a large GEMM
QWEN3_06B = {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
             "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": True}
TINY = {**QWEN3_06B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclasses.dataclass
class Setup:
    shape: dict  # Qwen3Config kwargs
    batch: int  # unpacked rows
    seq: int  # unpacked row length; a pack holds batch * seq tokens
    parity_seq: int
    work: Path
    out: Path

    @property
    def hf_config(self) -> dict:
        config = transformers.Qwen3Config(**self.shape)
        return {**config.to_dict(), "architectures": ["Qwen3ForCausalLM"]}

    def pack_lengths(self, seed: int = 0) -> list[int]:
        """Sample lengths between seq/16 and seq, filling exactly batch * seq tokens."""
        rng, left, lengths = random.Random(seed), self.batch * self.seq, []
        while left:
            lengths.append(min(left, rng.randint(self.seq // 16, self.seq)))
            left -= lengths[-1]
        return lengths


def report(setup: Setup, name: str, **figures) -> None:
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    line = json.dumps({"name": name, **figures})
    print("RESULT", line, flush=True)
    with setup.out.open("a") as f:
        f.write(line + "\n")


def section(name: str, fn: Callable[[], None]) -> None:
    """Run one part; a failure is printed and the next part still runs (one device call, many parts)."""
    t0 = time.time()
    try:
        fn()
    except Exception:  # noqa: BLE001 - report and go on
        traceback.print_exc()
        print(f"SECTION {name} FAILED", flush=True)
    if DEVICE == "cuda":  # the part's model is gone: hand its cached memory back for the next one
        torch.cuda.empty_cache()
    print(f"SECTION {name} took {time.time() - t0:.1f} s", flush=True)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Mean wall time of fn in ms over iters runs, after warmup runs (device synchronised)."""
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters * 1e3


def packed_params(lengths: list[int], cu_device: str = "cpu") -> PackedSeqParams:
    """thd params; cu_seqlens on the CPU unless cu_device says otherwise (see trainer.megatron.attention)."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    cu = cu.to(cu_device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


def positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n, device=DEVICE) for n in lengths])


def build_model(setup: Setup, attention: str, dtype: torch.dtype, tp: int = 1, fuse_swiglu: bool = False) -> GPTModel:
    config, kwargs = transformer_config_from_hf(setup.hf_config, tp=tp, params_dtype=dtype)
    # bias_swiglu_impl is megatron's torch.compile'd SwiGLU (no TransformerEngine needed).
    config = dataclasses.replace(config, bias_activation_fusion=fuse_swiglu)
    spec = gpt_layer_spec(num_experts=None, qk_layernorm=True, attention=attention)
    model = GPTModel(config=config, transformer_layer_spec=spec, **kwargs)
    return model.to(DEVICE)


def forward_logits(model: GPTModel, ids: torch.Tensor, lengths: list[int] | None = None, gather: bool = False,
                   causal_mask: bool = False, cu_device: str = "cpu") -> torch.Tensor:
    """Logits [b, s, V(/tp)] of an unpacked batch, or of one packed row when lengths is given."""
    if lengths is not None:
        return model(ids, positions(lengths)[None], None, packed_seq_params=packed_params(lengths, cu_device),
                     runtime_gather_output=gather)
    pos = torch.arange(ids.shape[1], device=DEVICE).expand_as(ids)
    # Megatron's local attention allocates its default mask on "cuda": CPU needs an explicit one.
    mask = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=DEVICE), 1)[None, None] \
        if causal_mask else None
    return model(ids, pos, mask, runtime_gather_output=gather)


# ---------------------------------------------------------------------------------------------
# attention kernels alone


def bench_attention(setup: Setup) -> None:
    """Core attention forward + backward on one layer's q/k/v (bf16): unpacked, and packed three ways."""
    s = setup.shape
    heads, groups, dim = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    tokens = setup.batch * setup.seq
    lengths = setup.pack_lengths()
    dtype = torch.bfloat16
    config, _ = transformer_config_from_hf(setup.hf_config, params_dtype=dtype)
    attn = SDPAttention(config, 1, AttnMaskType.causal, "self")

    def qkv(*lead: int) -> list[torch.Tensor]:
        return [torch.randn(*lead, h, dim, device=DEVICE, dtype=dtype, requires_grad=True)
                for h in (heads, groups, groups)]

    def fwd_bwd(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        return lambda: fn().float().square().mean().backward()

    q, k, v = qkv(setup.seq, setup.batch)
    results = {"unpacked_sdpa_gqa": time_ms(fwd_bwd(lambda: attn(q, k, v, None)), 20)}

    def expanded() -> torch.Tensor:
        rep = heads // groups
        return attn(q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2), None)
    results["unpacked_sdpa_expand_kv"] = time_ms(fwd_bwd(expanded), 20)

    tq, tk, tv = qkv(tokens)
    params = packed_params(lengths)

    def loop() -> torch.Tensor:  # the module's CPU path: hide the varlen kernel for this call
        saved, megatron_attention.varlen_attn = megatron_attention.varlen_attn, None
        try:
            return attn(tq, tk, tv, None, packed_seq_params=params)
        finally:
            megatron_attention.varlen_attn = saved

    seq_id = torch.repeat_interleave(torch.arange(len(lengths), device=DEVICE), torch.tensor(lengths, device=DEVICE))
    idx = torch.arange(tokens, device=DEVICE)
    # Block-diagonal causal mask (True = attend); SDPA's masked kernels take no GQA: expand k/v.
    block = (seq_id[:, None] == seq_id[None, :]) & (idx[:, None] >= idx[None, :])

    def block_mask() -> torch.Tensor:
        rep = heads // groups
        q4, k4, v4 = (x.transpose(0, 1)[None] for x in (tq, tk.repeat_interleave(rep, 1), tv.repeat_interleave(rep, 1)))
        return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=block, scale=attn.softmax_scale)[0].transpose(0, 1)

    outputs = {"loop": loop(), "varlen": attn(tq, tk, tv, None, packed_seq_params=params), "block_mask": block_mask()}
    for name, fn in (("loop", loop), ("block_mask", block_mask),
                     ("varlen", lambda: attn(tq, tk, tv, None, packed_seq_params=params))):
        results[f"packed_{name}"] = time_ms(fwd_bwd(fn), 20)
    diffs = {f"packed_{n}_vs_loop_maxdiff": (o.float().reshape(tokens, -1) - outputs["loop"].float().reshape(tokens, -1))
             .abs().max().item() for n, o in outputs.items() if n != "loop"}
    report(setup, "attention_fwd_bwd_ms", layout=f"unpacked {setup.batch}x{setup.seq}; packed {tokens} tokens "
           f"from {len(lengths)} samples", heads=heads, groups=groups, head_dim=dim,
           varlen_available=megatron_attention.varlen_attn is not None, **results, **diffs)


# ---------------------------------------------------------------------------------------------
# parity with Hugging Face


def logprob_diffs(a: torch.Tensor, b: torch.Tensor, ids: torch.Tensor) -> dict[str, float]:
    """Max |log_softmax(a) - log_softmax(b)| over the vocabulary, and over the next-token log-probs."""
    la, lb = (F.log_softmax(x.float(), -1) for x in (a, b))
    target = ids[:, 1:, None]
    tok = (la[:, :-1].gather(-1, target) - lb[:, :-1].gather(-1, target)).abs()
    return {"all_vocab": (la - lb).abs().max().item(), "next_token": tok.max().item(), "next_token_mean": tok.mean().item()}


def bench_parity(setup: Setup) -> None:
    """Random HF Qwen3 (fp32) -> torch_dist -> megatron (sdpa spec); logits vs HF in fp32 and bf16."""
    torch.manual_seed(0)
    hf_dir, ckpt_root = setup.work / "hf", setup.work / "ckpt"
    with torch.device(DEVICE):
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**setup.shape)).eval()
    hf.config.architectures = ["Qwen3ForCausalLM"]
    with torch.no_grad():  # norm weights away from 1, so a misplaced norm shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    hf.save_pretrained(hf_dir)
    t0 = time.time()
    ckpt = hf_to_torch_dist(hf_dir, ckpt_root, make_vocab_size_divisible_by=128, progress=False)
    convert_s = time.time() - t0
    hf_config = json.loads((hf_dir / "config.json").read_text())
    vocab = hf_config["vocab_size"]
    ids = torch.randint(0, vocab, (2, setup.parity_seq), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))
    model = build_model(setup, "sdpa", torch.float32).eval()
    load_torch_dist(model, ckpt)
    figures: dict[str, object] = {"convert_s": round(convert_s, 1), "tokens": list(ids.shape)}
    saved = {}
    with torch.no_grad():
        ref32 = hf(ids).logits.float()
        for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            hf.to(dtype), model.to(dtype)
            meg = forward_logits(model, ids)[..., :vocab]
            figures[f"{tag}_megatron_vs_hf"] = logprob_diffs(meg, hf(ids).logits, ids)
            figures[f"{tag}_megatron_vs_hf_fp32"] = logprob_diffs(meg, ref32, ids)
            # The same two rows packed into one thd row must give the same logits (varlen path on GPU).
            packed = forward_logits(model, ids.reshape(1, -1), lengths=[setup.parity_seq] * 2)[..., :vocab]
            figures[f"{tag}_packed_vs_unpacked"] = logprob_diffs(packed.reshape_as(meg), meg, ids)
            saved[tag] = meg.float().cpu()
    torch.save({"ids": ids.cpu(), **saved}, setup.work / "tp1_logits.pt")
    report(setup, "parity_megatron_sdpa_vs_hf_logprob_maxabs", **figures)


# ---------------------------------------------------------------------------------------------
# training step


class MasterAdamW:
    """bf16 model, fp32 master weights, gradients and AdamW state (torch's fused AdamW on the masters)."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float = 1e-6) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().float() for p in self.params]
        for m in self.master:
            m.grad = torch.empty_like(m)
        self.opt = torch.optim.AdamW(self.master, lr=lr, weight_decay=0.01, fused=DEVICE == "cuda")

    def step(self) -> None:
        torch._foreach_copy_([m.grad for m in self.master], [p.grad for p in self.params])
        for p in self.params:
            p.grad = None
        self.opt.step()
        torch._foreach_copy_([p.data for p in self.params], self.master)


def model_flops(s: dict, lengths: list[int]) -> float:
    """For a model of HF config fields `s`: 6 * matmul params * tokens (layers + LM head) + causal
    attention 12 * L * hq * sum(l^2) / 2."""
    h, hq, hkv = s["hidden_size"], s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    per_layer = h * (hq + 2 * hkv) + hq * h + 3 * h * s["intermediate_size"]
    matmul_params = s["num_hidden_layers"] * per_layer + s["vocab_size"] * h
    attention = 12 * s["num_hidden_layers"] * hq * sum(n * n for n in lengths) / 2
    return 6 * matmul_params * sum(lengths) + attention


@dataclasses.dataclass(frozen=True)
class Variant:
    attention: str  # "local" or "sdpa"
    packed: bool  # one thd row of batch * seq tokens instead of batch x seq
    fuse_swiglu: bool = False
    compile: bool = False  # torch.compile each transformer layer and the loss
    cu_device: str = "cpu"  # where the packs' cu_seqlens live

    def __str__(self) -> str:
        return " ".join([self.attention, *(["packed", f"cu_seqlens on {self.cu_device}"] if self.packed else []),
                         *(["swiglu-fused"] if self.fuse_swiglu else []), *(["compiled"] if self.compile else [])])


def grpo_loss(logits: torch.Tensor, targets: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Next-token log-probs from (vocab-parallel) logits in fp32, then the PPO-clip policy loss."""
    logp = -tensor_parallel.vocab_parallel_cross_entropy(logits, targets)
    return policy_loss(logp, logp.detach(), advantages, mask, eps_clip=0.2, per_token_loss=True)[0]


def bench_train(setup: Setup, variant: Variant, tp: int = 1, steps: int = 12, profile: bool = False) -> None:
    """GRPO-style step: forward, log-probs, policy_loss with random advantages, backward, AdamW.
    Packed steps rotate over 3 pack layouts (same token count, different sample lengths), as a run would."""
    torch.manual_seed(0)
    model = build_model(setup, variant.attention, torch.bfloat16, tp=tp, fuse_swiglu=variant.fuse_swiglu).train()
    loss_fn = grpo_loss
    if variant.compile:
        # Layers are identical: one compiled graph serves all of them.
        for layer in model.decoder.layers:
            layer.compile()
        loss_fn = torch.compile(grpo_loss)
    opt = MasterAdamW(list(model.parameters()))
    vocab, tokens = setup.shape["vocab_size"], setup.batch * setup.seq
    layouts = [setup.pack_lengths(seed) for seed in range(3)] if variant.packed else [[setup.seq] * setup.batch]
    gen = torch.Generator(DEVICE).manual_seed(2)
    ids = torch.randint(0, vocab, (1, tokens) if variant.packed else (setup.batch, setup.seq), device=DEVICE,
                        generator=gen)
    targets = ids.roll(-1, dims=-1)
    advantages = torch.randn(ids.shape, device=DEVICE, generator=gen)
    masks = []
    for lengths in layouts:
        masks.append(torch.ones_like(ids, dtype=torch.float32))
        masks[-1].view(-1)[torch.tensor(lengths, device=DEVICE).cumsum(0) - 1] = 0  # a sample's last token predicts nothing
    calls = iter(range(10**9))

    def step() -> None:
        i = next(calls) % len(layouts)
        logits = forward_logits(model, ids, layouts[i] if variant.packed else None, causal_mask=DEVICE == "cpu",
                                cu_device=variant.cu_device)
        loss_fn(logits, targets, advantages, masks[i]).backward()
        opt.step()

    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    ms = time_ms(step, steps, warmup=2 * len(layouts))
    flops = sum(model_flops(setup.shape, lengths) for lengths in layouts) / len(layouts)
    report(setup, "train_step", variant=str(variant), tp=tp,
           layout=f"1x{tokens} thd, {[len(x) for x in layouts]} samples" if variant.packed else f"{setup.batch}x{setup.seq}",
           ms_per_step=round(ms, 1), tokens_per_s=round(tokens / ms * 1e3), model_tflop_per_step=round(flops / 1e12, 2),
           tflops_per_gpu=round(flops / ms * 1e3 / tp / 1e12, 1), mfu_vs_989=round(flops / (ms / 1e3) / tp / H200_BF16_PEAK, 3),
           peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1) if DEVICE == "cuda" else None,
           compiled_graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before)
    if profile and DEVICE == "cuda":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            sync()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
        (setup.out.parent / "profile.txt").write_text(f"{variant}, 2 steps\n{table}")
        print(table, flush=True)


TRAIN_VARIANTS = (
    Variant("local", False), Variant("sdpa", False), Variant("sdpa", False, fuse_swiglu=True),
    Variant("sdpa", True, fuse_swiglu=True, cu_device=DEVICE), Variant("sdpa", True, fuse_swiglu=True),
    Variant("sdpa", False, fuse_swiglu=True, compile=True), Variant("sdpa", True, fuse_swiglu=True, compile=True),
)
PROFILED = TRAIN_VARIANTS[-1]


def run_single(setup: Setup, only: list[int] | None = None) -> None:
    init_parallel(tp=1)
    if only is None:
        if DEVICE == "cuda":
            section("attention", lambda: bench_attention(setup))
        section("parity", lambda: bench_parity(setup))
    for variant in TRAIN_VARIANTS if only is None else [TRAIN_VARIANTS[i] for i in only]:
        section(f"train {variant}", lambda v=variant: bench_train(setup, v, profile=v == PROFILED))


# ---------------------------------------------------------------------------------------------
# two processes: TP=2, then weight broadcast


def bench_tp_parity(setup: Setup) -> None:
    """TP=2 (sdpa spec) logits from the same checkpoint vs the TP=1 logits that `single` saved."""
    saved = torch.load(setup.work / "tp1_logits.pt")
    ids, vocab = saved["ids"].to(DEVICE), setup.shape["vocab_size"]
    model = build_model(setup, "sdpa", torch.float32, tp=2).eval()
    load_torch_dist(model, setup.work / "ckpt" / "iter_0000000")
    figures = {}
    with torch.no_grad():
        for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            model.to(dtype)
            meg = forward_logits(model, ids, gather=True)[..., :vocab].float().cpu()
            figures[f"{tag}_tp2_vs_tp1"] = logprob_diffs(meg, saved[tag], ids.cpu())
            packed = forward_logits(model, ids.reshape(1, -1), lengths=[ids.shape[1]] * 2, gather=True)[..., :vocab]
            figures[f"{tag}_tp2_packed_vs_tp1"] = logprob_diffs(packed.reshape(meg.shape).float().cpu(), saved[tag], ids.cpu())
    report(setup, "parity_tp2_vs_tp1_logprob_maxabs", **figures)


def broadcast_gbps(tensor: torch.Tensor, group: dist.ProcessGroup, repeats: int = 5) -> float:
    def once() -> None:
        dist.broadcast(tensor, src=0, group=group)
    ms = time_ms(once, repeats, warmup=2)
    return tensor.numel() * tensor.element_size() / ms / 1e6


def bench_weight_broadcast(setup: Setup, bucket_bytes: int = 512 * 2**20) -> None:
    """Rank 0 (trainer, GPU0) sends an HF-layout bf16 Qwen3 to rank 1 (engine, GPU1) in 512 MiB flat
    buckets over its own NCCL group (as SGLang's update_weights_from_distributed receives them)."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1])  # NCCL on GPUs (gloo in a CPU dry run)
    torch.manual_seed(rank)  # different weights on each side, so the copy is visible
    with torch.device(DEVICE):
        params = [p.detach() for p in transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**setup.shape))
                  .to(torch.bfloat16).parameters()]
    total = sum(p.numel() * p.element_size() for p in params)
    buckets, current, size = [], [], 0
    for p in params:
        if current and size + p.numel() * p.element_size() > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
    buckets.append(current)

    def send_all() -> None:
        for bucket in buckets:
            if rank == 0:
                flat = torch.cat([p.reshape(-1) for p in bucket])
            else:
                flat = torch.empty(sum(p.numel() for p in bucket), dtype=torch.bfloat16, device=DEVICE)
            dist.broadcast(flat, src=0, group=group)
            if rank == 1:
                torch._foreach_copy_(bucket, [x.view_as(p) for x, p in zip(flat.split([p.numel() for p in bucket]), bucket)])

    ms = time_ms(send_all, 5, warmup=1)
    checksum = torch.stack([p.float().sum() for p in params]).sum().reshape(1)
    sums = [torch.zeros_like(checksum) for _ in range(2)]
    dist.all_gather(sums, checksum, group=group)
    link = broadcast_gbps(torch.empty(4 * 2**30 if DEVICE == "cuda" else 2**26, dtype=torch.uint8, device=DEVICE), group)
    report(setup, "nccl_weight_broadcast", model_bytes=total, buckets=len(buckets), ms=round(ms, 1),
           gb_per_s=round(total / ms / 1e6, 1), plain_broadcast_4gib_gb_per_s=round(link, 1),
           received_equals_sent=bool(sums[0].item() == sums[1].item()))


def run_dist(setup: Setup) -> None:
    init_parallel(tp=2)
    section("tp2 parity", lambda: bench_tp_parity(setup))
    section("weight broadcast", lambda: bench_weight_broadcast(setup))
    for variant in TRAIN_VARIANTS[2:]:
        section(f"tp2 train {variant}", lambda v=variant: bench_train(setup, v, tp=2))
    destroy_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["single", "dist"])
    parser.add_argument("--tiny", action="store_true", help="2-layer model, short sequences (CPU dry run)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/slurmrl_bench"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "results.jsonl")
    parser.add_argument("--only", type=lambda x: [int(i) for i in x.split(",")],
                        help="single: just these TRAIN_VARIANTS, by index, in this order (repeats allowed)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    setup = Setup(TINY, 2, 64, 32, args.work, args.out) if args.tiny else \
        Setup(QWEN3_06B, 4, 2048, 512, args.work, args.out)
    if args.part == "single":
        run_single(setup, args.only)
    else:
        run_dist(setup)


if __name__ == "__main__":
    main()
