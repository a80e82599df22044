"""Context parallelism's zigzag layout of packed samples (megatron's and slime's; trainer.context_parallel lays
rows out so): every sample padded to a multiple of 2 * CP and cut into 2 * CP equal chunks, CP rank r holding
chunks r and 2 * CP - 1 - r of every sample, in pack order. `cu_seqlens` are the padded samples' global bounds."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import Tensor


def zigzag_rows(cu_seqlens: Tensor, cp: int, rank: int) -> Tensor:
    """The padded pack's rows CP rank `rank` holds: chunks rank and 2 * cp - 1 - rank of each sample."""
    parts = []
    for start, end in itertools.pairwise(cu_seqlens.tolist()):
        seg = (end - start) // (2 * cp)
        parts += [torch.arange(start + rank * seg, start + (rank + 1) * seg),
                  torch.arange(start + (2 * cp - 1 - rank) * seg, start + (2 * cp - rank) * seg)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


class _GatherRanks(torch.autograd.Function):
    """[t, ...] on each rank -> [cp, t, ...] everywhere; backward: the sum of every rank's gradient
    of this rank's part (a reduce-scatter; gloo has none, so an all-reduce there)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "nccl":
            out = torch.empty_like(grad[0])
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


# Eager under --torch-compile: a traced collective inside an autograd.Function loses the gradient's
# path on a GPU (trainer/megatron/compile.py says how it was found).
_gather_ranks = torch.compiler.disable(_GatherRanks.apply)


def whole_samples(local: Tensor, cu_seqlens: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Every CP rank's zigzag rows ([t, ...] here) -> the padded samples whole and in order ([T, ...]) on every
    rank; the backward sums every rank's gradient of a row back to the rank that holds it."""
    cp = dist.get_world_size(group)
    gathered = _gather_ranks(local, group)  # [cp, t, ...]
    chunks = []
    for start, end in itertools.pairwise(cu_seqlens.tolist()):
        seg, mine = (end - start) // (2 * cp), start // cp
        # Chunk j of the sample: on rank j (its first half) for j < cp, else on rank 2cp-1-j (second half).
        chunks += [gathered[j, mine:mine + seg] if j < cp else gathered[2 * cp - 1 - j, mine + seg:mine + 2 * seg]
                   for j in range(2 * cp)]
    return torch.cat(chunks)
