"""The hidden-state norm hands the next linear autocast's dtype: under --bf16 on a GPU, sequence
parallelism's column-parallel linear reduce-scatters its input's gradient into a buffer of the
input's dtype, which must be the gradient's (bf16), as the 2-GPU run found."""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig

from ckpt_tools import megatron_compat
from trainer.megatron.norm import HiddenStateNorm

megatron_compat.apply()


def test_the_norm_output_takes_autocasts_dtype_and_the_same_values() -> None:
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm")
    norm = HiddenStateNorm(config, 8, eps=1e-6)
    x = torch.randn(3, 8)
    plain = norm(x)
    assert plain.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = norm(x)
    assert cast.dtype == torch.bfloat16
    assert torch.equal(cast, plain.to(torch.bfloat16))
    assert torch.allclose(plain, torch.nn.functional.rms_norm(x, (8,), norm.weight, 1e-6))
