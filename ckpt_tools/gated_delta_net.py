"""Qwen3-Next's linear-attention layers (gated delta nets) as a megatron-core self-attention module.

Keyed as slime's Qwen3-Next spec keys them (slime_plugins.models.qwen3_next), so slime's torch_dist
checkpoints load: the layer's own input norm and transformers' module, by transformers' names, under
self_attention (`self_attention.input_layernorm.weight`, `self_attention.linear_attn.in_proj_qkvz.weight`,
...), and the layer's input_layernorm left empty. As slime's, the layer is not split over tensor-parallel
ranks: every rank computes it whole (under sequence parallelism on the gathered sequence, scattering
the output again), so its gradients are the same on every rank and need no sum over TP. Under context
parallelism every CP rank computes the whole samples too (the recurrence runs through them) and keeps its
own rows' output; each rank's gradient then covers its rows, and the trainer sums them over CP.

megatron-core 0.16.1's own GatedDeltaNet needs fla at construction, CUDA, and unpacked sequences: this
one runs packed micro-batches on any device, with the kernel `--qwen-gdn-backend` names.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import Tensor

from ckpt_tools.gated_delta_rule import GdnBackend, causal_conv1d, gated_delta_rule
from ckpt_tools.qwen3_next_norms import GatedRMSNorm, ZeroCenteredRMSNorm
from ckpt_tools.zigzag import whole_samples, zigzag_rows


class LinearAttention(torch.nn.Module):
    """transformers' Qwen3NextGatedDeltaNet (`split`: Qwen3_5GatedDeltaNet, whose q/k/v, z, b and a projections
    are apart) over packed rows [t, hidden] (same parameters and names)."""

    def __init__(self, config: TransformerConfig, backend: GdnBackend, split: bool = False) -> None:
        super().__init__()
        assert config.linear_num_key_heads and config.linear_num_value_heads
        assert config.linear_key_head_dim and config.linear_value_head_dim and config.linear_conv_kernel_dim
        self.backend = backend
        self.k_heads, self.v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        key, value, hidden, dtype = self.k_heads * self.k_dim, self.v_heads * self.v_dim, config.hidden_size, \
            config.params_dtype
        widths = ({"in_proj_qkv": 2 * key + value, "in_proj_z": value, "in_proj_b": self.v_heads,
                   "in_proj_a": self.v_heads} if split else {"in_proj_qkvz": 2 * key + 2 * value,
                                                             "in_proj_ba": 2 * self.v_heads})
        self.projections = list(widths)
        for name, width in widths.items():
            self.add_module(name, torch.nn.Linear(hidden, width, bias=False, dtype=dtype))
        self.conv1d = torch.nn.Conv1d(2 * key + value, 2 * key + value, config.linear_conv_kernel_dim,
                                      groups=2 * key + value, bias=False, dtype=dtype)
        self.dt_bias = torch.nn.Parameter(torch.ones(self.v_heads, dtype=dtype))
        self.A_log = torch.nn.Parameter(torch.empty(self.v_heads, dtype=dtype).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(self.v_dim, config.layernorm_epsilon, dtype)
        self.out_proj = torch.nn.Linear(value, hidden, bias=False, dtype=dtype)
        for name in self.projections:
            config.init_method(getattr(self, name).weight)
        config.output_layer_init_method(self.out_proj.weight)

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(q, k, v of every head, flat [t, 2 key + value]; z, b, a of each value head)."""
        tokens = x.shape[0]
        projected = [getattr(self, name)(x) for name in self.projections]
        if len(projected) == 4:  # Qwen3.5's: q, k, v of all heads, then z, b, a apart
            qkv, z, b, a = projected
            return qkv, z, b, a
        per_group = self.v_heads // self.k_heads
        # Qwen3-Next's: per key head, its q, k, then its value heads' v and z; b, a likewise
        qkvz, ba = projected
        q, k, v, z = qkvz.view(tokens, self.k_heads, -1).split(
            [self.k_dim, self.k_dim, per_group * self.v_dim, per_group * self.v_dim], dim=-1)
        b, a = ba.view(tokens, self.k_heads, 2 * per_group).split([per_group, per_group], dim=-1)
        return torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)], dim=-1), z, b, a

    def forward(self, x: Tensor, cu_seqlens: Tensor) -> Tensor:
        tokens = x.shape[0]
        per_group = self.v_heads // self.k_heads
        mixed, z, b, a = self._project(x)
        mixed = causal_conv1d(mixed, self.conv1d.weight.squeeze(1), cu_seqlens)
        q, k, v = mixed.split([self.k_heads * self.k_dim, self.k_heads * self.k_dim, self.v_heads * self.v_dim], -1)
        q, k = (t.reshape(tokens, self.k_heads, self.k_dim).repeat_interleave(per_group, dim=1) for t in (q, k))
        beta = b.reshape(tokens, self.v_heads).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(tokens, self.v_heads).float() + self.dt_bias)
        out = gated_delta_rule(q, k, v.reshape(tokens, self.v_heads, self.v_dim), g, beta, cu_seqlens, self.backend)
        out = self.norm(out, z.reshape(tokens, self.v_heads, self.v_dim))
        return self.out_proj(out.reshape(tokens, -1))


