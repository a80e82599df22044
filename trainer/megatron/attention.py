"""Fused core attention for megatron-core GPT layers, without TransformerEngine.

megatron-core's own `DotProductAttention` (the local spec) materialises the [b, np, s, s] score
matrix and refuses packed sequences; TransformerEngine, which has the fused kernels, is not
installed here. `SDPAttention` takes its place in the layer spec and runs
torch.nn.functional.scaled_dot_product_attention (flash / memory-efficient kernels on GPU).

Packed sequences (several samples concatenated into one row) come with megatron's
`PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=m,
max_seqlen_kv=m)`: megatron's Attention then hands over q/k/v as [t, heads, head_dim] with RoPE
already applied per sequence, and each sequence attends causally to itself only. Under context
parallelism q/k/v are this rank's chunks of each sequence (trainer.context_parallel). Keep `cu` (int32)
on the CPU: megatron's per-sequence RoPE reads it with .tolist() twice a layer, a host sync each
time were it on the GPU; SDPAttention copies it to the device itself.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.post_training.modelopt.layers import Linear as ReplicatedLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
)
from torch import Tensor

from ckpt_tools.full_qk_norm import FullQKNormSelfAttention
from ckpt_tools.gated_delta_rule import GdnBackend, check_fla_trains
from ckpt_tools.megatron_model import stage_layer_specs
from ckpt_tools.mla_attention import MLADotProductAttention
from ckpt_tools.post_norm_layer import with_post_norms
from trainer.context_parallel import cp_attention
from trainer.megatron.norm import HeadNorm, HiddenStateNorm

# flash-attention varlen kernel (torch >= 2.10); CUDA with 16-bit inputs only
varlen_attn: Callable[..., Tensor | tuple[Tensor, Tensor]] | None
try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
    varlen_attn = _varlen_attn
except ImportError:
    varlen_attn = None

if varlen_attn is not None:
    # Its causal flag moved into window_size, and GQA became opt-in, across torch releases.
    _params = inspect.signature(varlen_attn).parameters
    _VARLEN_KWARGS: dict = {"window_size": (-1, 0)} if "window_size" in _params else {"is_causal": True}
    if "enable_gqa" in _params:
        _VARLEN_KWARGS["enable_gqa"] = True

AttentionKind = Literal["sdpa", "local"]


def _causal_sdpa(query: Tensor, key: Tensor, value: Tensor, scale: float | None) -> Tensor:
    """Causal attention over one sequence, [s, heads, head_dim] in and out."""
    q, k, v = (x.transpose(0, 1) for x in (query, key, value))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1)


class SDPAttention(MegatronModule):
    """Drop-in for megatron's core attention (same constructor and forward arguments).

    Unpacked: q [s, b, np, hn], k/v [s, b, ng, hn] -> [s, b, np * hn]; causal unless an explicit
    attention_mask (bool, True = masked, broadcastable to [b, np, s, s]) is given.
    Packed (thd): q [t, np, hn], k/v [t, ng, hn] -> [t, np * hn]; causal within each sequence.
    Heads are this TP rank's; ng < np (GQA) is handled inside the kernels.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection=None, k_channels: int | None = None, v_channels: int | None = None) -> None:
        # k_channels / v_channels: multi-latent attention's head widths; the kernels read them off q/k/v.
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        # The kernels below run without dropout, softmax variants or windows:
        # refuse such configs rather than silently computing something else.
        unsupported = {
            "attention_dropout": dropout != 0.0, "softmax_type": config.softmax_type != "vanilla",
            "window_size": config.window_size is not None,
            "attn_mask_type": attn_mask_type != AttnMaskType.causal,
        }
        if any(unsupported.values()):
            raise ValueError(f"SDPAttention does not support {[k for k, v in unsupported.items() if v]}")
        # apply_query_key_layer_scaling cancels out in DotProductAttention (the scale is divided by
        # the layer number and the softmax multiplies it back), so it is ignored here too.
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: AttnMaskType | None = None, attention_bias: Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> Tensor:
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support attention_bias")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        seq, batch = query.shape[:2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, hn]
        mask = None if attention_mask is None else ~attention_mask  # SDPA: True = attend
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             scale=self.softmax_scale, enable_gqa=True)
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, params: PackedSeqParams) -> Tensor:
        if params.qkv_format != "thd":
            raise ValueError(f"SDPAttention packs only qkv_format='thd', got {params.qkv_format!r}")
        cu = params.cu_seqlens_q
        others = (params.cu_seqlens_kv, params.cu_seqlens_q_padded, params.cu_seqlens_kv_padded)
        if any(o is not None and o is not cu and not torch.equal(o, cu) for o in others):
            raise ValueError("SDPAttention needs self-attention packs without padding (cu_seqlens_q == kv)")
        if self.config.context_parallel_size > 1:  # this rank's zigzag chunks of global cu_seqlens
            return cp_attention(query, key, value, cu, self.softmax_scale, parallel_state.get_context_parallel_group())
        if varlen_attn is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
            max_len = int(params.max_seqlen_q)
            cu = cu.to(query.device, non_blocking=True)
            out = varlen_attn(query, key, value, cu, cu, max_len, max_len, scale=self.softmax_scale, **_VARLEN_KWARGS)
            assert isinstance(out, Tensor), "without return_aux, varlen_attn returns the output alone"
        else:  # CPU / fp32: one causal SDPA call per sequence
            out = torch.cat([_causal_sdpa(query[a:b], key[a:b], value[a:b], self.softmax_scale)
                             for a, b in itertools.pairwise(cu.tolist())])
        return out.reshape(out.shape[0], -1)


