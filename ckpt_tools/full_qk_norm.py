"""MiniMax-M2's q/k norms: one RMSNorm over all heads of a token (num_heads x head_dim for q,
num_kv_heads x head_dim for k), where megatron-core's q/k layernorms normalise each head alone.

Under tensor parallelism each rank holds some heads. The sum of squares is summed over the TP group
(an all-reduce whose backward is an all-reduce too: every rank's output depends on every rank's
input), and each rank scales its heads by its slice of the full, replicated weight. That weight's
gradient is then nonzero on this rank's slice only, so the sum over TP that the trainer takes of
every q/k norm's gradient (trainer.megatron.backend) counts each element once; a gather-norm-scatter
(slime's) would give every rank the full gradient, and that sum would count it TP times.

They are the attention's q_norm and k_norm (megatron keys ...self_attention.q_norm.weight), as slime's
MiniMaxM2SelfAttention names them (no slime-written checkpoint has been read to confirm the rest of its keys).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from torch import Tensor


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
        flat = x.reshape(*x.shape[:-2], -1).float()  # one fp32 copy serves the squares and the scaling
        squares = flat.pow(2).sum(-1, keepdim=True)
        width, tp = flat.shape[-1], parallel_state.get_tensor_model_parallel_world_size()
        if tp > 1:
            squares = _AllReduceSum.apply(squares, parallel_state.get_tensor_model_parallel_group())
        normed = (flat * torch.rsqrt(squares / self.weight.numel() + self.eps)).to(x.dtype)
        start = parallel_state.get_tensor_model_parallel_rank() * width if tp > 1 else 0
        return (self.weight[start:start + width] * normed).reshape(x.shape)


class FullQKNormSelfAttention(SelfAttention):
    """megatron's SelfAttention whose q and k are normalised over all heads (q_norm, k_norm), not per head."""

    def __init__(self, config: TransformerConfig, submodules: SelfAttentionSubmodules, *args: Any,
                 **kwargs: Any) -> None:
        super().__init__(config, replace(submodules, q_layernorm=None, k_layernorm=None), *args, **kwargs)
        self.q_norm = FullHeadsRMSNorm(config, config.num_attention_heads, config.layernorm_epsilon)
        self.k_norm = FullHeadsRMSNorm(config, config.num_query_groups or config.num_attention_heads,
                                       config.layernorm_epsilon)

    def get_query_key_value_tensors(self, hidden_states: Tensor, key_value_states: Tensor | None = None,
                                    output_gate: bool = False, split_qkv: bool = True) -> Any:
        if not split_qkv:  # megatron's fused q/k/v RoPE (TransformerEngine's) would skip the norms
            raise ValueError("MiniMax-M2's q/k norms need q, k and v split (no fused_single_qkv_rope)")
        query, key, *rest = super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate)
        return (self.q_norm(query), self.k_norm(key), *rest)
