"""MiniMax-M2's q/k norms: one RMSNorm over all heads of a token (num_heads x head_dim for q,
num_kv_heads x head_dim for k), where megatron-core's q/k layernorms normalise each head alone.

Under tensor parallelism each rank holds some heads. The sum of squares is summed over the TP group
(an all-reduce whose backward is an all-reduce too: every rank's output depends on every rank's
input), and each rank scales its heads by its slice of the full, replicated weight. That weight's
gradient is then nonzero on this rank's slice only, so the sum over TP that the trainer takes of
every q/k layernorm's gradient counts each element once; a gather-norm-scatter (slime's) would give
every rank the full gradient, and that sum would count it TP times.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer import TransformerConfig


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class FullHeadsRMSNorm(torch.nn.Module):
    """RMSNorm over `heads` heads of config.kv_channels at once; takes [..., local heads, head_dim]."""

    def __init__(self, config: TransformerConfig, heads: int, eps: float) -> None:
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(f"normalization {config.normalization!r} is not supported; MiniMax-M2 uses RMSNorm")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(heads * config.kv_channels, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(*x.shape[:-2], -1)
        squares = flat.float().pow(2).sum(-1, keepdim=True)
        width, tp = flat.shape[-1], parallel_state.get_tensor_model_parallel_world_size()
        if tp > 1:
            squares = _AllReduceSum.apply(squares, parallel_state.get_tensor_model_parallel_group())
        normed = (flat.float() * torch.rsqrt(squares / self.weight.numel() + self.eps)).to(x.dtype)
        start = parallel_state.get_tensor_model_parallel_rank() * width if tp > 1 else 0
        return (self.weight[start:start + width] * normed).reshape(x.shape)


class FullQNorm:
    """The q norm as a layer spec's q_layernorm (megatron passes one head's width: the norm takes all heads')."""

    def __new__(  # type: ignore[misc]  # a factory class: megatron's build_module calls a class
            cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object) -> FullHeadsRMSNorm:
        return FullHeadsRMSNorm(config, config.num_attention_heads, eps)


class FullKNorm:
    """The k norm as a layer spec's k_layernorm, over all key/value heads."""

    def __new__(  # type: ignore[misc]
            cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object) -> FullHeadsRMSNorm:
        return FullHeadsRMSNorm(config, config.num_query_groups or config.num_attention_heads, eps)