def gpt_layer_spec(num_experts: int | None, qk_layernorm: bool, attention: AttentionKind,
                   multi_latent_attention: bool = False, full_qk_norm: bool = False) -> ModuleSpec:
    """The GPTModel layer spec (RMSNorm, local linears): megatron's local spec with norms that also
    run under sequence parallelism (trainer.megatron.norm), and its core attention replaced by
    SDPAttention when attention == "sdpa". With multi-latent attention (DeepSeek), the q/kv norms
    are those of the latents and the local core attention is one that takes MLA's head widths.
    full_qk_norm: MiniMax-M2's q/k norms over all heads at once (ckpt_tools.full_qk_norm)."""
    if attention not in ("sdpa", "local"):
        raise ValueError(f"attention must be 'sdpa' or 'local', got {attention!r}")
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm,
                                    normalization="RMSNorm", multi_latent_attention=multi_latent_attention)
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = HiddenStateNorm
    attn = spec.submodules.self_attention.submodules
    if qk_layernorm:
        if multi_latent_attention:  # the latents are split along the sequence under SP, as hidden states
            attn.q_layernorm = attn.kv_layernorm = HiddenStateNorm
        elif full_qk_norm:
            spec.submodules.self_attention.module = FullQKNormSelfAttention
        else:
            attn.q_layernorm = attn.k_layernorm = HeadNorm
    if attention == "sdpa":
        attn.core_attention = SDPAttention
    elif multi_latent_attention:
        attn.core_attention = MLADotProductAttention
    return spec


def gpt_block_spec(config: TransformerConfig, attention: AttentionKind, post_norms: bool = False,
                   full_qk_norm: bool = False, gdn_backend: GdnBackend = "torch",
                   split_gdn: bool = False) -> ModuleSpec:
    """The whole decoder's spec: gpt_layer_spec for every layer (its dense variant for the dense
    layers of megatron's moe_layer_freq list, DeepSeek's first_k_dense_replace) and the final norm,
    which megatron would otherwise build as WrappedTorchNorm (it refuses sequence parallelism).
    Under pipeline parallelism, this stage's layers only. post_norms: GLM-4-0414's norms of the
    attention's and the MLP's outputs (ckpt_tools.post_norm_layer); full_qk_norm: MiniMax-M2's q/k norms;
    gdn_backend: the kernel of Qwen3-Next's gated delta net layers (ckpt_tools.gated_delta_net); split_gdn:
    their projections Qwen3.5's."""

    if isinstance(config.linear_attention_freq, list) and gdn_backend == "fla":
        check_fla_trains()  # stops here, naming the flag, where fla is not installed or cannot train

    def layer_spec(num_experts: int | None) -> ModuleSpec:
        layer = gpt_layer_spec(num_experts, config.qk_layernorm, attention, config.multi_latent_attention,
                               full_qk_norm)
        if config.multi_latent_attention and config.tensor_model_parallel_size > 1:
            # megatron-core 0.16.1's column-parallel q/kv down-projections give k_pos_emb (shared by all
            # heads) the gradient of this rank's heads only; replicated ones (TE's "duplicated" mode)
            # sum it over TP, their weights' gradients summed as sequence-parallel ones (MLA accepts
            # megatron's replicated Linear by identity only; ckpt_tools.megatron_compat gives it extra state).
            mla = layer.submodules.self_attention.submodules
            mla.linear_q_down_proj = mla.linear_kv_down_proj = ReplicatedLinear
        return with_post_norms(layer, HiddenStateNorm) if post_norms else layer

    return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
        layer_specs=stage_layer_specs(config, layer_spec, gdn_backend, split_gdn), layer_norm=HiddenStateNorm))
