"""GLM-4-0414's decoder layer: megatron-core's TransformerLayer with a norm on the attention's output
and one on the MLP's, each applied before its residual add (transformers' Glm4DecoderLayer:
post_self_attn_layernorm, post_mlp_layernorm).

megatron-core 0.16.1 has no such submodules (slime's megatron fork adds them under these names,
which its torch_dist checkpoints keep). Each norm is applied inside the layer's bias-dropout-add,
where the sublayer's output meets the residual, so the rest of TransformerLayer runs unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

BiasDropoutAdd = Callable[[bool, bool], Callable[..., torch.Tensor]]


@dataclass
class PostNormLayerSubmodules(TransformerLayerSubmodules):
    post_self_attn_layernorm: ModuleSpec | type = IdentityOp
    post_mlp_layernorm: ModuleSpec | type = IdentityOp


class PostNormTransformerLayer(TransformerLayer):
    def __init__(self, config: Any, submodules: PostNormLayerSubmodules, **kwargs: Any) -> None:
        super().__init__(config, submodules, **kwargs)
        for norm_name, bda_name in (("post_self_attn_layernorm", "self_attn_bda"), ("post_mlp_layernorm", "mlp_bda")):
            norm = build_module(getattr(submodules, norm_name), config=self.config, hidden_size=self.config.hidden_size,
                                eps=self.config.layernorm_epsilon)
            setattr(self, norm_name, norm)
            setattr(self, bda_name, _normed(getattr(self, bda_name), norm))


def _normed(bias_dropout_add: BiasDropoutAdd, norm: torch.nn.Module) -> BiasDropoutAdd:
    """A bias-dropout-add that normalises the sublayer's output before adding it to the residual."""

    def build(training: bool, fused: bool) -> Callable[..., torch.Tensor]:
        add = bias_dropout_add(training, fused)

        def normed_add(output_and_bias: tuple[torch.Tensor, torch.Tensor | None], residual: torch.Tensor,
                       prob: float) -> torch.Tensor:
            output, bias = output_and_bias
            if bias is not None:  # GLM's linears have none (--disable-bias-linear); the norm would take output + bias
                raise ValueError("post norms need the attention's and the MLP's output linears without a bias")
            return add((norm(output), None), residual, prob)

        return normed_add

    return build


def with_post_norms(layer: ModuleSpec, norm: type) -> ModuleSpec:
    """`layer` (a TransformerLayer spec) as a PostNormTransformerLayer whose two post norms are `norm`s."""
    kept = {f.name: getattr(layer.submodules, f.name) for f in fields(TransformerLayerSubmodules)}
    return ModuleSpec(module=PostNormTransformerLayer, params=layer.params, submodules=PostNormLayerSubmodules(
        **kept, post_self_attn_layernorm=norm, post_mlp_layernorm=norm))
