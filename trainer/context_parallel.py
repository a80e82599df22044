"""Where a packed micro-batch's rows live on this rank: sequence-parallel padding and context
parallelism (--context-parallel-size) for packed (thd) rows, without TransformerEngine.

CP layout (megatron's and slime's): every sample of a pack is padded at its end to a multiple of
2 * CP (times TP under sequence parallelism) and cut into 2 * CP equal chunks; CP rank r holds
chunks r and 2 * CP - 1 - r of every sample, in pack order (the zigzag gives every rank the same
causal attention work). The model gets these local tokens with the padded samples' global
cu_seqlens, which megatron's thd RoPE reads to give each chunk its global positions.

Attention (`cp_attention`) gathers K and V over the CP group (the backward sums their gradients
back to the rank that owns them) and masks causally by global position. The per-token outputs the
loss needs (log-probs, entropies, values of the rows before response tokens) are gathered over
the CP group in sample order (`RowLayout.per_sample`); that gather's backward keeps this rank's
part only, because every CP rank computes the same loss from the same gathered values. Gradients
of the replicated weights are then summed over the data-parallel x CP group, as megatron does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ckpt_tools.zigzag import whole_samples, zigzag_rows
from trainer.batch import Pack, TrainSample, response_slices


@dataclass
class RowLayout:
    """This rank's rows of one pack, and how its outputs become per-sample response tensors."""

    tokens: Tensor  # int64 [t]: the tokens this rank feeds the model
    positions: Tensor  # int64 [t]: their positions within their sample
    cu_seqlens: Tensor  # int32 [n + 1]: the padded samples (global lengths, as megatron's thd wants)
    rows: Tensor  # int64 [m]: rows of the model's output that predict a response token
    targets: Tensor  # int64 [m]: the token each of those rows predicts
    lengths: list[int]  # response tokens per sample
    group: dist.ProcessGroup | None = None  # the CP group when CP > 1
    counts: list[int] | None = None  # response rows held by each CP rank
    order: Tensor | None = None  # gathered rows -> sample order
    token_weights: Tensor | None = None  # float [t]: each fed token's loss mask (the MTP loss: trainer.megatron.mtp)

    def per_sample(self, values: Tensor) -> list[Tensor]:
        """values [m] (one per entry of `rows`) -> one [R] tensor per sample of the pack."""
        if self.group is not None:
            assert self.order is not None, "a CP pack's rows carry their gathered order"
            values = _GatherRows.apply(values, self.counts, self.group)[self.order.to(values.device)]
        return list(values.split(self.lengths))


def layout(pack: Pack, samples: list[TrainSample], multiple: int, group: dist.ProcessGroup | None) -> RowLayout:
    """The rows of `pack` this rank computes. Without CP (group None) the whole pack, padded at
    its end to a multiple of `multiple` tokens (sequence parallelism splits it evenly over TP) by
    a sequence of its own, which causal attention keeps out of every real token's view. With CP,
    the zigzag chunks of the module docstring, each sample padded to 2 * CP * `multiple`."""
    slices = response_slices(pack, samples)
    lengths = [s.stop - s.start for s in slices]
    if group is None:
        rows = torch.cat([torch.arange(s.start, s.stop) for s in slices])
        tokens, positions, cu = pack.tokens, pack.position_ids, pack.cu_seqlens
        pad = -len(tokens) % multiple
        if pad:
            tokens = torch.cat([tokens, tokens.new_zeros(pad)])
            positions = torch.cat([positions, torch.arange(pad, dtype=positions.dtype)])
            cu = torch.cat([cu, cu[-1:] + pad])
        return RowLayout(tokens, positions, cu, rows, pack.tokens[rows + 1], lengths)
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    unit = 2 * cp * multiple
    bounds = pack.cu_seqlens.tolist()
    padded = [-(-(b - a) // unit) * unit for a, b in itertools.pairwise(bounds)]
    cu = torch.tensor([0, *padded], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    tokens = torch.zeros(int(cu[-1]), dtype=torch.int64)
    targets = torch.zeros_like(tokens)
    response = torch.zeros_like(tokens, dtype=torch.bool)
    for k, (a, b) in enumerate(itertools.pairwise(bounds)):
        start = int(cu[k])
        tokens[start:start + b - a] = pack.tokens[a:b]
        targets[start:start + b - a - 1] = pack.tokens[a + 1:b]
        response[start + slices[k].start - a:start + slices[k].stop - a] = True
    held = [zigzag_rows(cu, cp, r) for r in range(cp)]
    mine = held[me]
    local_rows = response[mine].nonzero().squeeze(-1)
    gathered = torch.cat([h[response[h]] for h in held])
    return RowLayout(tokens[mine], torch.cat([torch.arange(n) for n in padded])[mine], cu, local_rows,
                     targets[mine][local_rows], lengths, group,
                     [int(response[h].sum()) for h in held], gathered.argsort())


def cp_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, scale: float,
                 group: dist.ProcessGroup) -> Tensor:
    """Causal attention of this CP rank's rows (q [t, np, hn], k/v [t, ng, hn], the zigzag layout
    of padded samples `cu_seqlens`) over every rank's keys and values -> [t, np * hn]."""
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    kv = whole_samples(torch.stack([key, value], dim=1), cu_seqlens, group)  # [T, 2, ng, hn]
    out = []
    for start, end in itertools.pairwise(cu_seqlens.tolist()):
        seg, local = (end - start) // (2 * cp), start // cp
        k, v = kv[start:end].unbind(1)
        q_pos = torch.cat([torch.arange(me * seg, (me + 1) * seg),
                           torch.arange((2 * cp - 1 - me) * seg, (2 * cp - me) * seg)])
        visible = (q_pos[:, None] >= torch.arange(end - start)[None]).to(query.device)  # True = attend
        q = query[local:local + 2 * seg]
        out.append(F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                  attn_mask=visible, scale=scale, enable_gqa=True).transpose(0, 1))
    result = torch.cat(out)
    return result.reshape(result.shape[0], -1)


class _GatherRows(torch.autograd.Function):
    """Every rank's [counts[r]] rows, concatenated in rank order; backward: this rank's part of the
    gradient (every rank computed the same loss from the gathered rows)."""

    @staticmethod
    def forward(ctx, x: Tensor, counts: list[int], group) -> Tensor:
        me = dist.get_rank(group)
        ctx.span = (sum(counts[:me]), sum(counts[:me + 1]))
        longest = max(counts)
        padded = torch.cat([x, x.new_zeros(longest - x.shape[0], *x.shape[1:])])
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad[ctx.span[0]:ctx.span[1]], None, None