def sequence_bounds(attention_mask: Tensor | None, batch: int, seq: int) -> Tensor:
    """cu_seqlens of unpacked rows [b, s] flattened: a row is one sequence, or under a block-diagonal causal mask
    ([b or 1, 1, s, s], True = masked; the local attention's packing) several, each starting at a token that may
    not see the one before it."""
    bounds = []
    for row in range(batch):
        starts = [] if attention_mask is None else (
            attention_mask[min(row, attention_mask.shape[0] - 1), 0].diagonal(-1).nonzero().flatten() + 1).tolist()
        bounds += [row * seq + start for start in [0, *starts]]
    return torch.tensor([*bounds, batch * seq], dtype=torch.int32)


class GatedDeltaNetAttention(MegatronModule):
    """A decoder layer's token mixer: Qwen3-Next's input norm, then its gated delta net. Takes
    megatron's SelfAttention constructor and forward arguments; [s, b, h] in (this rank's sequence slice
    under SP), (output, None) out."""

    def __init__(self, config: TransformerConfig, layer_number: int, backend: GdnBackend = "torch",
                 split: bool = False, **_: Any) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.layernorm_epsilon, config.params_dtype)
        self.linear_attn = LinearAttention(config, backend, split)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None, **_: Any) -> tuple[Tensor, None]:
        sp_group = parallel_state.get_tensor_model_parallel_group() if self.config.sequence_parallel else None
        if sp_group is not None:  # the whole sequence on every rank; the backward keeps this rank's slice
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=sp_group)
        cp_group = parallel_state.get_context_parallel_group() if self.config.context_parallel_size > 1 else None
        if packed_seq_params is not None:
            cu_seqlens = packed_seq_params.cu_seqlens_q.cpu()
        else:
            cu_seqlens = sequence_bounds(attention_mask, hidden_states.shape[1], hidden_states.shape[0])
        if cp_group is not None:  # the recurrence runs through whole samples: every CP rank computes them all
            assert packed_seq_params is not None, "context parallelism packs its rows (thd)"
            hidden_states = whole_samples(hidden_states, cu_seqlens, cp_group)
        seq, batch, hidden = hidden_states.shape
        rows = self.input_layernorm(hidden_states).transpose(0, 1).reshape(batch * seq, hidden)
        out = self.linear_attn(rows, cu_seqlens).reshape(batch, seq, hidden).transpose(0, 1).contiguous()
        if cp_group is not None:  # this rank's rows again (the backward of whole_samples sums the others')
            rank, size = torch.distributed.get_rank(cp_group), torch.distributed.get_world_size(cp_group)
            out = out[zigzag_rows(cu_seqlens, size, rank).to(out.device)]
        if sp_group is not None:
            out = tensor_parallel.scatter_to_sequence_parallel_region(out, group=sp_group)
        return out, None


def gated_delta_net_layer(layer: ModuleSpec, backend: GdnBackend, split: bool) -> ModuleSpec:
    """`layer`'s spec with a gated delta net (`split`: Qwen3.5's projections) for its token mixer (which holds
    the layer's input norm)."""
    layer = copy.deepcopy(layer)
    layer.submodules.input_layernorm = IdentityOp
    layer.submodules.self_attention = ModuleSpec(module=GatedDeltaNetAttention,
                                                 params={"backend": backend, "split": split})
    return layer
