"""Qwen3-Next's two RMSNorms, computed as transformers' Qwen3NextRMSNorm and Qwen3NextRMSNormGated do.

ZeroCenteredRMSNorm is megatron's `--apply-layernorm-1p` (layernorm_zero_centered_gamma): the weight is
stored as w, starts at zero, and scales by 1 + w, in fp32. megatron-core's torch norm refuses it (only
TransformerEngine's has it), so the decoder's norms (input, pre-MLP, final, q/k) take this one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' arithmetic, not F.rms_norm's fused one: logits agree to float32 rounding
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """RMSNorm scaling by 1 + weight (stored zero-centred), in fp32, the output in the input's dtype."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__(hidden_size, eps=eps, dtype=dtype)
        torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.eps is not None
        out = _rms(x.float(), self.eps) * (1.0 + self.weight.float())
        return out.to(x.dtype)


class GatedRMSNorm(torch.nn.Module):
    """A gated delta net's output norm: RMSNorm over each head (weight starting at one), then times
    SiLU(gate); transformers applies the weight after casting back to the input's dtype."""

    def __init__(self, head_dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(head_dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = _rms(x.float(), self.eps).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class ZeroCenteredNorm:
    """ZeroCenteredRMSNorm from megatron's norm constructor arguments (a factory class, as megatron's
    WrappedTorchNorm: build_module calls a class)."""

    def __new__(  # type: ignore[misc]
            cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object) -> ZeroCenteredRMSNorm:
        return ZeroCenteredRMSNorm(hidden_size, eps, config.params_dtype)
