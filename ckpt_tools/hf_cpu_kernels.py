"""transformers' Qwen3-Next (and Qwen3.5) takes flash-linear-attention's and causal-conv1d's kernels for its gated
delta nets wherever those packages are installed, chosen at import whatever the tensors' device: on the CPU they
fail (Triton reads no host memory). `use_torch_kernels()` puts transformers' own torch functions back, for models
that run on the CPU on such a machine: ckpt verify's reference, the stand-in engine with --device cpu, the tests'
references."""

from __future__ import annotations

import inspect

_KERNELS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
            "causal_conv1d_update")


def use_torch_kernels() -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
    from transformers.models.qwen3_next import modeling_qwen3_next

    for module in (modeling_qwen3_next, modeling_qwen3_5, modeling_qwen3_5_moe):
        for name in _KERNELS:  # each is transformers' torch function wrapped by its kernel picker
            setattr(module, name, inspect.unwrap(getattr(module, name)))
