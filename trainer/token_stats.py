"""Per-token log-probs and entropies from (possibly vocab-parallel) logits, with gradients.

Under tensor parallelism each rank holds a slice of the vocabulary; the softmax's max and sums
are reduced over the TP group so the full-vocabulary logits are never gathered. Sums go through
megatron's reduce_from_tensor_model_parallel_region semantics (all-reduce forward, identity
backward), which is the right gradient for a sum of per-rank terms. With group None (TP=1, or an
HF model) it is the plain computation. slime's --log-probs-chunk-size bounds the fp32 copies of the
logits to that many rows at a time (chunked_log_probs_and_entropy).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint


class _AllReduceSum(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def _sum(x: Tensor, group) -> Tensor:
    return _AllReduceSum.apply(x, group) if group is not None else x


def log_probs_and_entropy(logits: Tensor, targets: Tensor, vocab_start: int = 0, valid_vocab: int | None = None,
                          group=None, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """logits [N, V_local] (this rank's vocab columns vocab_start .. vocab_start + V_local),
    targets [N] (global token ids). Columns at or beyond `valid_vocab` (this rank's share of the
    real vocabulary; the rest is Megatron's padding) are excluded. Returns log p(target) [N] and,
    if asked, the entropy [N], both fp32."""
    logits = logits.float()
    if valid_vocab is not None and valid_vocab < logits.shape[-1]:
        logits = logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) >= valid_vocab, float("-inf"))
    peak = logits.detach().max(dim=-1).values
    if group is not None:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - peak.unsqueeze(-1)
    exp = shifted.exp()
    log_z = torch.log(_sum(exp.sum(-1), group))
    local = targets - vocab_start
    here = (local >= 0) & (local < logits.shape[-1])
    picked = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = _sum(torch.where(here, picked, torch.zeros_like(picked)), group)
    logp = target_logit - log_z
    if not with_entropy:
        return logp, None
    probs = exp / log_z.exp().unsqueeze(-1)
    # -inf * 0 would be nan for the padded columns: they contribute nothing.
    weighted = torch.where(probs > 0, probs * shifted, torch.zeros_like(probs)).sum(-1)
    return logp, log_z - _sum(weighted, group)


TokenStats = Callable[..., tuple[Tensor, Tensor | None]]


def chunked_log_probs_and_entropy(logits: Tensor, targets: Tensor, vocab_start: int = 0,
                                  valid_vocab: int | None = None, group=None, with_entropy: bool = False, *,
                                  chunk_size: int = -1, stats: TokenStats = log_probs_and_entropy,
                                  ) -> tuple[Tensor, Tensor | None]:
    """`stats` (log_probs_and_entropy, or its compiled self) over `chunk_size` rows at a time (<= 0:
    all at once): its fp32 [rows, vocab] intermediates exist for one chunk, in the backward pass too,
    where each chunk is computed again instead of kept. Each row's numbers are its own, so the result
    is that of one call. Every TP rank walks the same chunks, so their all-reduces pair up."""
    if chunk_size <= 0 or logits.shape[0] <= chunk_size:
        return stats(logits, targets, vocab_start, valid_vocab, group, with_entropy)
    keep = torch.is_grad_enabled() and logits.requires_grad
    parts = [checkpoint(stats, rows, wanted, vocab_start, valid_vocab, group, with_entropy, use_reentrant=False)
             if keep else stats(rows, wanted, vocab_start, valid_vocab, group, with_entropy)
             for rows, wanted in zip(logits.split(chunk_size), targets.split(chunk_size))]
    logp = torch.cat([part[0] for part in parts])
    return logp, torch.cat([part[1] for part in parts if part[1] is not None]) if with_entropy else None
